"""The GPU cost model's parameters (an Efficiency for hardware.Roofline) fitted to published measurements
(measurements.py), and checked against one it was not fitted to. docs/cost-model.md has the numbers;
`python -m pat_workers.sim.calibration` prints them.

Each fit is a weighted linear least-squares (numpy.linalg.lstsq; numpy is a dependency of the workers), rows scaled
by 1/measured so that relative errors count alike. Every term is linear in its parameters, so no iterative solver:
1. all-reduce, SGLang's custom all-reduce on H100 (TP 2/4/8, 2 KB to 4 MB):
   seconds = latency + per_doubling * log2(t) + 2 (t - 1) / t * bytes / (link_fraction * NVLink bandwidth);
2. decode at batch 1, gpt-fast on A100 (TP 1/2/4/8), the all-reduces of 1. subtracted:
   step - all-reduces = layers * layer_floor + (weight + KV bytes per rank) / (memory * HBM bandwidth).
Held out: vLLM 0.5.4 on H100 (FP8 Llama-3.1-8B, 320 ShareGPT requests). That engine spends most of each step on the
CPU between GPU steps (step_overhead_s), which no training measurement has: that one number is taken from the
curve's TP1 point (its step time less the model's GPU time), and the TP2/4/8 points are predicted. holdout_error is
the largest relative error of their per-GPU throughput. As that CPU time is most of every step there, the holdout
tests little of the GPU terms; extrapolation_error does: 2. fitted on gpt-fast's TP1/2/4 points alone, the relative
error at its TP8 point.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pat_operator.fit import GPUS, SHAPES

from .hardware import AllReduce, Efficiency, Roofline, step_seconds
from .measurements import GPT_FAST_A100, SGLANG_ALLREDUCE_H100, VLLM_H100, AllReduceTimes, DecodeCurve

SOURCE = ("fitted (docs/cost-model.md): HBM efficiency and per-layer floor to gpt-fast's A100 batch-1 TP curve, "
          "all-reduce to SGLang's H100 timings; no per-step CPU time (a graph-captured engine); compute, KV moves "
          "and the memory reserve assumed")


@dataclass(frozen=True)
class Calibration:
    gpu_model: Efficiency
    training_errors: dict[str, dict]  # measurement name -> {its point: relative error of the fitted model}
    holdout_overhead_s: float  # the held-out engine's per-step CPU time, from its TP1 point
    holdout_predicted: dict[int, float]  # tp -> tokens/s per GPU
    holdout_errors: dict[int, float]  # tp -> relative error, TP1 (the anchor) left out
    extrapolation_error: float  # at gpt-fast's TP8 point, fitted without it

    @property
    def holdout_error(self) -> float:
        return max(abs(e) for e in self.holdout_errors.values())


@functools.cache
def fitted() -> Calibration:
    allreduce = fit_allreduce(SGLANG_ALLREDUCE_H100)
    gpu_model = fit_decode(GPT_FAST_A100, allreduce)
    overhead, predicted = holdout(VLLM_H100, gpu_model)
    largest = max(GPT_FAST_A100.tokens_per_s)
    smaller = replace(GPT_FAST_A100, tokens_per_s={t: v for t, v in GPT_FAST_A100.tokens_per_s.items() if t < largest})
    return Calibration(
        gpu_model,
        {SGLANG_ALLREDUCE_H100.name: allreduce_errors(SGLANG_ALLREDUCE_H100, allreduce),
         GPT_FAST_A100.name: curve_errors(GPT_FAST_A100, gpu_model)},
        overhead, predicted,
        {tp: predicted[tp] / VLLM_H100.per_gpu(tp) - 1 for tp in predicted if tp != 1},
        curve_errors(GPT_FAST_A100, fit_decode(smaller, allreduce))[largest])


def fit_allreduce(times: AllReduceTimes) -> AllReduce:
    link = GPUS[times.gpu].link_bytes_per_s
    rows = [(1.0, math.log2(tp), 2 * (tp - 1) / tp * nbytes / link) for tp, nbytes in times.seconds]
    measured = list(times.seconds.values())
    latency, per_doubling, inverse_fraction = _lstsq(rows, measured, measured)
    return AllReduce(latency, per_doubling, 1 / inverse_fraction)


def fit_decode(curve: DecodeCurve, allreduce: AllReduce) -> Efficiency:
    """Memory efficiency and the per-layer floor from a curve whose steps are memory-bound (batch 1)."""
    unit = model(curve, Efficiency(memory=1.0, step_overhead_s=0.0, allreduce=allreduce))  # all of HBM, no floor
    rows, targets, measured = [], [], []
    for tp in curve.tokens_per_s:
        allreduces = unit.allreduce_seconds(tp, curve.batch)
        reads = step_seconds(unit, tp, curve.batch, curve.context) - allreduces  # bytes / HBM bandwidth
        rows.append((unit.shape.layers, reads))
        targets.append(curve.step_seconds(tp) - allreduces)
        measured.append(curve.step_seconds(tp))
    floor, inverse_memory = _lstsq(rows, targets, measured)
    return Efficiency(memory=1 / inverse_memory, step_overhead_s=0.0, layer_floor_s=floor, allreduce=allreduce,
                      source=SOURCE)


def holdout(curve: DecodeCurve, gpu_model: Efficiency) -> tuple[float, dict[int, float]]:
    """(the engine's per-step CPU time from the TP1 point, tokens/s per GPU predicted at every TP size)."""
    gpu_only = replace(gpu_model, step_overhead_s=0.0)
    overhead = curve.step_seconds(1) - step_seconds(model(curve, gpu_only), 1, curve.batch, curve.context)
    return overhead, predict(curve, replace(gpu_model, step_overhead_s=overhead))


def model(curve: DecodeCurve, gpu_model: Efficiency) -> Roofline:
    return Roofline(GPUS[curve.gpu], SHAPES[curve.model], gpu_model, curve.weight_bytes)


def predict(curve: DecodeCurve, gpu_model: Efficiency) -> dict[int, float]:
    """Tokens/s per GPU at the curve's TP sizes, batch and context."""
    costs = model(curve, gpu_model)
    return {tp: curve.batch / (tp * step_seconds(costs, tp, curve.batch, curve.context)) for tp in curve.tokens_per_s}


def curve_errors(curve: DecodeCurve, gpu_model: Efficiency) -> dict[int, float]:
    return {tp: per_gpu / curve.per_gpu(tp) - 1 for tp, per_gpu in predict(curve, gpu_model).items()}


def allreduce_errors(times: AllReduceTimes, allreduce: AllReduce) -> dict[tuple[int, int], float]:
    link = GPUS[times.gpu].link_bytes_per_s
    return {(tp, n): allreduce.seconds(tp, n, link) / s - 1 for (tp, n), s in times.seconds.items()}


def _lstsq(rows: Sequence[Sequence[float]], targets: Sequence[float], measured: Sequence[float]) -> list[float]:
    """x minimising sum(((rows @ x - targets) / measured)^2)."""
    weights = 1 / np.asarray(measured)
    x, *_ = np.linalg.lstsq(np.asarray(rows) * weights[:, None], np.asarray(targets) * weights, rcond=None)
    return [float(v) for v in x]


def main() -> None:
    c = fitted()
    e, ar = c.gpu_model, c.gpu_model.allreduce
    print(f"memory {e.memory:.4f} of HBM bandwidth, layer floor {e.layer_floor_s * 1e6:.2f} us, all-reduce "
          f"{ar.latency_s * 1e6:.2f} us + {ar.latency_per_doubling_s * 1e6:.2f} us per doubling of t + bytes at "
          f"{ar.link_fraction:.4f} of NVLink")
    for name, errors in c.training_errors.items():
        print(f"training, {name}: max |error| {max(map(abs, errors.values())):.1%}; "
              + ", ".join(f"{k}: {v:+.1%}" for k, v in errors.items()))
    print(f"holdout, {VLLM_H100.name}: per-step CPU time {c.holdout_overhead_s * 1e3:.2f} ms (from TP1); "
          + ", ".join(f"TP{tp} {c.holdout_predicted[tp]:.0f} vs {VLLM_H100.per_gpu(tp):.0f} tok/s/GPU" for tp in
                      c.holdout_predicted) + f"; holdout_error {c.holdout_error:.4f} (max over TP2/4/8)")
    print(f"extrapolation, {GPT_FAST_A100.name} fitted on TP1/2/4: TP8 {c.extrapolation_error:+.2%}")
    overhead, predicted = holdout(VLLM_H100, Efficiency())
    print(f"plain roofline (assumed Efficiency), {VLLM_H100.name}, its per-step CPU time from TP1 as well "
          f"({overhead * 1e3:.2f} ms): " + ", ".join(f"TP{tp} {v / VLLM_H100.per_gpu(tp) - 1:+.1%}"
                                                   for tp, v in predicted.items()))
    for curve in (GPT_FAST_A100, VLLM_H100):
        errors = curve_errors(curve, Efficiency())
        print(f"plain roofline (assumed Efficiency), {curve.name}: "
              + ", ".join(f"TP{tp} {v:+.0%}" for tp, v in errors.items()))


if __name__ == "__main__":
    main()
