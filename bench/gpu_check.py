"""One GPU, one trainer step of a Qwen2.5-1.5B-shaped model: the fit check's memory estimate and the MFU.

A random-weight model of Qwen2.5-1.5B's shape (hidden 1536, intermediate 8960, 28 layers, 12 heads / 2 KV heads,
vocab 151936, tied embeddings) is written as a checkpoint and loaded through the trainer's own path:
sharded_policy (FSDP2 over a 1-rank NCCL mesh, bf16 compute, float32 master weights and gradients, activation
checkpointing), AdamW, train_iteration on 2 sequences of 4096 tokens (maxTokensPerMicroBatch 8192: one
micro-batch). It reports
- the peak GPU memory (torch.cuda.max_memory_allocated / max_memory_reserved, over loading and every step)
  against pat_operator.fit.trainer_memory's estimate for the same job (memory_ratio: target within 1 +- 0.15),
- the MFU of the fastest warm step: model FLOPs (6 x matmul parameters x tokens, the LM head over the response
  tokens it scores, plus causal attention; 8 x with the forward that recomputes pi_old) over its time, over the GPU's dense bf16 peak (target >= 0.40).
It writes them to bench/results/gpu-check-trainer.json (--out to change), with the commit it measured, and prints
them as one JSON line.
On an error it still writes what it has, with the traceback; a watchdog ends it after --timeout seconds.

--smoke runs the same code on CPU (the test preset, gloo, float32, a few tokens) and writes only with --out.
  python bench/gpu_check.py            # needs a CUDA GPU; about 2 minutes on an H200, most of it writing the model
  python bench/gpu_check.py --smoke    # CPU, seconds
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pat_operator import fit
from pat_workers.engine.loader import save_weights
from pat_workers.engine.tiny import random_weights
from pat_workers.revision import stamp
from pat_workers.trainer.loop import adamw, train_iteration
from pat_workers.trainer.policy import sharded_policy
from trainer_memory import estimated_state_bytes, job_spec, state_bytes, synthetic_rollouts

# Qwen/Qwen2.5-1.5B's config.json dimensions.
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
SMOKE = dict(fit.PRESETS["test"], tie_word_embeddings=True)
RESULTS = Path(__file__).parent / "results" / "gpu-check-trainer.json"


def write_model(path: Path, dims: dict, dtype: torch.dtype) -> Path:
    """A Qwen2 checkpoint of these dimensions with random weights, in `dtype` (Qwen2.5 ships bfloat16)."""
    cfg = fit.hf_config("qwen2", **dims)
    save_weights(path, random_weights(cfg, seed=0, dtype=dtype))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def model_flops(shape: fit.ModelShape, sequence_tokens: list[int], response_tokens: int, recompute: bool) -> float:
    """Forward + backward FLOPs (3 x the forward's), and with `recompute` the forward that scores pi_old before the
    step (algorithm.oldLogprobs: trainer), not counting activation checkpointing's recomputation: every token
    through each layer's matrices, the scored response tokens through the LM head, and causal attention (q.k and
    attention x v over half of the T x T pairs per head and layer)."""
    layers = shape.layers * shape.layer_matmul_params * sum(sequence_tokens)
    head = shape.vocab * shape.hidden * response_tokens
    attention = shape.layers * shape.heads * shape.head_dim * sum(t * t for t in sequence_tokens)
    return (4 if recompute else 3) * 2 * (layers + head + attention)


def measure(model_dir: Path, device: torch.device, args: argparse.Namespace, result: dict) -> None:
    """Fills `result` as it goes, so that an error leaves what was measured before it."""
    on_gpu = device.type == "cuda"
    sequence = args.prompt_tokens + args.response_tokens
    spec = job_spec(model_dir, 1, on_gpu, args.sequences * sequence, True)
    shape = fit.read_shape(model_dir / "config.json")
    memory = fit.trainer_memory(spec, shape)
    result.update(params=shape.params, tokens_per_micro_batch=spec.algorithm.max_tokens_per_micro_batch,
                  estimate_bytes=round(memory.total), estimate_state_bytes=round(estimated_state_bytes(memory)),
                  estimate_terms={label: round(b) for label, b in memory.terms})
    policy = sharded_policy(model_dir, init_device_mesh(device.type, (1,)), checkpointing=True, bf16=on_gpu,
                            cpu_offload=False)
    optimizer = adamw(policy, spec.algorithm, device)
    rollouts = synthetic_rollouts(args.sequences, args.prompt_tokens, args.response_tokens, shape.vocab)
    seconds = result["step_seconds"] = []
    for _ in range(args.steps):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_iteration(policy, None, optimizer, rollouts, spec.algorithm, 0, 1, device)
        if on_gpu:
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - start, 4))
        print(f"step {len(seconds)}: {seconds[-1]:.3f} s", flush=True)
    result["state_bytes"] = state_bytes(policy, optimizer)
    flops = model_flops(shape, [sequence] * args.sequences, args.sequences * args.response_tokens,
                        spec.algorithm.old_logprobs == "trainer")
    peak = fit.gpu(args.gpu).bf16_flops
    result.update(model_flops=flops, peak_flops=peak, mfu=round(flops / min(seconds[1:]) / peak, 4))


def record_peak_memory(device: torch.device, result: dict) -> None:
    """The GPU's peak memory since the start, against the estimate (if it was reached): also after an error."""
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    result.update(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved)
    if "estimate_bytes" in result:
        result.update(memory_ratio=round(allocated / result["estimate_bytes"], 4),
                      reserved_ratio=round(reserved / result["estimate_bytes"], 4))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, the test preset, gloo, float32, a few tokens")
    ap.add_argument("--out", type=Path, help=f"write the JSON here (default on a GPU: {RESULTS})")
    ap.add_argument("--gpu", default="H200", help="the GPU whose dense bf16 peak the MFU is taken against")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, help="per sequence (default 256; --smoke 8)")
    ap.add_argument("--response-tokens", type=int, help="per sequence (default 3840; --smoke 8)")
    ap.add_argument("--steps", type=int, default=3, help="training steps; the first is a warm-up, not timed")
    ap.add_argument("--timeout", type=float, default=450, help="seconds before the watchdog ends the run")
    args = ap.parse_args()
    # Bounded even if a collective or the driver hangs: dumps every thread's stack and exits.
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    args.prompt_tokens = args.prompt_tokens or (8 if args.smoke else 256)
    args.response_tokens = args.response_tokens or (8 if args.smoke else 3840)
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step warms up and is not timed")
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; this check measures a GPU and needs one (--smoke runs its code on "
              "CPU).", file=sys.stderr)
        return 2
    try:
        fit.gpu(args.gpu)  # an unknown name fails now, not after the run
    except fit.FitError as e:
        ap.error(str(e))
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    out = args.out or (None if args.smoke else RESULTS)
    result: dict = stamp({"device": "cpu" if args.smoke else torch.cuda.get_device_name(device),
                          "torch": torch.__version__, "smoke": args.smoke}, engine=False)  # + the commit measured
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # One rank in this process: an in-process store, no port to find.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, timeout=timedelta(seconds=args.timeout))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            model_dir = write_model(Path(tmp), SMOKE if args.smoke else QWEN_1_5B,
                                    torch.float32 if args.smoke else torch.bfloat16)
            print(f"model written in {time.perf_counter() - start:.1f} s", flush=True)
            measure(model_dir, device, args, result)
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
    finally:
        dist.destroy_process_group()
    if device.type == "cuda":
        record_peak_memory(device, result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
