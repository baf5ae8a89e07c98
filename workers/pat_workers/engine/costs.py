"""Measured costs: the link between ranks, prefill and decode-step time per TP size.

Measured once at start by every rank together (all blocks of a TP size at once, so contention is as in use)
and agreed on (max over ranks), so that every rank takes the same migrate-or-recompute decisions. The decode
profile T(tp, batch, context) is what a planner needs to decide when to regroup: the decode step as the engine
serves it (Engine.run_decode: captured in a CUDA graph on GPUs, compiled where the engine compiles it; forward over
the paged cache, sampling and the copy of its tokens to the host, padded as the engine pads it) at DECODE_CONTEXT
tokens per sequence for each batch size, and at the largest batch once more at the engine's maxSeq, whose
difference is the cost of reading one more KV token (what makes a long tail's steps slower than its batch size
says; paged attention makes it linear).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import measure_link_bandwidth
from .engine import Engine, bucket
from .sampling import SamplingBatch, SamplingParams

PREFILL_LENGTHS = (16, 128)
DECODE_CONTEXT = 64  # tokens per sequence of the profiled decode steps at each batch size


@dataclass(frozen=True)
class Costs:
    link_bytes_per_s: float  # received per rank, all pairs exchanging at once
    link_latency_s: float  # fixed cost of one exchange
    prefill: dict[int, tuple[float, float]]  # tp -> (seconds at 0 tokens, seconds per token)
    decode: dict[int, dict[int, float]]  # tp -> batch -> seconds per decode step at decode_context per sequence
    kv_seconds: dict[int, float]  # tp -> seconds per decode step per KV token held beyond that
    decode_context: int = DECODE_CONTEXT

    def migrate_seconds(self, nbytes: int) -> float:
        return self.link_latency_s + nbytes / self.link_bytes_per_s

    def recompute_seconds(self, tp: int, tokens: int) -> float:
        fixed, per_token = self.prefill[tp]
        return fixed + per_token * tokens

    def choose(self, kv_bytes: int, tokens: int, tp: int) -> str:
        """'kv' when moving the request's cache is predicted cheaper than re-prefilling it at TP=tp."""
        return "kv" if self.migrate_seconds(kv_bytes) <= self.recompute_seconds(tp, tokens) else "recompute"

    def to_json(self, dtype: str, source: str) -> dict:
        """The profile as `pat simulate --hardware FILE.json` reads it (pat_workers.sim.hardware.EngineCosts)."""
        return {"source": source, "dtype": dtype, "link_bytes_per_s": self.link_bytes_per_s,
                "link_latency_s": self.link_latency_s,
                "prefill": {str(tp): list(ab) for tp, ab in self.prefill.items()},
                "decode": {str(tp): {str(b): s for b, s in row.items()} for tp, row in self.decode.items()},
                "decode_context": self.decode_context,
                "kv_seconds": {str(tp): s for tp, s in self.kv_seconds.items()}}


def _timed(fn, repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # CUDA kernels are async
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    # The least disturbed run: on a shared host it is stable from one start to the next, where the median is not
    # (two starts of bench/sim_vs_real's pod: a TP=1 step of batch 4 at 49.9 and 53.7 ms, vs 53.5 and 66.0 ms by
    # the median); the planner's online refinement moves the profile to what the steps take in use.
    return min(times)


def measure(engine: Engine, tp_sizes: list[int], batches: list[int], repeats: int = 7) -> Costs:
    """Collective over the pod's ranks, with the engine idle (it is left in its own TP=1 group). Runs in the
    engine's own (empty) KV pool: rows of the profiled batches take its blocks in turn, wrapping around when it is
    smaller than they need (what a step reads and writes is the same amount of memory either way), so profiling
    takes no memory beside the pool and the graphs the engine keeps for serving."""
    model, pool, kv, max_seq = engine.model, engine.pool, engine.kv, engine.max_seq
    rank, world = pool.rank, pool.world
    device, max_tp, bs = model.device, max(tp_sizes), kv.block_size
    long_context = max(max_seq - 1, DECODE_CONTEXT + 1)
    width = -(-max(PREFILL_LENGTHS[-1], long_context + 1) // bs)
    samples: list[float] = []
    for tp in tp_sizes:
        if tp > 1 and tp == tp_sizes[1]:
            # The TP=1 steps compiled the attention kernel, at each rank's own pace (seconds, more on a loaded host);
            # meet on the world group, whose timeout is the start-up's, before the first collective of a TP group
            # (comm_timeout) waits on a rank still compiling.
            dist.barrier()
        block = next(b for b in pool.blocks(tp) if rank in b)
        engine.join(block)
        groups = max_tp // tp
        ids = torch.arange(max(batches) * groups * width, device=device) % (kv.num_blocks - 1) + 1
        tables = ids.view(max(batches), groups, width)
        for length in PREFILL_LENGTHS:
            tokens = torch.zeros(1, length, dtype=torch.long, device=device)
            start = torch.zeros(1, dtype=torch.long, device=device)
            table = tables[:1, :, :-(-length // bs)]
            samples.append(_timed(lambda: model.forward(engine.shard, engine.comm, kv, tokens, start, table), repeats,
                                  device))
        for batch, context in [(b, DECODE_CONTEXT) for b in batches] + [(max(batches), long_context)]:
            tokens = torch.zeros(batch, dtype=torch.long, device=device)
            start = torch.full((batch,), context, dtype=torch.long, device=device)
            blocks = context // bs + 1
            table = tables[:batch, :, :bucket(blocks, width) if engine.static_shapes else blocks]  # as it pads
            params = SamplingBatch.build([SamplingParams(temperature=1.0)] * batch, model.cfg.vocab_size, device)
            steps = torch.zeros(batch, dtype=torch.long, device=device)
            inputs = (tokens, start, table, params, steps)
            samples.append(_timed(lambda: engine.run_decode(inputs), repeats, device))
    engine.join((rank,))
    link = (0.0, 0.0)
    if world > 1:
        pair = pool.get(next(b for b in pool.blocks(2) if rank in b))
        small = 4096
        bandwidth = measure_link_bandwidth(pair, nbytes=32 << 20)
        latency = small / measure_link_bandwidth(pair, nbytes=small)
        link = (bandwidth, latency)
    agreed = torch.tensor([*samples, -link[0], *link[1:]], dtype=torch.float64)
    if world > 1:  # the slowest rank's numbers (and the lowest bandwidth) everywhere
        agreed = agreed.to(device) if dist.get_backend() == "nccl" else agreed  # NCCL reduces device memory only
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        agreed = agreed.cpu()
    values = agreed.tolist()
    prefill, decode, kv_seconds, i = {}, {}, {}, 0
    (l0, l1) = PREFILL_LENGTHS
    for tp in tp_sizes:
        s0, s1 = values[i], values[i + 1]
        per_token = max((s1 - s0) / (l1 - l0), 1e-9)
        prefill[tp] = (max(s0 - per_token * l0, 0.0), per_token)
        decode[tp] = dict(zip(batches, values[i + 2:i + 2 + len(batches)]))
        longer = values[i + 2 + len(batches)] - decode[tp][max(batches)]  # the largest batch, maxSeq each
        kv_seconds[tp] = max(longer, 0.0) / (max(batches) * (long_context - DECODE_CONTEXT))
        i += 3 + len(batches)
    bandwidth, latency = -values[i], values[i + 1]
    return Costs(bandwidth if world > 1 else float("inf"), latency, prefill, decode, kv_seconds)
