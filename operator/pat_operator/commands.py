"""The worker command lines of an RLHFJob: one function per process kind, shared by the operator's pods and the
local launcher (`pat run`), so that a job runs the same processes on Kubernetes and on one machine.

Each returns the arguments after the `pat` command.
"""

from __future__ import annotations

from .api import RLHFJobSpec


def prepare_args(job_file: str, model_dir: str) -> list[str]:
    """Builds the job's tiny model (deterministic from its seed) into model_dir, unless it is there already."""
    return ["prepare", "--job", job_file, "--model", model_dir]


def generator_args(spec: RLHFJobSpec, model_dir: str, host: str, token_file: str | None = None,
                   inference_token_file: str | None = None, weights_store: str | None = None) -> list[str]:
    """One generator pod. Its tokens come from the files given, else from env PAT_JOB_TOKEN (control) and
    PAT_INFERENCE_TOKEN; `weights_store`: HOST or HOST:PORT of the job's weight-sync store (the trainer's rank 0
    hosts it, and announces it in each weight update), the only store the pod then takes weights from."""
    g, a = spec.generator, spec.generator.adaptive_tp
    access = _access_args(token_file, inference_token_file, weights_store)
    if g.engine == "vllm":
        return _vllm_generator_args(spec, model_dir, host, access)
    controller = a.controller if g.adaptive else "operator"  # off: the pod plans nothing and no plans arrive
    args = ["generator", "--model", model_dir, "--ranks", str(g.ranks), "--host", host, "--port", str(g.port),
            "--controller", controller, "--margin", str(a.min_gain), "--cooldown-steps", str(a.cooldown_steps),
            "--migration", a.migration, "--max-batch", str(g.max_batch), "--max-seq", str(g.max_seq),
            "--memory-utilization", str(g.memory_utilization), "--dtype", spec.model.dtype,
            "--tp-sizes", ",".join(map(str, g.tp_sizes)), "--tensor-parallel-size", str(g.tensor_parallel_size),
            # A CPU pod stays on CPU where GPUs are visible anyway (pat run on a workstation); a GPU pod fails at
            # start when it has fewer GPUs than ranks instead of falling back.
            "--device", "cuda" if g.gpus_per_pod else "cpu"]
    if g.compile_step:
        args.append("--compile-step")
    if a.profile:
        args += ["--profile", a.profile]
    if spec.tokenizer.path:
        args += ["--tokenizer", spec.tokenizer.path]
    return args + access


def _access_args(token_file: str | None, inference_token_file: str | None, weights_store: str | None) -> list[str]:
    """Who may call the generator pod, and where it takes weights from."""
    args = []
    for flag, value in (("--token-file", token_file), ("--inference-token-file", inference_token_file),
                        ("--weights-store", weights_store)):
        if value:
            args += [flag, value]
    return args


def _vllm_generator_args(spec: RLHFJobSpec, model_dir: str, host: str, access: list[str]) -> list[str]:
    """engine vllm: the pod's API in front of ranks / tensorParallelSize vLLM engines; each extraArgs entry is passed
    on to `vllm serve` as it is (--vllm-arg=--max-num-seqs=128)."""
    g, v = spec.generator, spec.generator.vllm
    args = ["generator", "--engine", "vllm", "--model", model_dir, "--ranks", str(g.ranks), "--host", host,
            "--port", str(g.port), "--tensor-parallel-size", str(v.tensor_parallel_size),
            "--gpu-memory-utilization", str(v.gpu_memory_utilization),
            "--max-model-len", str(v.max_model_len or g.max_seq), "--dtype", spec.model.dtype,
            "--device", "cuda" if g.gpus_per_pod else "cpu"]
    if g.adaptive:
        args += ["--tp-sizes", ",".join(map(str, g.tp_sizes)), "--controller", g.adaptive_tp.controller,
                 "--margin", str(g.adaptive_tp.min_gain)]
        if g.adaptive_tp.profile:
            args += ["--profile", g.adaptive_tp.profile]
    if v.enforce_eager:
        args += ["--enforce-eager"]
    if spec.tokenizer.path:
        args += ["--tokenizer", spec.tokenizer.path]
    return args + access + [f"--vllm-arg={a}" for a in v.extra_args]


def trainer_args(spec: RLHFJobSpec, job_file: str, model_dir: str, run_dir: str, generators: list[str], host: str,
                 pod_index: int, master_addr: str, master_port: int, metrics_port: int = 0, weight_port: int = 0,
                 token_file: str | None = None, bind: str | None = None) -> list[str]:
    """One trainer pod: `pat trainer LAUNCH_OPTIONS -- RANK_OPTIONS` starts trainer.ranks rank processes through
    torch.distributed.run. Static rendezvous at trainer pod 0 with the pod's index as node rank, so global rank 0
    (metrics, weight sync, the generators' driver) is on pod 0. No restarts inside the pod: a dead rank fails the
    pod, the operator restarts the whole gang and the trainer resumes from its checkpoint."""
    t = spec.trainer
    launch = ["--nnodes", str(t.replicas), "--nproc-per-node", str(t.ranks), "--node-rank", str(pod_index),
              "--master-addr", master_addr, "--master-port", str(master_port), "--max-restarts", "0"]
    rank = ["--job", job_file, "--model", model_dir, "--run-dir", run_dir, "--generators", ",".join(generators),
            "--host", host, "--weight-port", str(weight_port), "--metrics-port", str(metrics_port)]
    if spec.tokenizer.path:
        rank += ["--tokenizer", spec.tokenizer.path]
    if token_file:
        rank += ["--token-file", token_file]
    if bind:
        rank += ["--bind", bind]
    return ["trainer", *launch, "--", *rank]


def colocated_args(spec: RLHFJobSpec, job_file: str, model_dir: str, run_dir: str, generators: list[str], host: str,
                   pod_index: int, master_addr: str, master_port: int, generator_host: str, metrics_port: int = 0,
                   token_file: str | None = None, bind: str | None = None,
                   inference_token_file: str | None = None) -> list[str]:
    """One pod of a colocated job (spec.placement: colocated): `pat colocated` runs the pod's generator (generator_args,
    listening on generator_host, taking weights only from the store at master_addr, pod 0's, where trainer rank 0
    runs) and its trainer ranks (trainer_args, on the same devices) as one unit, built from the same job file."""
    args = ["colocated", "--job", job_file, "--model", model_dir, "--run-dir", run_dir, "--generators",
            ",".join(generators), "--host", host, "--generator-host", generator_host, "--pod-index", str(pod_index),
            "--master-addr", master_addr, "--master-port", str(master_port), "--metrics-port", str(metrics_port)]
    if token_file:
        args += ["--token-file", token_file]
    if inference_token_file:
        args += ["--inference-token-file", inference_token_file]
    if bind:
        args += ["--bind", bind]
    return args
