"""make gpu-check, the engine's part: the serving path of one rank on one GPU, and regroups of ranks sharing it.

Sections, each written to the JSON as soon as it ends (an error in one is recorded and the others still run):
- bandwidth: a device-to-device copy's bytes/s, beside the datasheet HBM figure the rooflines use (--gpu).
- capacity: the concurrent maxSeq sequences an engine rank of examples/llama-3.1-8b.yaml gets on this GPU:
  rank.kv_cache_blocks with the example's generator settings and this GPU's free and total memory (taken before
  anything else is allocated), beside what `pat plan` (fit.kv_blocks) counts for the same memory (no target).
- model, decode: a Llama-3.1-8B-shaped model (bf16, random weights generated on the GPU: no checkpoint to write and
  read back, which saves ~30 s), one rank (a one-rank pool), driven by the real Engine.step(): admission, prefill,
  block allocation, the decode forward and sampling (the example's temperature 1, one seed per request), one
  device-to-host copy. Batch 1 at context 256 and batch 128 at context 2048 (maxSeq 9216 as in the example), eager
  then captured (the engine's CUDA graphs), on the same requests. Per step, CUDA-synchronised around Engine.step():
  the median wall time. The decode's GPU time is its captured graph replayed back to back for the same rows (CUDA
  events); host time = step wall time - that GPU time: the time the GPU waits each step for the host (scheduling,
  block tables, input copies, launch, the copy back, accepting tokens), since nothing of one step overlaps the next.
  Roofline: the bytes one step must read (the weights but the embedding table, of which B rows are read, plus the KV
  of the tokens each row attends) over the HBM bandwidth, against the step's wall time. Targets: >= 70% (batch 1),
  >= 60% (batch 128), host <= 0.3 ms.
- profile: `pat simulate`'s engine profile of this GPU (pat_workers.sim.hardware.shard_profile): one rank's shard of
  the same model per TP size (1/t of the heads and MLP columns, the forward of the engine's decode step captured in a
  CUDA graph, prefill eagerly) at PROFILE_BATCHES x PROFILE_CONTEXTS and PROFILE_PREFILLS; the all-reduces of a
  TP>1 group need t GPUs and are modelled over this GPU's NVLink. Written to --profile-out
  (bench/results/gpu-check-engine-profile.json) with the engine's revision and the commit: pat simulate --preset
  paper-llama8b runs on it beside the GPU model when it measured an H200, and `--hardware FILE` on any GPU.
- regroup: a tiny Llama (bf16) on 2 and 4 ranks sharing the GPU (EngineOptions.device "cuda-shared": gloo with CUDA
  tensors staged through the host, since NCCL refuses two ranks on one device), regrouped mid-batch (1->2, 2->1;
  1->2, 2->4, 1->4, 4->1) with KV migration and with recompute. TP=1 steps run in the engine's CUDA graphs, before
  and after each regroup; TP>1 steps eagerly (gloo collectives run on the host: no graph can hold them; the ranks
  run _rank_main, which applies that rule and counts the steps of each kind). Checked against fp32 (see `checks`
  and the tolerances below); a negative control (a corrupted weight slice on one rank) must be caught.
- compile: torch.compile(mode="reduce-overhead") around the decode step at batch 1, against the hand-captured graphs
  (run last, and only if --timeout leaves COMPILE_SECONDS).
The JSON goes to bench/results/gpu-check-engine.json (--out to change), rewritten after every section; both files
name the engine's revision and the commit they measured (pat_workers.revision); a watchdog
ends the run after --timeout seconds, leaving what was measured, and kills the engine ranks. Exit status 1 when a
section failed or a correctness check did not hold (regroup mismatches, the negative control not caught), 3 when
the watchdog fired; performance targets are reported beside each number, pass or fail, and do not change it.

--smoke runs the same code on CPU (the test preset, float32 decode, bf16 regroups, batch 8 at context 64 for batch
128 at 2048, a profile at small batches and contexts timed eagerly, torch.compile's tracing without inductor) in
~40 s, with a stand-in for CUDA graphs (capture records the step, replay reruns it into the captured outputs) so that
the engine's graph path runs too; it writes only with --out (and --profile-out).
  python bench/gpu_engine.py            # needs a CUDA GPU; ~2-4 minutes on an H200 (an estimate: not run yet)
  python bench/gpu_engine.py --smoke --out /tmp/engine.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

from pat_operator import fit
from pat_workers.engine import generator as generator_module
from pat_workers.engine import rank as rank_module
from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.engine import Engine, Request
from pat_workers.engine.generator import LocalGenerator
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.loader import load_model
from pat_workers.engine.model import Transformer
from pat_workers.engine.sampling import SamplingBatch, SamplingParams, _threshold, sample, uniform
from pat_workers.engine.tiny import fresh, make_tiny_model, mixed_requests, random_weights
from pat_workers.revision import ENGINE_REVISION, stamp
from pat_workers.sim.hardware import ENGINE_PROFILE, Roofline, shard_profile

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "gpu-check-engine.json"
PROFILE = REPO / ENGINE_PROFILE
EXAMPLE = REPO / "examples" / "llama-3.1-8b.yaml"
# meta-llama/Llama-3.1-8B's config.json: the llama-8b preset's dimensions, its RoPE and its context length.
LLAMA_31 = dict(fit.PRESETS["llama-8b"], max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TARGETS = {"batch1_roofline": 0.70, "batch128_roofline": 0.60, "host_ms": 0.3}
# The profile's grid (--smoke: (1, 4), (32, 64), (16, 32)). Batch 128 at context 2048 holds 34 GB of KV at TP=1: an
# H100 fits it beside the 16 GB of weights.
PROFILE_BATCHES, PROFILE_CONTEXTS, PROFILE_PREFILLS = (1, 4, 16, 64, 128), (512, 2048), (512, 2048)
COMPILE_SECONDS = 150  # what the compile section needs at least (an 8B decode step compiles in ~1-2 min: a guess)

# The regroup checks (see `checks`). bf16 keeps 8 bits of mantissa: the tiny model's log-probabilities move by up to
# ~0.09 nats between bf16 and fp32 or between two bf16 runs that reduce in another order (TP all-reduces), and a
# token bf16 takes where fp32 would take another had an fp32 gap of up to 0.04 nats (greedy) or a draw point within
# 1.5% of the mass of the boundary (sampled): measured on CPU (--smoke). The tolerances leave about 1.5-3x that for
# the GPU's kernels, whose largest values the JSON keeps; a corrupted weight slice moves log-probabilities by ~2 nats.
LOGPROB_ATOL = 0.15  # nats, every token's log-probability against the other run's or the fp32 model's
TIE_NATS = 0.15  # a greedy row may take either of two tokens whose fp32 log-probabilities are this close
TIE_MASS = 0.03  # a sampled row's draw point may fall on either side of a boundary this close (fraction of the mass)
REGROUPS = {2: [("1->2", (1, 1), (2,)), ("2->1", (2,), (1, 1))],
            4: [("1->2", (1, 1, 1, 1), (2, 2)), ("2->4", (2, 2), (4,)), ("1->4", (1, 1, 1, 1), (4,)),
                ("4->1", (4,), (1, 1, 1, 1))]}
CHECKS = ("vs_fp32", "vs_bf16_single_rank", "vs_fp32_model")  # see `checks`
COUNTS_DIR = "PAT_BENCH_GRAPH_COUNTS"  # env of the ranks: where each writes how its decode steps ran
STAND_IN = "PAT_BENCH_GRAPH_STAND_IN"  # env of the ranks: CUDA graphs' CPU stand-in (--smoke)


# -- results --------------------------------------------------------------------------------------------------
class Results:
    """The JSON, rewritten whole (to a temporary file, then renamed) after every section and by the watchdog."""

    def __init__(self, path: Path | None, data: dict):
        self.path, self.data, self.lock = path, data, threading.Lock()

    def save(self) -> None:
        with self.lock:
            if self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1) + "\n")
            tmp.replace(self.path)

    def section(self, name: str, fn, *args) -> None:
        """Runs fn(result, *args) filling result = data[name]; records its error instead of raising it."""
        result = self.data[name] = {"status": "running"}
        self.data["running"] = name
        self.save()
        start = time.perf_counter()
        try:
            fn(result, *args)
            result["status"] = "done"
        except Exception:
            result.update(status="error", error=traceback.format_exc())
            print(result["error"], file=sys.stderr)
        result["seconds"] = round(time.perf_counter() - start, 1)
        self.data.pop("running")
        self.save()
        print(f"[{name}] {result['status']} in {result['seconds']} s", flush=True)

    def finish(self, failed: list[str]) -> int:
        """Records what failed, saves, prints the JSON as the last line; the exit status."""
        self.data["failed"] = failed
        self.save()
        print(json.dumps(self.data))
        return 1 if failed else 0


def watchdog(results: Results, seconds: float) -> None:
    """After `seconds`: record where the run was, save, dump every thread's stack and exit (3). A C-level backstop
    (faulthandler) follows 15 s later, should this thread never get the interpreter."""
    def fire():
        results.data["error"] = f"watchdog: --timeout {seconds:.0f} s passed in section {results.data.get('running')}"
        children = multiprocessing.active_children()
        for child in children:  # engine ranks: they would poll their queues forever
            child.kill()
        results.data["killed"] = [child.pid for child in children]
        results.save()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 15, exit=True)


# -- timing ----------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def per_call(self, fn, reps: int) -> float:
        """Seconds per call of fn, called back to back (CUDA events on a GPU: the device's time)."""
        fn()
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - start) / reps
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3 / reps


def bandwidth(result: dict, device: torch.device, clock: Clock, hbm: float) -> None:
    nbytes = (4 << 30) if clock.cuda else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = clock.per_call(lambda: dst.copy_(src), 10)
    copy = 2 * nbytes / seconds  # read + write
    result.update(copy_bytes_per_s=copy, datasheet_bytes_per_s=hbm, copy_fraction_of_datasheet=round(copy / hbm, 3))
    print(f"device-to-device copy: {copy / 1e12:.2f} TB/s ({copy / hbm:.0%} of the {hbm / 1e12:.1f} TB/s the "
          f"rooflines use)")


# -- capacity --------------------------------------------------------------------------------------------------
def capacity(result: dict, memory: tuple[int, int, str]) -> None:
    from pat_operator.api import load_job

    spec = load_job(EXAMPLE).spec
    g = spec.generator
    free, total, source = memory
    opts = rank_module.EngineOptions(max_batch=g.max_batch, max_seq=g.max_seq, dtype=spec.model.dtype,
                                     memory_utilization=g.memory_utilization, block_size=fit.BLOCK_SIZE)
    cfg, shape = ModelConfig.from_hf(fit.hf_config("llama", **LLAMA_31)), fit.SHAPES["llama-3.1-8b"]
    blocks = rank_module.kv_cache_blocks(opts, cfg, shape, g.ranks, free, total)
    max_tp = max(cfg.tp_sizes(g.ranks))
    per_sequence = -(-g.max_seq // opts.block_size) * max_tp  # blocks of one maxSeq sequence, every head
    sequences = (blocks - 1) // per_sequence
    _, room = fit.kv_blocks(spec, shape, total)  # pat plan: blocks of every head, from the total memory
    allows = room // fit.sequence_blocks(spec)
    result.update(example=str(EXAMPLE.relative_to(REPO)), memory=source, free_bytes=free, total_bytes=total,
                  max_batch=g.max_batch, max_seq=g.max_seq, ranks_per_pod=g.ranks, kv_blocks=blocks,
                  sequences_per_gpu=sequences, limited_by="maxBatch" if sequences >= g.max_batch else "memory",
                  pat_plan_memory_allows=allows)
    print(f"capacity: an engine rank of {EXAMPLE.name} holds {sequences} sequences of {g.max_seq} tokens at once "
          f"(maxBatch {g.max_batch}; pat plan's count for this memory: {allows}) on {source}")


# -- decode ----------------------------------------------------------------------------------------------------
class OneRankPool:
    """The communicator pool of a one-rank pod: its only group is the rank itself."""

    rank, world = 0, 1

    def get(self, ranks):
        return SoloCommunicator(0)


@dataclasses.dataclass
class DecodeCase:
    name: str
    batch: int
    context: int  # the KV tokens each row attends at the last timed step (a power of two: a full context bucket)
    steps: int  # timed steps per mode
    warm: int  # untimed steps before each mode's timed ones (the captured mode captures its graph here)
    target: float
    max_seq: int = 9216  # examples/llama-3.1-8b.yaml's maxSeq: the engine pads block tables to power-of-two widths


def sdpa_backends(cfg: ModelConfig, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Which scaled_dot_product_attention kernels accept the decode step's attention (a boolean mask over the
    paged slots, grouped-query heads): the math one materialises the grouped keys and values per query head."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(batch, cfg.num_heads, 1, cfg.head_dim, device=device, dtype=dtype)
    k = torch.zeros(batch, cfg.num_kv_heads, length, cfg.head_dim, device=device, dtype=dtype)
    mask = torch.ones(batch, 1, 1, length, device=device, dtype=torch.bool)
    out = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # each refusing kernel warns why; the result says which refused
                torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
            out[backend.name] = True
        except RuntimeError:
            out[backend.name] = False
    return out


def timed_steps(engine: Engine, n: int, clock: Clock) -> tuple[list[float], list[int]]:
    """Wall seconds of n steps (synchronised before and after each) and the KV tokens each attended."""
    seconds, attended = [], []
    for _ in range(n):
        tokens = sum(r.cached + 1 for r in engine.running)  # a decode step writes position cached, reads 0..cached
        clock.sync()
        start = time.perf_counter()
        stats = engine.step()
        clock.sync()
        seconds.append(time.perf_counter() - start)
        attended.append(tokens)
        if stats.finished or stats.preempted or stats.prefill_tokens:
            raise RuntimeError(f"step was not a plain decode step of the whole batch: {stats}")
    return seconds, attended


def start(model: Transformer, case: DecodeCase, clock: Clock, **engine_options) -> tuple[Engine, float]:
    """An engine with case.batch requests, after its first step (every prefill and the first decode step), and that
    step's seconds. Every later step of both modes stays in one context bucket (up to case.context tokens): the
    same block-table width throughout."""
    prompt_len = case.context - 2 * (case.warm + case.steps) - 2  # the last step's row attends `context` tokens
    blocks = -(-case.context // 16) + 1  # per row, for the steps run here
    engine = Engine(model, OneRankPool(), max_batch=case.batch, max_seq=case.max_seq,
                    kv_blocks=max(case.batch * blocks, -(-case.max_seq // 16)) + 1, **engine_options)
    g = torch.Generator().manual_seed(case.batch)
    prompts = torch.randint(0, model.cfg.vocab_size, (case.batch, prompt_len), generator=g).tolist()
    # The example's sampling (temperature 1, top_p 1), a seed per request; ignore_eos: every row runs to the end.
    engine.add([Request(f"r{i}", p, SamplingParams(max_tokens=case.max_seq, temperature=1.0, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)])
    clock.sync()
    begin = time.perf_counter()
    stats = engine.step()
    clock.sync()
    if stats.batch != case.batch:
        raise RuntimeError(f"{stats.batch} of {case.batch} requests decode after the first step")
    return engine, time.perf_counter() - begin


def decode_case(result: dict, model: Transformer, case: DecodeCase, clock: Clock, hbm: float) -> None:
    cfg, device, element = model.cfg, model.device, model.dtype.itemsize
    engine, first = start(model, case, clock)
    result.update(batch=case.batch, max_seq=case.max_seq, first_step_s=round(first, 3))
    weight_bytes = sum(t.nbytes for t in model.w.values())
    embedding = model.w["model.embed_tokens.weight"]
    read_weights = weight_bytes - embedding.nbytes + case.batch * embedding[0].nbytes
    for mode in ("eager", "captured"):
        engine._cuda_graphs = mode == "captured"  # the engine's switch: on a GPU it is on unless cuda_graphs=False
        for _ in range(case.warm):
            engine.step()
        seconds, attended = timed_steps(engine, case.steps, clock)
        step = statistics.median(seconds)
        kv_bytes = statistics.mean(attended) * cfg.kv_bytes_per_token(element)
        roofline = (read_weights + kv_bytes) / hbm
        inputs = engine.decode_inputs()
        run = engine._captured(inputs) if mode == "captured" else engine.decode_fn
        device_time = clock.per_call(lambda run=run, inputs=inputs: run(*inputs), 20 if clock.cuda else 3)
        result[mode] = {"step_ms": round(step * 1e3, 3), "step_ms_min": round(min(seconds) * 1e3, 3),
                        "decode_ms": round(device_time * 1e3, 3), "context": round(statistics.mean(attended)
                                                                                    / case.batch),
                        "tokens_per_s": round(case.batch / step, 1), "bytes_per_step": read_weights + kv_bytes,
                        "roofline_ms": round(roofline * 1e3, 3), "roofline_fraction": round(roofline / step, 6),
                        "kv_slots_read": case.batch * inputs[2].shape[-1] * engine.kv.block_size}
    captured = result["captured"]
    host_ms = captured["step_ms"] - captured["decode_ms"]
    captured.update(host_ms=round(host_ms, 3), decode_roofline_fraction=round(
        captured["roofline_ms"] / captured["decode_ms"], 6))
    result.update(graph_speedup=round(result["eager"]["step_ms"] / captured["step_ms"], 3),
                  graphs=len(engine._graphs), target_roofline=case.target, target_host_ms=TARGETS["host_ms"],
                  pass_roofline=captured["roofline_fraction"] >= case.target,
                  pass_host=host_ms <= TARGETS["host_ms"],
                  sdpa_backends=sdpa_backends(cfg, case.batch, inputs[2].shape[-1] * engine.kv.block_size, device,
                                              model.dtype))
    print(f"{case.name}: batch {case.batch} at context {captured['context']}: step {captured['step_ms']:.3f} ms "
          f"captured ({result['eager']['step_ms']:.3f} eager, x{result['graph_speedup']:.2f}), "
          f"{captured['tokens_per_s']:.0f} tok/s; roofline {captured['roofline_ms']:.3f} ms -> "
          f"{captured['roofline_fraction']:.1%} (target {case.target:.0%}: "
          f"{'pass' if result['pass_roofline'] else 'FAIL'}); host {host_ms:.3f} ms per step (target "
          f"<= {TARGETS['host_ms']} ms: {'pass' if result['pass_host'] else 'FAIL'})", flush=True)


def decode(result: dict, model: Transformer, cases: list[DecodeCase], clock: Clock, hbm: float) -> None:
    result["bytes_per_s"] = hbm
    for case in cases:
        result[case.name] = {}
        decode_case(result[case.name], model, case, clock, hbm)
        if clock.cuda:
            torch.cuda.empty_cache()  # the previous case's cache and graphs


def compile_decode(result: dict, model: Transformer, case: DecodeCase, clock: Clock, deadline: float,
                   captured: dict) -> None:
    """torch.compile(mode="reduce-overhead") around the engine's decode step: its own CUDA graphs (cudagraph trees)
    instead of the engine's. The weights, the KV pool and the RoPE tables are marked static, as parameters are:
    otherwise each replay would copy them into the graph's input buffers."""
    left, needed = deadline - time.monotonic(), COMPILE_SECONDS if clock.cuda else 30
    if left < needed:
        result["skipped"] = f"{left:.0f} s left of --timeout, fewer than the {needed} s it needs"
        return
    engine, _ = start(model, case, clock, cuda_graphs=False)
    for t in [*model.w.values(), model.cos, model.sin, engine.kv.data]:
        torch._dynamo.mark_static_address(t)
    # --smoke: the same tracing (fullgraph: no graph break) without inductor's C++ build, which takes ~30 s on CPU.
    options = {"mode": "reduce-overhead"} if clock.cuda else {"backend": "aot_eager"}
    engine.decode_fn = torch.compile(engine._decode, fullgraph=True, **options)
    result["options"] = options
    begin = time.perf_counter()
    for _ in range(case.warm):  # the first steps compile (and record the graphs of cudagraph trees)
        engine.step()
    clock.sync()
    result["compile_s"] = round(time.perf_counter() - begin, 1)
    seconds, _ = timed_steps(engine, case.steps, clock)
    result.update(batch=case.batch, step_ms=round(statistics.median(seconds) * 1e3, 3),
                  captured_step_ms=captured.get("step_ms"))
    print(f"compile ({options}): {result['compile_s']} s to compile; step {result['step_ms']:.3f} ms at "
          f"batch {case.batch}, against {captured.get('step_ms')} ms in the engine's own graphs", flush=True)


# -- profile ---------------------------------------------------------------------------------------------------
def shard_seconds(step, clock: Clock, reps: int, graph: bool) -> float:
    """Seconds per call of step(), replayed from a CUDA graph when `graph` (on a GPU), else called as it is."""
    if not (graph and clock.cuda):
        return clock.per_call(step, reps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        step()
    seconds = clock.per_call(cuda_graph.replay, reps)
    del cuda_graph
    return seconds


def profile(result: dict, model: Transformer, clock: Clock, gpu: fit.GPU, smoke: bool, out: Path | None) -> None:
    """One rank's shard per TP size, timed (seconds: decode[tp][context][batch], prefill[tp][tokens]), and the engine
    profile made of it (shard_profile), written to `out` with the engine's revision and the commit."""
    cfg, device, bs = model.cfg, model.device, 16
    batches, contexts, prefills, reps = ((1, 4), (32, 64), (16, 32), 3) if smoke else (
        PROFILE_BATCHES, PROFILE_CONTEXTS, PROFILE_PREFILLS, 20)
    shape = fit.tiny_shape("test") if smoke else fit.SHAPES["llama-3.1-8b"]
    shards: dict = {"decode": {}, "prefill": {}}
    # One pool per TP size, for the largest case, reused by every case (the engine's pool is one size too: a pool of
    # another size would recompile the attention)
    blocks = max(max(batches) * -(-(max(contexts) + 1) // bs), -(-max(prefills) // bs)) + 1
    for tp in cfg.tp_sizes(8):
        shard, comm = model.shard(tp, 0), SoloCommunicator(0)
        decode: dict = {}
        prefill: dict = {}
        shards["decode"][str(tp)], shards["prefill"][str(tp)] = decode, prefill
        kv = PagedKV(cfg, blocks, bs, cfg.num_kv_heads // tp, model.dtype, device)
        for context in contexts:
            decode[str(context)] = {}
            for batch in batches:
                kv.reset()
                tables = kv.tables_for(batch, context + 1, 1)  # the step writes position `context`, reads 0..context
                tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
                start = torch.full((batch,), context, dtype=torch.long, device=device)
                step = functools.partial(model.forward, shard, comm, kv, tokens, start, tables)
                decode[str(context)][str(batch)] = shard_seconds(step, clock, reps, graph=True)
        for n in prefills:
            kv.reset()
            tables, tokens = kv.tables_for(1, n, 1), torch.zeros(1, n, dtype=torch.long, device=device)
            start = torch.zeros(1, dtype=torch.long, device=device)
            step = functools.partial(model.forward, shard, comm, kv, tokens, start, tables)
            prefill[str(n)] = shard_seconds(step, clock, max(reps // 4, 2), graph=False)
        del kv
        print(f"profile: TP={tp} shard: " + "; ".join(
            f"context {c}: " + " ".join(f"b{b} {t * 1e3:.3f}" for b, t in row.items()) for c, row in decode.items())
            + " ms; prefill " + " ".join(f"{n}: {t * 1e3:.2f}" for n, t in prefill.items()) + " ms", flush=True)
        if clock.cuda:
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name(device) if clock.cuda else "cpu"
    source = (f"{device_name}: {shape.name} shards measured by make gpu-check (bench/gpu_engine.py), the TP group's "
              f"all-reduces modelled over {gpu.name} NVLink")
    costs = shard_profile(shards, Roofline(gpu, shape), source)
    try:  # the GPU measured, by its name in pat_operator.fit (which a preset matches), else as the device names itself
        measured = fit.gpu(device_name.replace(" ", "-")).name
    except fit.FitError:
        measured = device_name
    engine_profile = stamp({"gpu": measured, "model": shape.name, "device": device_name,
                            "dtype": str(model.dtype).removeprefix("torch."), **costs})
    result.update(shards=shards, engine=ENGINE_REVISION, file=None if out is None else str(out))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(engine_profile, indent=1) + "\n")
        print(f"profile: pat simulate's engine profile in {out}", flush=True)


# -- regroup ---------------------------------------------------------------------------------------------------
class Oracle:
    """The tiny model in this process, one sequence at a time: fp32 logits for the tie rule, and teacher forcing."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, max_seq: int):
        cfg, weights = load_model(model_dir, dtype, device)
        self.model, self.device = Transformer(cfg, weights), device
        self.shard, self.comm = self.model.shard(1, 0), SoloCommunicator(0)
        self.kv = PagedKV(cfg, -(-max_seq // 16) + 1, 16, cfg.num_kv_heads, dtype, device)

    def logits(self, tokens: list[int], all_positions: bool = False) -> torch.Tensor:
        self.kv.reset()
        x = torch.tensor([tokens], device=self.device)
        start = torch.zeros(1, dtype=torch.long, device=self.device)
        out = self.model.forward(self.shard, self.comm, self.kv, x, start, self.kv.tables_for(1, len(tokens), 1),
                                 all_positions=all_positions)
        return out[0].float()

    def teacher_forced(self, r: Request) -> list[float]:
        """Log-probabilities of r's output tokens given its prompt and the tokens before each."""
        lp = torch.log_softmax(self.logits(r.prompt + r.output, all_positions=True), dim=-1)
        at = torch.arange(len(r.prompt) - 1, len(r.prompt) + len(r.output) - 1, device=self.device)
        return lp[at, torch.tensor(r.output, device=self.device)].tolist()

    def margin(self, logits: torch.Tensor, p: SamplingParams, step: int, a: int, b: int) -> tuple[str, float]:
        """How far a row sampling with p at `step` is from taking b rather than a given these fp32 logits: greedy,
        the gap of their log-probabilities ("nats"); sampled, the largest distance of the draw point (the sampler's
        uniform of the seed and step, times the kept mass) from an inverse-CDF boundary between a and b, as a
        fraction of the kept mass ("mass"). Within TIE_NATS or TIE_MASS, bf16's noise may take either."""
        if p.temperature == 0:
            lp = torch.log_softmax(logits, dim=-1)
            return "nats", abs(float(lp[a] - lp[b]))
        batch = SamplingBatch.build([p], logits.shape[-1], self.device)
        probs = torch.softmax(logits / p.temperature, dim=-1)[None]
        if batch.sort_k:
            probs = torch.where(probs >= _threshold(probs, batch)[:, None], probs, 0.0)
        cdf = probs[0].cumsum(0)
        total = float(cdf[-1])
        x = float(uniform(batch.seed, torch.tensor([step], device=self.device))[0]) * total
        lo, hi = min(a, b), max(a, b)
        return "mass", max(abs(float(cdf[lo]) - x), abs(float(cdf[hi - 1]) - x)) / total

    def audit(self, r: Request) -> tuple[float, list[tuple[str, float]]]:
        """r's every token against the fp32 model given r's own prefix (teacher forcing): the largest difference of
        its log-probability from the fp32 one, and the margin of each token the fp32 model would not sample."""
        n, start = len(r.output), len(r.prompt) - 1
        logits = self.logits(r.prompt + r.output, all_positions=True)[start:start + n]
        tokens = torch.tensor(r.output, device=self.device)
        lp = torch.log_softmax(logits, dim=-1)[torch.arange(n, device=self.device), tokens]
        err = float((lp - torch.tensor(r.logprobs, device=self.device)).abs().max())
        params = SamplingBatch.build([r.params] * n, logits.shape[-1], self.device)
        picks = sample(logits, params, torch.arange(n, device=self.device))[0].tolist()
        return err, [self.margin(logits[i], r.params, i, r.output[i], picks[i]) for i in range(n)
                     if picks[i] != r.output[i]]


class Verdicts:
    """Counts of a check: requests that pass or not, the largest log-probability difference, the largest margin of
    a tie taken (to see how close to the tolerances a run came)."""

    def __init__(self):
        self.out = {"mismatched": 0, "max_logprob_diff": 0.0, "ties": 0, "max_tie_nats": 0.0, "max_tie_mass": 0.0,
                    "mismatched_requests": []}

    def tie(self, margin: tuple[str, float]) -> bool:
        kind, value = margin
        ok = value <= (TIE_NATS if kind == "nats" else TIE_MASS)
        if ok:
            self.out["ties"] += 1
            self.out[f"max_tie_{kind}"] = round(max(self.out[f"max_tie_{kind}"], value), 5)
        return ok

    def request(self, rid: str, err: float, ok: bool) -> None:
        self.out["max_logprob_diff"] = round(max(self.out["max_logprob_diff"], err), 5)
        if not (ok and err <= LOGPROB_ATOL):
            self.out["mismatched"] += 1
            self.out["mismatched_requests"] = (self.out["mismatched_requests"] + [rid])[:8]


def audit(run: dict[str, Request], oracle: Oracle) -> dict:
    """Every token of a run against the fp32 model (Oracle.audit): a request passes when each token's
    log-probability is within LOGPROB_ATOL of the fp32 one and each token the fp32 model would not sample is a tie."""
    v = Verdicts()
    for rid, r in run.items():
        err, margins = oracle.audit(r)
        ties = [v.tie(m) for m in margins]  # each one counted
        v.request(rid, err, all(ties))
    return {"tokens": sum(len(r.output) for r in run.values()), **v.out}


def compare(reference: dict[str, Request], got: dict[str, Request], oracle: Oracle) -> dict:
    """Request by request against a run of another dtype or layout: up to the first token where the two differ,
    every token's log-probability agrees within LOGPROB_ATOL, and that first differing token must be a tie under the
    fp32 model (Oracle.margin); after it the two continue from different prefixes and nothing more compares."""
    v, identical = Verdicts(), 0
    for rid, ref in reference.items():
        run = got[rid]
        k = next((i for i, (a, b) in enumerate(zip(ref.output, run.output)) if a != b), None)
        n = min(len(ref.output), len(run.output)) if k is None else k
        err = max((abs(a - b) for a, b in zip(ref.logprobs[:n], run.logprobs[:n])), default=0.0)
        if k is None:
            ok = len(ref.output) == len(run.output) and ref.finish_reason == run.finish_reason
            identical += ok
        else:
            ok = v.tie(oracle.margin(oracle.logits(ref.prompt + ref.output[:k]), ref.params, k, ref.output[k],
                                     run.output[k]))
        v.request(f"{rid}@{k}", err, ok)
    return {"identical": identical, **v.out}


def _count_steps(counts: dict) -> None:
    """In a rank: counts how the decode steps ran. The engine keeps a step out of CUDA graphs where its group's
    collectives are not NCCL's (gloo runs them on the host, where no graph can hold them)."""
    captured, step = Engine._captured, Engine._decode_step

    def counted_capture(self, inputs):
        before = len(self._graphs)
        replay = captured(self, inputs)
        counts["captures"] += len(self._graphs) - before
        counts["graph_steps"] += 1
        return replay

    def counted_step(self):
        graphs = counts["graph_steps"]
        out = step(self)
        counts["eager_steps"] += counts["graph_steps"] == graphs
        return out
    Engine._captured, Engine._decode_step = counted_capture, counted_step


def _rank_main(*args, **kwargs):
    """rank_main with counts of the decode steps' paths, written where the env says."""
    env = (args[7] if len(args) > 7 else kwargs.get("env")) or {}
    counts = {"captures": 0, "graph_steps": 0, "eager_steps": 0}
    _count_steps(counts)
    with contextlib.ExitStack() as stack:
        if env.get(STAND_IN):
            stack.enter_context(cpu_graph_stand_in(Engine))
        try:
            rank_module.rank_main(*args, **kwargs)
        finally:
            if env.get(COUNTS_DIR):
                Path(env[COUNTS_DIR], f"rank{args[0]}-{os.getpid()}.json").write_text(json.dumps(counts))


def read_counts(folder: Path) -> dict:
    total = {"captures": 0, "graph_steps": 0, "eager_steps": 0}
    for f in folder.glob("rank*.json"):
        for k, v in json.loads(f.read_text()).items():
            total[k] += v
        f.unlink()
    return total


def regroup_case(gen: LocalGenerator, start, target, migration: str, requests: list[Request], after: int = 12):
    """One batch from layout `start`; `target` applied once, after `after` step events (requests mid-way)."""
    gen.regroup(start)
    steps, applied = [], []

    def policy(_gen):
        if not applied and len(steps) >= after:
            applied.append(target)
            return target
        return None
    return gen.run(fresh(requests), policy=policy, on_step=steps.append, migration=migration, timeout=300)


def checks(run: dict[str, Request], reference: dict[str, Request], single: dict[str, Request] | None,
           oracle: Oracle) -> dict:
    """A bf16 run against the fp32 single-rank run, the bf16 single-rank run (differences of layout alone) and,
    token by token, the fp32 model."""
    out = {"vs_fp32": compare(reference, run, oracle)}
    if single is not None:
        out["vs_bf16_single_rank"] = compare(single, run, oracle)
    out["vs_fp32_model"] = audit(run, oracle)
    return out


def regroup(result: dict, device: torch.device, smoke: bool) -> None:
    shared = device.type == "cuda"
    options = rank_module.EngineOptions(max_batch=8, max_seq=192, profile_batches=(1, 4), comm_backend="gloo",
                                        device="cuda-shared" if shared else "cpu", kv_cache_bytes=64 << 20)
    bf16, fp32 = dataclasses.replace(options, dtype="bfloat16"), dataclasses.replace(options, dtype="float32")
    requests = mixed_requests(8 if smoke else 12, longest=80)
    result.update(tolerances={"logprob_atol": LOGPROB_ATOL, "tie_nats": TIE_NATS, "tie_mass": TIE_MASS},
                  device_option=options.device, requests=len(requests), cases=[])
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model_dir = make_tiny_model(Path(tmp, "model"), family="llama", preset="test", seed=1)
        counts = Path(tmp, "counts")
        counts.mkdir()
        env = {COUNTS_DIR: str(counts), **({STAND_IN: "1"} if smoke else {})}
        oracle = Oracle(model_dir, torch.float32, device, options.max_seq)
        with LocalGenerator(model_dir, 1, fp32, env) as gen:
            reference = gen.run(fresh(requests)).completions
        with LocalGenerator(model_dir, 1, bf16, env) as gen:
            single = gen.run(fresh(requests)).completions
        result["graphs_1_rank"] = read_counts(counts)
        # The harness: the fp32 oracle gives the fp32 engine's log-probabilities back; and bf16 against fp32 on the
        # fp32 run's tokens, without the engine.
        harness = max(abs(a - b) for r in reference.values() for a, b in zip(oracle.teacher_forced(r), r.logprobs))
        half = Oracle(model_dir, torch.bfloat16, device, options.max_seq)
        forced = max(abs(a - b) for r in reference.values()
                     for a, b in zip(half.teacher_forced(r), oracle.teacher_forced(r)))
        result["teacher_forcing"] = {"fp32_oracle_vs_fp32_engine": round(harness, 6), "bf16_vs_fp32": round(forced, 5),
                                     "pass": harness <= 1e-3 and forced <= LOGPROB_ATOL}
        result["single_rank_bf16"] = checks(single, reference, None, oracle)
        for world, transitions in REGROUPS.items():
            with LocalGenerator(model_dir, world, bf16, env) as gen:
                for name, start, target in transitions:
                    for migration in ("kv", "recompute"):
                        run = regroup_case(gen, start, target, migration, requests)
                        reports = [rep for rec in run.regroups for rep in rec.reports]
                        case = {"ranks": world, "regroup": name, "migration": migration,
                                "applied": [(r.old, r.new) for r in run.regroups] == [(start, target)]
                                and {rep.outcome for rep in reports} == {"applied"},
                                "moved": sum(rep.modes.get(migration, 0) for rep in reports),
                                **checks(run.completions, reference, single, oracle)}
                        result["cases"].append(case)
                        print(f"regroup, {world} ranks, {name} {migration}: applied {case['applied']}, moved "
                              f"{case['moved']}; mismatched " + ", ".join(
                                  f"{case[c]['mismatched']} {c}" for c in CHECKS), flush=True)
            result[f"graphs_{world}_ranks"] = read_counts(counts)
        # Negative control: rank 1 serves a corrupted slice of q_proj; every check must catch it.
        with LocalGenerator(model_dir, 2, bf16, {**env, "PAT_FAILPOINTS": "weights.corrupt@1"}) as gen:
            run = regroup_case(gen, (1, 1), (2,), "kv", requests)
        control = checks(run.completions, reference, single, oracle)
        read_counts(counts)
    cases = result["cases"]
    mismatches = {c: sum(case[c]["mismatched"] for case in cases) for c in CHECKS}
    caught = {c: control[c]["mismatched"] for c in CHECKS}
    result.update(mismatches=mismatches, not_applied=sum(not c["applied"] or not c["moved"] for c in cases),
                  negative_control={"mismatched": caught, "pass": min(caught.values()) > 0, **control})
    single_ok = all(v["mismatched"] == 0 for v in result["single_rank_bf16"].values())
    result["pass"] = (not any(mismatches.values()) and not result["not_applied"] and single_ok
                      and result["negative_control"]["pass"] and result["teacher_forcing"]["pass"])
    print(f"regroup: {len(cases)} cases; mismatches {mismatches}; {result['not_applied']} not applied; negative "
          f"control caught {caught}; bf16 vs fp32 teacher-forced {forced:.4f} nats (tolerance {LOGPROB_ATOL}): "
          f"{'pass' if result['pass'] else 'FAIL'}", flush=True)


# -- CUDA graphs' CPU stand-in (--smoke) ------------------------------------------------------------------------
class _StandInStream:
    def wait_stream(self, other) -> None:
        pass


class _StandInGraph:
    """torch.cuda.CUDAGraph on CPU: the capture records the function called under it and its outputs; a replay
    calls it again and copies the results into those outputs, as a real replay writes into the captured memory
    (reading the same static inputs)."""

    def __init__(self):
        self.fn, self.out = None, None

    def replay(self) -> None:
        for dst, src in zip(self.out, self.fn()):
            dst.copy_(src)

    def pool(self):
        return None


class _StandInCapture:
    """torch.cuda.graph on CPU: finds the function the `with` body calls (the first Python call returning to the
    caller's frame) among the caller's locals, and its return value."""

    def __init__(self, graph: _StandInGraph, pool=None, **_):
        self.graph, self.seen = graph, []

    def __enter__(self):
        self.caller = sys._getframe(1)
        sys.setprofile(self._profile)

    def _profile(self, frame, event, arg) -> None:
        enter = _StandInCapture.__enter__.__code__
        if event == "return" and frame.f_back is self.caller and frame.f_code is not enter and not self.seen:
            self.seen.append((frame.f_code, arg))

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        if exc[0] is None:
            code, self.graph.out = self.seen[0]
            self.graph.fn = next(f for f in self.caller.f_locals.values() if getattr(f, "__code__", None) is code)


@contextlib.contextmanager
def cpu_graph_stand_in(engine_class: type = Engine):
    """CUDA graphs on CPU for --smoke: torch.cuda's stream and graph API replaced by the stand-ins above, and every
    Engine built meanwhile with its graphs on, so that Engine._captured's code runs as on a GPU."""
    saved = {name: getattr(torch.cuda, name) for name in ("Stream", "current_stream", "stream", "graph", "CUDAGraph")}
    init = engine_class.__init__

    def graphs_on(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._cuda_graphs = self.static_shapes = kwargs.get("cuda_graphs", True)
    torch.cuda.Stream, torch.cuda.current_stream = _StandInStream, lambda *a, **k: _StandInStream()
    torch.cuda.stream, torch.cuda.graph, torch.cuda.CUDAGraph = (lambda s: contextlib.nullcontext(), _StandInCapture,
                                                                 _StandInGraph)
    engine_class.__init__ = graphs_on
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        engine_class.__init__ = init


# -- main ------------------------------------------------------------------------------------------------------
SECTIONS = ("bandwidth", "capacity", "decode", "profile", "regroup", "compile")


def build_model(result: dict, holder: dict, device: torch.device, clock: Clock, smoke: bool) -> None:
    """The decode sections' model: random weights made where they are used (on a GPU: no checkpoint written and read
    back, ~30 s saved for 16 GB), in bf16 (--smoke: the test preset in float32)."""
    hf = fit.hf_config("llama", **(fit.PRESETS["test"] if smoke else LLAMA_31))
    with torch.inference_mode():
        holder["model"] = model = Transformer(ModelConfig.from_hf(hf), random_weights(
            hf, 0, device, torch.float32 if smoke else torch.bfloat16))
    clock.sync()
    result.update(params=sum(t.numel() for t in model.w.values()), bytes=sum(t.nbytes for t in model.w.values()),
                  dtype=str(model.dtype))


def gpu_spec(name: str | None, device_name: str) -> fit.GPU:
    """--gpu, else the GPU this is (NVIDIA's name with dashes is a node label fit knows), else an H200."""
    for candidate in ([name] if name else [device_name.replace(" ", "-"), "H200"]):
        try:
            return fit.gpu(candidate)
        except fit.FitError:
            if name:
                raise
    raise AssertionError("unreachable")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, the test preset, seconds (the code paths, no numbers)")
    ap.add_argument("--out", type=Path, help=f"write the JSON here (default on a GPU: {RESULTS})")
    ap.add_argument("--profile-out", type=Path, help=f"write pat simulate's engine profile here (default on a GPU: "
                                                      f"{PROFILE})")
    ap.add_argument("--gpu", help="the GPU whose datasheet HBM bandwidth the rooflines use (default: this one, as "
                                  "pat_operator.fit knows it, else H200)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--timeout", type=float, default=270, help="seconds before the watchdog ends the run")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_engine: no CUDA device here; this check measures a GPU and needs one (--smoke runs its code on "
              "CPU).", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.timeout
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        free, total = torch.cuda.mem_get_info(device)  # before this process allocates anything
        memory = (free, total, torch.cuda.get_device_name(device))
    else:
        torch.set_num_threads(1)  # tiny matrices: more threads only contend (the ranks run one each too)
        memory = (0, 0, "cpu")
    try:
        gpu = gpu_spec(args.gpu, memory[2])
    except fit.FitError as e:
        ap.error(str(e))
    if device.type == "cpu":  # no GPU: the capacity as on that GPU's datasheet memory, less a CUDA context
        memory = (int(gpu.memory_bytes) - (512 << 20), int(gpu.memory_bytes), f"{gpu.name} (assumed: no GPU here)")
    hbm = gpu.hbm_bytes_per_s
    results = Results(args.out or (None if args.smoke else RESULTS), stamp({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "gpu_spec": gpu.name,
        "torch": torch.__version__, "smoke": args.smoke, "targets": TARGETS,
        "command": "python bench/gpu_engine.py " + " ".join(sys.argv[1:])}))
    watchdog(results, args.timeout)
    clock = Clock(device)
    # The ranks of LocalGenerator run this script's _rank_main (a forkserver child imports this file by its path).
    generator_module.rank_main = _rank_main
    cases = [DecodeCase("batch1", 1, 256, 48, 8, TARGETS["batch1_roofline"]),
             DecodeCase("batch128", 128, 2048, 16, 4, TARGETS["batch128_roofline"])]
    if args.smoke:
        cases = [DecodeCase("batch1", 1, 32, 4, 2, TARGETS["batch1_roofline"], 256),
                 DecodeCase("batch128", 8, 64, 4, 2, TARGETS["batch128_roofline"], 256)]
    holder: dict = {}
    with contextlib.ExitStack() as stack:
        if args.smoke:
            stack.enter_context(cpu_graph_stand_in())
        if "bandwidth" in args.sections:
            results.section("bandwidth", bandwidth, device, clock, hbm)
        if "capacity" in args.sections:
            results.section("capacity", capacity, memory)
        if {"decode", "profile", "compile"} & set(args.sections):
            results.section("model", build_model, holder, device, clock, args.smoke)
        if "decode" in args.sections:
            with torch.inference_mode():
                results.section("decode", lambda result: decode(result, holder["model"], cases, clock, hbm))
        if "profile" in args.sections:
            profile_out = args.profile_out or (None if args.smoke else PROFILE)
            with torch.inference_mode():
                results.section("profile", lambda result: profile(result, holder["model"], clock, gpu, args.smoke,
                                                                  profile_out))
        if "regroup" in args.sections:
            results.section("regroup", regroup, device, args.smoke)
    if "compile" in args.sections:  # outside the stand-in: torch.compile on CPU needs the real torch.cuda
        captured = results.data.get("decode", {}).get(cases[0].name, {}).get("captured", {})
        with torch.inference_mode():
            results.section("compile", lambda result: compile_decode(result, holder["model"], cases[0], clock,
                                                                     deadline, captured))
    data = results.data
    failed = [name for name in ("model", *SECTIONS) if data.get(name, {}).get("status") == "error"]
    if data.get("regroup", {}).get("status") == "done" and not data["regroup"]["pass"]:
        failed.append("regroup (correctness)")
    return results.finish(failed)


if __name__ == "__main__":
    sys.exit(main())
