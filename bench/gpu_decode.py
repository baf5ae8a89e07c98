"""Single-GPU decode speed of a Llama-3.1-8B-shaped random-weight model (bf16), beside the memory roofline.

The roofline of one decode step is (weight bytes + KV bytes read) / HBM bandwidth; decode at small batch is
memory-bound, so the fraction of it reached says how much of the GPU the engine uses. The step runs through
the engine's own forward (the shard views), captured in a CUDA graph so that kernel launches do not hide
the memory time (the forward alone: bench/gpu_engine.py times the engine's whole step, sampling and scheduling
included, for make gpu-check). With --shards it also times what one rank of a TP=t group computes (its shard: 1/t of the
heads and MLP columns; the all-reduces between ranks need t GPUs and are not in it), at several contexts, and
prefills; --out writes all of it as JSON (the measured side that `pat simulate`'s GPU cost model is checked
against). Without a GPU it says so and exits 2.
  python bench/gpu_decode.py [--batches 1 32] [--context 1024] [--bandwidth 4.3e12]
  python bench/gpu_decode.py --shards 1 2 4 8 --contexts 1024 8192 --batches 1 8 32 128 --out h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.model import Transformer
from pat_workers.engine.tiny import PRESETS, hf_config, random_weights

BLOCK_SIZE = 16  # the engine's default
H200_BANDWIDTH = 4.8e12 * 0.9  # 4.8 TB/s peak; ~4.3 TB/s is what a device-to-device copy reaches


def paged(model: Transformer, batch: int, tokens: int, tp: int) -> tuple[PagedKV, torch.Tensor]:
    """A paged KV cache holding `batch` sequences of `tokens` of rank 0's heads at TP=tp, and their block tables."""
    blocks = -(-tokens // BLOCK_SIZE)
    kv = PagedKV(model.cfg, batch * blocks + 1, BLOCK_SIZE, model.cfg.num_kv_heads // tp, model.dtype, model.device)
    return kv, kv.tables_for(batch, tokens, 1)


def decode_seconds(model: Transformer, batch: int, context: int, iters: int, tp: int = 1) -> float:
    """One decode step of rank 0's TP=tp shard, replayed from a CUDA graph."""
    device = model.device
    shard, comm = model.shard(tp, 0), SoloCommunicator(0)
    kv, tables = paged(model, batch, context + 1, tp)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
    start = torch.full((batch,), context, dtype=torch.long, device=device)

    def step():
        return model.forward(shard, comm, kv, tokens, start, tables)

    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def prefill_seconds(model: Transformer, tokens: int, tp: int, iters: int = 5) -> float:
    """Prefilling one sequence of `tokens` on rank 0's TP=tp shard (large kernels: no graph needed)."""
    device = model.device
    shard, comm = model.shard(tp, 0), SoloCommunicator(0)
    kv, tables = paged(model, 1, tokens, tp)
    ids, start = torch.zeros(1, tokens, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long,
                                                                                      device=device)
    with torch.inference_mode():
        model.forward(shard, comm, kv, ids, start, tables)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            model.forward(shard, comm, kv, ids, start, tables)
        end.record()
        torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's cache")
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="HBM bytes/s for the roofline")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    ap.add_argument("--shards", type=int, nargs="+", help="also time one rank's shard of these TP sizes")
    ap.add_argument("--contexts", type=int, nargs="+", help="with --shards: contexts (default --context)")
    ap.add_argument("--prefills", type=int, nargs="+", default=[512, 4096], help="with --shards: prompt tokens")
    ap.add_argument("--out", type=Path, help="write every measurement as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device here; this benchmark measures a GPU and needs one (see docs/limits.md: "
              "'What needs a GPU').", file=sys.stderr)
        return 2
    hf = hf_config("llama", **PRESETS[args.preset])
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], args.context + 1, *args.prefills,
                                        *(c + 1 for c in args.contexts or []))
    cfg = ModelConfig.from_hf(hf)
    weights = random_weights(hf, seed=0, device="cuda", dtype=torch.bfloat16)
    model = Transformer(cfg, weights)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    params = sum(t.numel() for t in weights.values())
    print(f"{torch.cuda.get_device_name()}: {args.preset} ({params / 1e9:.2f} B params, "
          f"{weight_bytes / 1e9:.1f} GB bf16), context {args.context}, roofline at {args.bandwidth / 1e12:.2f} TB/s")
    results = {}
    for batch in args.batches:
        seconds = decode_seconds(model, batch, args.context, args.iters)
        kv_bytes = batch * (args.context + 1) * cfg.kv_bytes_per_token(2)
        roofline = (weight_bytes + kv_bytes) / args.bandwidth
        results[batch] = {"step_ms": round(seconds * 1e3, 3), "tokens_per_s": round(batch / seconds, 1),
                          "roofline_ms": round(roofline * 1e3, 3), "roofline_fraction": round(roofline / seconds, 3)}
        print(f"batch {batch:3d}: {seconds * 1e3:7.3f} ms/step, {batch / seconds:9.1f} tokens/s, "
              f"roofline {roofline * 1e3:.3f} ms -> {roofline / seconds:.1%} of it")
    summary = {"batches": results, "roofline_fraction_batch1": results.get(1, {}).get("roofline_fraction")}
    if args.shards:
        shards = {"device": torch.cuda.get_device_name(), "preset": args.preset, "weight_bytes": weight_bytes,
                  "kv_bytes_per_token": cfg.kv_bytes_per_token(2), "decode": {}, "prefill": {}}
        for tp in args.shards:  # seconds: decode[tp][context][batch], prefill[tp][tokens]
            shards["decode"][tp] = {c: {b: decode_seconds(model, b, c, args.iters, tp) for b in args.batches}
                                    for c in args.contexts or [args.context]}
            shards["prefill"][tp] = {n: prefill_seconds(model, n, tp) for n in args.prefills}
            print(f"TP={tp} shard: " + "; ".join(
                f"context {c}: " + " ".join(f"b{b} {s * 1e3:.3f}" for b, s in row.items())
                for c, row in shards["decode"][tp].items()) + " ms; prefill " +
                " ".join(f"{n}: {s * 1e3:.2f}" for n, s in shards["prefill"][tp].items()) + " ms", flush=True)
        if args.out:
            args.out.write_text(json.dumps(shards, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
