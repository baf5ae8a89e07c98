"""What a generator pod's steps cost, for the simulator: one interface (StepCosts), two sources of it.

- Roofline: a GPU's datasheet numbers, a model's shape and an Efficiency. A decode step of a TP group reads its
  weight shard and the KV cache of its batch from HBM (or computes, whichever is slower), spends a fixed time per
  layer and step, and all-reduces twice per layer over NVLink; prefill is the same with more tokens. The default
  Efficiency is assumed (the plain datasheet roofline); calibration.fitted() fits one to published measurements
  (docs/cost-model.md), which is what `pat simulate` uses for a GPU.
- Measured: the engine's own profiling pass (pat_workers.engine.costs.Costs, saved by Costs.to_json), e.g. of
  this machine's CPU, or one GPU's shard timings (shard_profile, written by `make gpu-check`): decode steps through
  planner.Profile (the table over batch sizes and the KV term), prefill a + b * tokens. Only a profile of this
  engine's revision (pat_workers.revision.ENGINE_REVISION in its "engine" field) is read: check_engine.

Both also say what the engine's profiling pass would measure (engine_costs, the Costs JSON format), which is
what the planner is given, exactly as a pod gives it its measurement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pat_operator.fit import GPU, GPUS, ModelShape
from pat_operator.planner import Profile
from pat_workers.revision import ENGINE_REVISION

BF16 = 2  # bytes per weight and per KV element
PREFILL_LENGTHS = (16, 128)  # as the engine's profiling pass (engine/costs.py) measures prefill
PROFILE_CONTEXT = 64  # ... and decode steps, at this context per sequence (its DECODE_CONTEXT)
# This engine's profile on one GPU, relative to the repository: `make gpu-check` (bench/gpu_engine.py) writes it.
ENGINE_PROFILE = "bench/results/gpu-check-engine-profile.json"
HOW_TO_MEASURE = (f"`make gpu-check` on a GPU writes {ENGINE_PROFILE} (docs/benchmarks.md); `python "
                  f"bench/sim_vs_real.py --save-profile FILE` measures this machine's CPU")


class SimError(ValueError):
    """Bad simulator input: the message names the field or flag and the fix."""


class OtherEngine(SimError):
    """An engine profile measured another revision of the engine than this one."""


def check_engine(d: dict[str, Any], where: str) -> None:
    """OtherEngine unless the profile `d` (read from `where`) measured this engine's revision."""
    measured = d.get("engine")
    if measured == ENGINE_REVISION:
        return
    what = (f"engine revision {measured!r}" if measured else
            "an engine of no named revision (no \"engine\" field: measured before results named one)")
    raise OtherEngine(f"{where} measured {what}{_commit(d)}, not the current engine ({ENGINE_REVISION!r}): there is "
                      f"no profile of the current engine in it. {HOW_TO_MEASURE[0].upper()}{HOW_TO_MEASURE[1:]}")


def _commit(d: dict[str, Any]) -> str:
    return f" at commit {d['commit']}" if d.get("commit") else ""


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce of `nbytes` in a TP group of t GPUs: a latency growing by one step per doubling of t, and the
    ring's 2 (t - 1) / t of the bytes at a bus bandwidth, a fraction of the GPU's link bandwidth."""
    latency_s: float  # at log2(t) = 0
    latency_per_doubling_s: float
    link_fraction: float  # bus bandwidth / GPU.link_bytes_per_s

    def seconds(self, tp: int, nbytes: float, link_bytes_per_s: float) -> float:
        if tp == 1:
            return 0.0
        return (self.latency_s + self.latency_per_doubling_s * math.log2(tp)
                + 2 * (tp - 1) / tp * nbytes / (self.link_fraction * link_bytes_per_s))


@dataclass(frozen=True)
class Efficiency:
    """What kernels reach of the datasheet peaks, and the times a datasheet does not give. The defaults are
    assumptions (the plain roofline); calibration.fitted() returns one fitted to measurements."""
    memory: float = 0.8  # of HBM bandwidth (decode GEMV and attention kernels)
    compute: float = 0.6  # of dense BF16 FLOP/s (large GEMMs)
    link: float = 0.8  # of NVLink bandwidth (KV moves; all-reduces too unless `allreduce` is given)
    step_overhead_s: float = 0.5e-3  # per step: scheduling, sampling (the engine's CPU work between GPU steps)
    memory_reserve: float = 0.1  # of HBM kept from the KV cache: activations, CUDA graphs, fragmentation
    # Per layer and step, whatever the shard and the batch: the kernels' fixed time (launch gaps, small elementwise
    # kernels, a small shard's GEMM running below the bandwidth a large one reaches).
    layer_floor_s: float = 0.0
    allreduce: AllReduce | None = None  # None: GPU.link_latency_s, then the ring at `link` of NVLink
    source: str = "assumed"


@dataclass(frozen=True)
class EngineCosts:
    """What the engine's profiling pass measures (the fields of engine.costs.Costs, in its JSON format)."""
    link_bytes_per_s: float
    link_latency_s: float
    prefill: dict[int, tuple[float, float]]  # tp -> (seconds at 0 tokens, seconds per token)
    decode: dict[int, dict[int, float]]  # tp -> batch -> seconds per decode step at decode_context per sequence
    kv_seconds: dict[int, float]  # tp -> seconds per decode step per KV token beyond that
    decode_context: int = PROFILE_CONTEXT
    source: str = "measured by the engine"

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> EngineCosts:
        try:
            return cls(float(d["link_bytes_per_s"]), float(d["link_latency_s"]),
                       {int(t): (float(a), float(b)) for t, (a, b) in d["prefill"].items()},
                       {int(t): {int(b): float(s) for b, s in row.items()} for t, row in d["decode"].items()},
                       {int(t): float(s) for t, s in d.get("kv_seconds", {}).items()},  # none: no context term
                       int(d.get("decode_context", PROFILE_CONTEXT)), str(d.get("source", f"measured ({where})")))
        except (KeyError, TypeError, ValueError) as e:
            raise SimError(f"{where}: not an engine cost profile ({type(e).__name__}: {e}); expected the JSON of "
                           f"Costs.to_json: link_bytes_per_s, link_latency_s, prefill {{tp: [a, b]}}, decode "
                           f"{{tp: {{batch: seconds}}}}, decode_context, kv_seconds {{tp: seconds}}") from None


class StepCosts(Protocol):
    """Seconds of a TP group's steps. A decode step of `batch` sequences holding `context` KV tokens in all takes
    base + per_context * context, where decode() -> (base, per_context): linear in the context, so that the time
    of n steps of a fixed batch (context growing by batch per step) is a closed form."""

    description: str
    kv_bytes_per_token: int

    def decode(self, tp: int, batch: int) -> tuple[float, float]: ...

    def prefill_seconds(self, tp: int, contexts: Sequence[int]) -> float:
        """One step prefilling sequences of these lengths together."""
        ...

    def migrate_seconds(self, nbytes: float) -> float: ...

    def kv_capacity(self, tp: int) -> float:
        """KV tokens a TP group can hold (math.inf: only the batch limit counts)."""
        ...

    def engine_costs(self, tp_sizes: Sequence[int], batches: Sequence[int]) -> EngineCosts: ...


@dataclass(frozen=True)
class Roofline:
    gpu: GPU
    shape: ModelShape
    efficiency: Efficiency = Efficiency()
    weight_bytes: int = BF16  # per weight (1 for an FP8 checkpoint); activations and the KV cache stay 16-bit
    # Of each GPU, held by something else while the engine generates (colocated: the trainer rank's resident states)
    reserved_bytes: float = 0.0
    # Engines of other TP sizes whose weights stay on each GPU beside a group's own (adaptive TP across vLLM engines:
    # one engine per group of every layout, all awake)
    resident_tp_sizes: tuple[int, ...] = ()
    kv_bytes_per_token: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "kv_bytes_per_token", self.shape.kv_bytes_per_token())
        if self.kv_capacity(1) <= 0:
            raise SimError(f"{self.shape.name} ({self.shape.params / 1e9:.1f}B parameters, {self.weight_bytes} bytes "
                           f"each) leaves no room for a KV cache on one {self.gpu.name}; use a GPU with more memory")

    @property
    def description(self) -> str:
        e, ar = self.efficiency, self._allreduce()
        return (f"GPU model: {self.gpu.name} ({self.gpu.source}); {e.source}: {e.memory:.1%} of HBM bandwidth, "
                f"{e.compute:.0%} of BF16 FLOP/s, {e.layer_floor_s * 1e6:.1f} us per layer and step, "
                f"{e.step_overhead_s * 1e3:g} ms per step, all-reduce {ar.seconds(2, 0, 1) * 1e6:.1f} us (TP2) to "
                f"{ar.seconds(8, 0, 1) * 1e6:.1f} us (TP8) + bytes at {ar.link_fraction:.0%} of NVLink, "
                f"{e.link:.0%} of NVLink for KV moves, {e.memory_reserve:.0%} of HBM reserved")

    def _allreduce(self) -> AllReduce:
        return self.efficiency.allreduce or AllReduce(self.gpu.link_latency_s, 0.0, self.efficiency.link)

    def allreduce_seconds(self, tp: int, tokens: int) -> float:
        """Two per layer (attention and MLP outputs) of the tokens' hidden states."""
        nbytes = tokens * self.shape.hidden * BF16
        return 2 * self.shape.layers * self._allreduce().seconds(tp, nbytes, self.gpu.link_bytes_per_s)

    def _fixed_seconds(self) -> float:
        """Of every step, whatever its TP size, batch and context."""
        return self.efficiency.step_overhead_s + self.efficiency.layer_floor_s * self.shape.layers

    def _kv_bytes_per_rank(self, tp: int) -> int:
        """Per token: KV heads split across the group, replicated once tp exceeds them."""
        s = self.shape
        return 2 * s.layers * max(s.kv_heads // tp, 1) * s.head_dim * BF16

    def _bandwidth(self) -> float:
        return self.gpu.hbm_bytes_per_s * self.efficiency.memory

    def _flops(self) -> float:
        return self.gpu.bf16_flops * self.efficiency.compute

    def _weights_or_compute(self, tp: int, flops: float) -> float:
        return max(self.shape.matmul_params * self.weight_bytes / tp / self._bandwidth(), flops / tp / self._flops())

    def decode(self, tp: int, batch: int) -> tuple[float, float]:
        s = self.shape
        base = (self._fixed_seconds() + self.allreduce_seconds(tp, batch)
                + self._weights_or_compute(tp, 2 * s.matmul_params * batch))
        # Attention reads each context token's KV once (and does 4 FLOPs per head dim per head per layer).
        per_context = max(self._kv_bytes_per_rank(tp) / self._bandwidth(),
                          4 * s.layers * s.heads * s.head_dim / tp / self._flops())
        return base, per_context

    def prefill_seconds(self, tp: int, contexts: Sequence[int]) -> float:
        s = self.shape
        tokens = sum(contexts)
        attention = 2 * s.layers * s.heads * s.head_dim * sum(n * n for n in contexts)  # causal: half of 4 n^2
        return (self._fixed_seconds() + self.allreduce_seconds(tp, tokens)
                + self._weights_or_compute(tp, 2 * s.matmul_params * tokens + attention))

    def migrate_seconds(self, nbytes: float) -> float:
        return self.gpu.link_latency_s + nbytes / (self.gpu.link_bytes_per_s * self.efficiency.link)

    def kv_capacity(self, tp: int) -> float:
        weights = self.shape.params * self.weight_bytes
        free = (self.gpu.memory_bytes * (1 - self.efficiency.memory_reserve) - self.reserved_bytes - weights / tp
                - sum(weights / t for t in self.resident_tp_sizes if t != tp))
        return max(free, 0.0) // self._kv_bytes_per_rank(tp)

    def engine_costs(self, tp_sizes: Sequence[int], batches: Sequence[int]) -> EngineCosts:
        prefill = {}
        for tp in tp_sizes:
            (l0, s0), (l1, s1) = ((n, self.prefill_seconds(tp, [n])) for n in PREFILL_LENGTHS)
            per_token = (s1 - s0) / (l1 - l0)
            prefill[tp] = (max(s0 - per_token * l0, 0.0), per_token)
        decode = {tp: {b: step_seconds(self, tp, b, PROFILE_CONTEXT) for b in batches} for tp in tp_sizes}
        # Linear in the context: what the engine's two measured contexts find
        kv_seconds = {tp: self.decode(tp, max(batches))[1] for tp in tp_sizes}
        return EngineCosts(self.gpu.link_bytes_per_s * self.efficiency.link, self.gpu.link_latency_s, prefill, decode,
                           kv_seconds, PROFILE_CONTEXT, f"GPU model of {self.gpu.name}")


@dataclass(frozen=True)
class Measured:
    costs: EngineCosts
    kv_bytes_per_token: int  # of the model that was profiled, at the engine's dtype
    # KV tokens a TP=1 group holds (a TP=t group t times as many). The engine's own cache is max_batch slots of
    # max_seq tokens, so that for it only the batch limit counts.
    kv_tokens: float = math.inf
    profile: Profile = field(init=False, repr=False, compare=False)  # the decode table, interpolated

    def __post_init__(self):
        object.__setattr__(self, "profile", Profile.measured(self.costs))

    @property
    def description(self) -> str:
        return f"measured: {self.costs.source} (decode TP sizes {sorted(self.costs.decode)})"

    def decode(self, tp: int, batch: int) -> tuple[float, float]:
        p = self.profile
        return p.step_seconds(tp, batch) - p.kv_seconds[tp] * batch * p.decode_context, p.kv_seconds[tp]

    def prefill_seconds(self, tp: int, contexts: Sequence[int]) -> float:
        a, b = self.costs.prefill[tp]
        return a + b * sum(contexts)  # one forward, as the engine prefills consecutive slots

    def migrate_seconds(self, nbytes: float) -> float:
        return self.costs.link_latency_s + nbytes / self.costs.link_bytes_per_s

    def kv_capacity(self, tp: int) -> float:
        return self.kv_tokens * tp

    def engine_costs(self, tp_sizes: Sequence[int], batches: Sequence[int]) -> EngineCosts:
        return self.costs  # measured already


def step_seconds(costs: StepCosts, tp: int, batch: int, context: float) -> float:
    """One decode step of `batch` sequences holding `context` KV tokens each."""
    base, per_context = costs.decode(tp, batch)
    return base + per_context * batch * context


def read_hardware(path: Path, shape: ModelShape, gpu_model: Efficiency) -> StepCosts:
    """--hardware FILE.json: an engine cost profile of this engine's revision (Costs.to_json with "engine": a
    measured CPU, say) or a GPU's numbers (the fields of GPU, name and source included), costed with `gpu_model`."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SimError(f"--hardware {path}: {e}; give a JSON file (Costs.to_json, or a GPU: "
                       f"{list(GPU.__annotations__)})") from None
    if isinstance(d, dict) and "decode" in d:
        return measured_profile(d, shape, f"--hardware {path}")
    try:
        return Roofline(GPU(**d), shape, gpu_model)
    except TypeError as e:
        raise SimError(f"--hardware {path}: {e}; a GPU profile has the fields {list(GPU.__annotations__)}, an engine "
                       f"profile link_bytes_per_s, link_latency_s, prefill and decode") from None


def measured_profile(d: dict[str, Any], shape: ModelShape, where: str) -> Measured:
    """An engine profile's JSON (from `where`) as step costs: OtherEngine unless it measured this engine."""
    check_engine(d, where)
    element_size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(d.get("dtype", "bfloat16"), 2)
    return Measured(EngineCosts.from_json(d, where), shape.kv_bytes_per_token(element_size))


def shard_profile(shards: dict[str, Any], roofline: Roofline, source: str) -> dict[str, Any]:
    """An engine profile (the Costs.to_json fields) from one GPU's timings of one rank's shard per TP size (shards:
    "decode" {tp: {context: {batch: seconds}}}, "prefill" {tp: {tokens: seconds}}, keys as JSON strings): each TP=t
    step is the measured step of its shard plus the group's all-reduces, which need t GPUs and are modelled
    (roofline.allreduce_seconds). The decode table at the shortest measured context, seconds per KV token from the
    longest (at the largest batch), prefill as a + b * tokens through the two shortest measured lengths."""
    decode, kv_seconds, prefill = {}, {}, {}
    contexts = sorted(shards["decode"][min(shards["decode"], key=int)], key=int)
    lo, hi = contexts[0], contexts[-1]
    for tp, by_context in shards["decode"].items():
        t = int(tp)
        decode[tp] = {b: s + roofline.allreduce_seconds(t, int(b)) for b, s in by_context[lo].items()}
        largest = max(by_context[lo], key=int)
        kv_seconds[tp] = (max(by_context[hi][largest] - by_context[lo][largest], 0.0)
                          / (int(largest) * max(int(hi) - int(lo), 1)))
        (n0, s0), (n1, s1) = sorted((int(n), s + roofline.allreduce_seconds(t, int(n)))
                                    for n, s in shards["prefill"][tp].items())[:2]
        per_token = (s1 - s0) / (n1 - n0)
        prefill[tp] = [max(s0 - per_token * n0, 0.0), per_token]
    gpu = roofline.gpu
    return {"source": source, "link_bytes_per_s": gpu.link_bytes_per_s * roofline.efficiency.link,
            "link_latency_s": gpu.link_latency_s, "prefill": prefill, "decode": decode, "decode_context": int(lo),
            "kv_seconds": kv_seconds}


def hardware(name_or_path: str, shape: ModelShape, gpu_model: Efficiency) -> StepCosts:
    """--hardware: a built-in GPU or a JSON profile; a GPU is costed with `gpu_model` (calibration.fitted()'s)."""
    if name_or_path in GPUS:
        return Roofline(GPUS[name_or_path], shape, gpu_model)
    path = Path(name_or_path)
    if not path.suffix == ".json":
        raise SimError(f"--hardware {name_or_path!r}: not a built-in GPU ({', '.join(GPUS)}) nor a .json profile")
    return read_hardware(path, shape, gpu_model)
