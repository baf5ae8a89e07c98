"""`python -m pat_workers.generator` (also `pat generator`): one generator pod, of this project's engine
(--engine pat: coordinator.py) or of vLLM (--engine vllm: vllm.py), behind the same pod API.

Prints 'listening on http://HOST:PORT' once it accepts connections; /readyz answers 200 once the engines have
loaded the model (and, engine pat, measured their costs). Exits 0 on SIGTERM, 1 if an engine or the coordinator
fails (so that a supervisor restarts the gang; the last line on stderr says why), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pat generator", description="one generator pod: HTTP coordinator + engine "
                                 "ranks (one per GPU, else one per CPU core)")
    ap.add_argument("--engine", choices=("pat", "vllm"), default="pat", help="pat: this project's engine (adaptive "
                    "TP); vllm: vLLM engines, at a fixed TP or, with --tp-sizes, one per group of each layout")
    ap.add_argument("--model", required=True, help="model directory: config.json, *.safetensors, tokenizer.json")
    ap.add_argument("--ranks", type=int, required=True, help="engine ranks (a power of two)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    ap.add_argument("--token-file", help="the job's control token, which every endpoint takes (default: env "
                    "PAT_JOB_TOKEN)")
    ap.add_argument("--inference-token-file", help="the job's inference token, which only POST /v1/rollouts and "
                    "GET /v1/rollouts/{batch} take (default: env PAT_INFERENCE_TOKEN; none: no inference token)")
    ap.add_argument("--weights-store", help="HOST or HOST:PORT of the job's weight-sync store (its trainer's rank 0): "
                    "POST /v1/weights takes only it, comparing the addresses HOST resolves to when an update comes "
                    "(default: any store)")
    ap.add_argument("--controller", choices=("pod", "operator"), default="pod",
                    help="pod: plan regroups here; operator: apply the operator's plans (POST /v1/regroup)")
    ap.add_argument("--margin", type=float, default=0.1, help="regroup when the predicted gain beats its cost by "
                    "this fraction of the time left")
    ap.add_argument("--cooldown-steps", type=int, default=4, help="decode steps after a regroup before the next")
    ap.add_argument("--no-guard", dest="guard", action="store_false",
                    help="trust the profile as given: no regroup judged by the steps it delivers, no refinement "
                         "(to measure what the guard saves)")
    ap.add_argument("--migration", choices=("auto", "kv", "recompute"), default="auto")
    ap.add_argument("--max-batch", type=int, default=64, help="sequences per TP=1 replica")
    ap.add_argument("--max-seq", type=int, default=512, help="prompt + response tokens per sequence")
    ap.add_argument("--memory-utilization", type=float, default=0.9, help="fraction of each GPU's memory the engine "
                    "may use: weights, working memory and the paged KV cache, which gets the rest")
    ap.add_argument("--compile-step", action="store_true", help="run the decode step through torch.compile "
                    "(engine pat; about 30 s of compiling per rank and TP size at start)")
    ap.add_argument("--kv-cache-bytes", type=int, default=0, help="explicit KV pool bytes per rank, overrides "
                    "--memory-utilization; for tests and benchmarks")
    ap.add_argument("--reserved-bytes", type=int, default=0, help="bytes of each GPU the KV cache leaves to the "
                    "trainer rank beside it (placement colocated: what the trainer keeps between phases)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--profile", help="offline T(tp, batch, context) profile JSON (Profile.to_json); default: measured")
    ap.add_argument("--tokenizer", help="directory with tokenizer.json (default: the model directory)")
    ap.add_argument("--tp-sizes", help="comma-separated TP sizes plans may use, e.g. 1,2 (default: engine pat all, "
                    "engine vllm only --tensor-parallel-size)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="engine pat: the fixed layout, ranks / this "
                    "many TP groups of this size (with --controller operator: no plans are taken); engine vllm: "
                    "the TP of each vLLM engine, the pod runs ranks / this many engines")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--comm-backend", choices=("auto", "shm", "gloo", "nccl"), default="auto")
    vllm = ap.add_argument_group("--engine vllm")
    vllm.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    vllm.add_argument("--max-model-len", type=int, default=512)
    vllm.add_argument("--enforce-eager", action="store_true")
    vllm.add_argument("--vllm-arg", action="append", default=[], help="a further `vllm serve` flag, e.g. "
                      "--vllm-arg=--max-num-seqs=128 (repeat it)")
    vllm.add_argument("--vllm-python", default=os.environ.get("PAT_VLLM_PYTHON", sys.executable),
                      help="the interpreter that has vLLM (default: env PAT_VLLM_PYTHON, else this one)")
    args = ap.parse_args(argv)
    control = _token(ap, "--token-file", args.token_file, "PAT_JOB_TOKEN")
    if not control:
        ap.error("no token: set --token-file FILE or PAT_JOB_TOKEN (the job's Secret); every endpoint but "
                 "/healthz, /readyz and /metrics needs it")
    inference = _token(ap, "--inference-token-file", args.inference_token_file, "PAT_INFERENCE_TOKEN")
    # Imported once the arguments parse: --help and argument errors answer without loading torch.
    from .errors import WeightStore
    from .server import Tokens, make_app, serve

    try:
        store = WeightStore.parse(args.weights_store) if args.weights_store else None
        tokens = Tokens(control, inference or None)
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    tp_sizes = tuple(int(t) for t in args.tp_sizes.split(",")) if args.tp_sizes else ()
    try:
        if args.engine == "vllm":
            from .vllm import VllmConfig, VllmPod, make_vllm_app

            device = "cuda" if args.device == "cuda" else "cpu"
            pod = VllmPod(VllmConfig(args.model, args.ranks, args.tensor_parallel_size, args.gpu_memory_utilization,
                                     args.max_model_len, args.dtype, device, args.enforce_eager, args.tokenizer,
                                     tuple(args.vllm_arg), args.vllm_python, tp_sizes, args.controller,
                                     args.margin, args.profile))
            app = make_vllm_app(pod, tokens, store)
        else:
            from ..engine.rank import EngineOptions
            from .coordinator import Coordinator, PodConfig

            options = EngineOptions(max_batch=args.max_batch, max_seq=args.max_seq, dtype=args.dtype,
                                    migration=args.migration, comm_backend=args.comm_backend, device=args.device,
                                    memory_utilization=args.memory_utilization, kv_cache_bytes=args.kv_cache_bytes,
                                    reserved_bytes=args.reserved_bytes, compile_step=args.compile_step)
            pod = Coordinator(PodConfig(args.model, args.ranks, options, args.controller, args.margin,
                                        args.cooldown_steps, args.guard, args.profile, args.tokenizer, tp_sizes or None,
                                        args.tensor_parallel_size), token=control)
            app = make_app(pod, tokens, store)
    except (OSError, ValueError) as e:  # a bad model directory, option or profile file
        print(f"pat generator: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(pod, app, args.host, args.port, announce=lambda line: print(line, flush=True)))


def _token(ap: argparse.ArgumentParser, flag: str, path: str | None, env: str) -> str:
    """The token in the file `path`, else in the environment variable `env` ("" if neither)."""
    try:
        return Path(path).read_text().strip() if path else os.environ.get(env, "").strip()
    except OSError as e:
        ap.error(f"{flag}: {e}")


if __name__ == "__main__":
    sys.exit(main())
