"""Single-GPU decode speed of a Llama-3.1-8B-shaped random-weight model (bf16), beside the memory roofline.

The roofline of one decode step is (weight bytes + KV bytes read) / HBM bandwidth; decode at small batch is
memory-bound, so the fraction of it reached says how much of the GPU the engine uses. The step runs through
the engine's own forward (the TP=1 shard views), captured in a CUDA graph so that kernel launches do not hide
the memory time. Without a GPU it says so and exits 2.
  python bench/gpu_decode.py [--batches 1 32] [--context 1024] [--bandwidth 4.3e12]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pat_workers.engine.comm import SoloCommunicator
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.kv import KVCache
from pat_workers.engine.model import Transformer
from pat_workers.engine.tiny import PRESETS, hf_config, random_weights

H200_BANDWIDTH = 4.8e12 * 0.9  # 4.8 TB/s peak; ~4.3 TB/s is what a device-to-device copy reaches


def decode_seconds(model: Transformer, batch: int, context: int, iters: int) -> float:
    cfg, device = model.cfg, model.device
    shard, comm = model.shard(1, 0), SoloCommunicator(0)
    cache = KVCache.allocate(cfg, batch, cfg.num_kv_heads, context + 1, model.dtype, device)
    k, v = cache.rows(0, batch)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
    start = torch.full((batch,), context, dtype=torch.long, device=device)

    def step():
        return model.forward(shard, comm, tokens, start, k, v, length=context + 1)

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's cache")
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="HBM bytes/s for the roofline")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device here; this benchmark measures a GPU and needs one (see README: "
              "'What needs a GPU').", file=sys.stderr)
        return 2
    hf = hf_config("llama", **PRESETS[args.preset])
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], args.context + 1)
    cfg = ModelConfig.from_hf(hf)
    weights = random_weights(hf, seed=0, device="cuda", dtype=torch.bfloat16)
    model = Transformer(cfg, weights)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{torch.cuda.get_device_name()}: {args.preset} ({cfg.num_params / 1e9:.2f} B params, "
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
    print(json.dumps({"batches": results, "roofline_fraction_batch1": results.get(1, {}).get("roofline_fraction")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
