"""The GPU cost model fitted to published measurements (pat_workers.sim.calibration): its terms by hand, the fit
on its training points, the holdout, and negative controls."""

import math
from dataclasses import replace

import pytest

from pat_operator.fit import GPU, GPUS, SHAPES, ModelShape
from pat_workers.sim import calibration
from pat_workers.sim.hardware import AllReduce, Efficiency, Roofline, step_seconds
from pat_workers.sim.measurements import GPT_FAST_A100, SGLANG_ALLREDUCE_H100, VLLM_H100

SHAPE = ModelShape("toy", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)
TOY_GPU = GPU("toy", memory_bytes=1e9, hbm_bytes_per_s=1e12, bf16_flops=1e15, link_bytes_per_s=1e11,
              link_latency_s=1e-5, source="test")


def test_the_fitted_terms_by_hand():
    allreduce = AllReduce(latency_s=2e-6, latency_per_doubling_s=1e-6, link_fraction=0.5)
    model = Roofline(TOY_GPU, SHAPE, Efficiency(1.0, 1.0, 1.0, 0.0, 0.0, layer_floor_s=1e-5, allreduce=allreduce))
    base, per_context = model.decode(4, 2)
    # Per layer a floor; two all-reduces per layer of 2 tokens x 64 x 2 bytes: latency + 2 (3/4) bytes / (0.5 link).
    one_allreduce = 2e-6 + 1e-6 * 2 + 1.5 * (2 * 64 * 2) / (0.5 * 1e11)
    assert base == pytest.approx(2 * 1e-5 + 2 * 2 * one_allreduce + SHAPE.matmul_params * 2 / 4 / 1e12)
    assert per_context == pytest.approx(2 * 2 * 1 * 16 * 2 / 1e12)  # one KV head per rank of 4 (replicated)
    assert model.allreduce_seconds(1, 2) == 0.0
    # FP8 weights halve the weight reads; the plain roofline's all-reduce is the GPU's latency and the ring at `link`.
    assert Roofline(TOY_GPU, SHAPE, Efficiency(1.0, 1.0, 1.0, 0.0, 0.0), weight_bytes=1).decode(1, 1)[0] == \
        pytest.approx(SHAPE.matmul_params / 1e12)
    assert Roofline(TOY_GPU, SHAPE).allreduce_seconds(2, 1) == pytest.approx(2 * 2 * (1e-5 + 64 * 2 / (0.8 * 1e11)))


def test_the_measurements_as_the_fit_reads_them():
    assert GPT_FAST_A100.per_gpu(8) == pytest.approx(276.01 / 8)  # published: tokens/s of the group
    assert GPT_FAST_A100.step_seconds(1) == pytest.approx(1 / 93.83)  # batch 1: one token per step
    # vLLM: ~67 sequences per step (Little's law at TP1), each ~274 KV tokens deep on average.
    assert VLLM_H100.batch == pytest.approx(67.2, abs=0.1) and VLLM_H100.context == pytest.approx(274.4, abs=0.1)
    assert VLLM_H100.step_seconds(1) == pytest.approx(19.75e-3)
    assert len(SGLANG_ALLREDUCE_H100.seconds) == 18 and SGLANG_ALLREDUCE_H100.seconds[(8, 2048)] == 5.9e-6


def test_the_fit_reproduces_its_training_points():
    c = calibration.fitted()
    decode = c.training_errors[GPT_FAST_A100.name]
    assert set(decode) == {1, 2, 4, 8} and max(map(abs, decode.values())) < 0.01  # within 1%
    allreduce = c.training_errors[SGLANG_ALLREDUCE_H100.name].values()
    # Timed one call at a time without CUDA graphs, these are noisy (TP4: 3.7 us at 16 KB, 4.8 us at 2 KB).
    assert max(map(abs, allreduce)) < 0.3 and sum(map(abs, allreduce)) / len(allreduce) < 0.1
    e = c.gpu_model
    assert 0.8 < e.memory < 0.95 and 50e-6 < e.layer_floor_s < 90e-6 and e.step_overhead_s == 0.0
    ar = e.allreduce
    assert 2e-6 < ar.latency_s < 4e-6 and 0 < ar.latency_per_doubling_s < 2e-6 and 0.3 < ar.link_fraction < 0.8


def test_the_holdout_is_predicted_within_20_percent():
    c = calibration.fitted()
    assert set(c.holdout_errors) == {2, 4, 8}  # TP1 anchors the engine's CPU time per step
    assert c.holdout_error == max(map(abs, c.holdout_errors.values())) < 0.2
    assert 10e-3 < c.holdout_overhead_s < 18e-3  # most of vLLM 0.5.4's ~19 ms step
    assert c.holdout_predicted[1] == pytest.approx(VLLM_H100.per_gpu(1))
    assert abs(c.extrapolation_error) < 0.05  # gpt-fast's TP8 point, fitted on TP1/2/4 only


def test_negative_controls_miss_by_far_more_than_20_percent():
    # The plain roofline (assumed efficiencies, 0.5 ms per step, datasheet all-reduce, no per-layer floor) ...
    plain = Efficiency()
    assert min(calibration.curve_errors(VLLM_H100, plain).values()) > 2.0  # 3-10x vLLM's per-GPU throughput
    assert calibration.curve_errors(GPT_FAST_A100, plain)[8] > 0.4  # large TP far too good at batch 1
    # ... and the fitted model with one term broken: all-reduce latency x10, or no per-layer floor.
    fitted = calibration.fitted().gpu_model
    slow = replace(fitted, allreduce=replace(fitted.allreduce, latency_s=10 * fitted.allreduce.latency_s,
                                             latency_per_doubling_s=10 * fitted.allreduce.latency_per_doubling_s))
    assert calibration.curve_errors(GPT_FAST_A100, slow)[8] < -0.3
    assert calibration.curve_errors(GPT_FAST_A100, replace(fitted, layer_floor_s=0.0))[8] > 0.4


def test_small_tp_wins_the_bulk_and_large_tp_the_tail_on_an_h200():
    """What the measurements say and the plain roofline's 0.5 ms per step understates: at 128 sequences per GPU TP1
    replicas decode the most tokens per GPU; for one sequence TP8 is ~2x faster than TP1, not ~3x."""
    model = Roofline(GPUS["H200"], SHAPES["llama-3.1-8b"], calibration.fitted().gpu_model)
    per_gpu = {tp: 128 * tp / (tp * step_seconds(model, tp, 128 * tp, 2000)) for tp in (1, 2, 4, 8)}
    assert per_gpu[1] > per_gpu[2] > per_gpu[4] > per_gpu[8] * 1.1
    alone = {tp: step_seconds(model, tp, 1, 4000) for tp in (1, 8)}
    assert 1.5 < alone[1] / alone[8] < 2.5
    assert math.isclose(model.kv_capacity(1), Roofline(GPUS["H200"], SHAPES["llama-3.1-8b"]).kv_capacity(1))
