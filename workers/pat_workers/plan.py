"""`pat plan JOB.yaml`: will the job fit? The memory of one trainer rank and one generator engine rank, term by term
(pat_operator.fit's estimate), against the GPUs the pods select, and how many sequences of maxSeq an engine rank's
KV cache holds there; exits 2 naming the field to change when a role does not fit. Torch-free, like the estimate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pat_operator.api import RLHFJob, RLHFJobSpec, load_job
from pat_operator.fit import (BLOCK_SIZE, GPU, GPU_PRODUCT_LABEL, GPUS, HEADROOM, ROLES, SHAPES, FitError, ModelShape,
                              allowance, gib, kv_blocks, need, problems, read_shape, role_gpus, sequence_blocks,
                              tiny_shape)

LABEL_WIDTH = 46


def spec_shape(spec: RLHFJobSpec) -> ModelShape | None:
    """The shape where this machine knows it: a tiny preset's, or model.path's config.json if it is here."""
    if spec.model.tiny is not None:
        return tiny_shape(spec.model.tiny.preset, spec.model.tiny.family)
    path = Path(spec.model.path or "") / "config.json"
    return read_shape(path) if path.is_file() else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pat plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("job", help="an RLHFJob YAML")
    ap.add_argument("--model-config", type=Path, help="the model's config.json (default: model.path/config.json if "
                                                      "it is here, or the tiny preset's shape)")
    ap.add_argument("--model", help=f"a built-in model shape instead: {', '.join(SHAPES)}")
    ap.add_argument("--gpu", help=f"the GPU of every pod: {', '.join(GPUS)} or a {GPU_PRODUCT_LABEL} value "
                                  f"(default: each pod's nodeSelector {GPU_PRODUCT_LABEL})")
    args = ap.parse_args(argv)
    job = load_job(args.job)
    try:
        shape = _shape(job.spec, args.model_config, args.model)
        gpus = role_gpus(job.spec, args.gpu)
    except FitError as e:
        print(f"pat plan: {e}", file=sys.stderr)
        return 2
    print(table(job, shape, gpus))
    if found := problems(job.spec, shape, gpus):
        print(f"{args.job} does not fit:\n" + "\n".join(f"  {p}" for p in found), file=sys.stderr)
        return 2
    return 0


def _shape(spec: RLHFJobSpec, config: Path | None, name: str | None) -> ModelShape:
    if config is not None:
        return read_shape(config)
    if name is not None:
        if name not in SHAPES:
            raise FitError(f"--model {name!r} is unknown; known: {', '.join(SHAPES)} (or --model-config)")
        return SHAPES[name]
    shape = spec_shape(spec)
    if shape is None:
        raise FitError(f"model.path={spec.model.path!r} has no config.json here; pass --model-config "
                       f"{spec.model.path}/config.json, or --model with one of {', '.join(SHAPES)}")
    return shape


def table(job: RLHFJob, shape: ModelShape, gpus: dict[str, GPU | None]) -> str:
    """Each role's terms and total per rank, and the verdict against its GPU."""
    spec = job.spec
    t, g = spec.trainer, spec.generator
    lines = [f"{job.metadata.name}: {shape.name}, {shape.params:,} parameters"]
    headers = {"trainer": f"trainer: {_count(t.replicas, 'pod')} x {_count(t.ranks, 'rank')}, FSDP2 over "
                          f"{t.world_size}, micro-batches of {spec.algorithm.max_tokens_per_micro_batch} tokens",
               "generator": f"generator: {_count(g.replicas, 'pod')} x {_count(g.ranks, 'engine rank')}"}
    for role, memory in ROLES.items():
        device = gpus.get(role)
        m = memory(spec, shape, device and device.memory_bytes)
        lines += [headers[role], f"  per rank, on {_device(spec, role, gpus)}:"]
        lines += [f"  {label:<{LABEL_WIDTH}}{gib(b):>10}" for label, b in m.terms]
        lines += [f"  {label + ' (host)':<{LABEL_WIDTH}}{gib(b):>10}" for label, b in m.host]
        fits = device is not None and need(spec, shape, role) <= allowance(spec, role, device.memory_bytes)
        verdict = "" if device is None else "  fits" if fits else "  DOES NOT FIT"
        lines.append(f"  {'total':<{LABEL_WIDTH}}{gib(m.total):>10}{verdict}")
        if role == "generator" and fits:
            lines.append(f"  {_concurrent(spec, shape, device)}")
    return "\n".join(lines)


def _concurrent(spec: RLHFJobSpec, shape: ModelShape, device: GPU) -> str:
    """How many sequences of maxSeq an engine rank's KV cache holds at once, and what bounds it."""
    g = spec.generator
    blocks, room = kv_blocks(spec, shape, device.memory_bytes)
    held, room_for = blocks // sequence_blocks(spec), (room or 0) // sequence_blocks(spec)
    why = (f"maxBatch; memoryUtilization leaves room for {room_for}" if held == g.max_batch
           else f"all that memoryUtilization leaves room for; maxBatch={g.max_batch}")
    return f"KV cache per GPU: {blocks * BLOCK_SIZE:,} tokens, {held} concurrent sequences of maxSeq={g.max_seq} " \
           f"({why})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _device(spec: RLHFJobSpec, role: str, gpus: dict[str, GPU | None]) -> str:
    if role not in gpus:
        return "CPU (no GPU to check against)"
    g = gpus[role]
    if g is None:
        return f"a GPU not known here (pass --gpu, or set the pods' nodeSelector {GPU_PRODUCT_LABEL})"
    kept = (f"memoryUtilization={spec.generator.memory_utilization}" if role == "generator"
            else f"{HEADROOM:.0%} kept free")
    return f"an {g.name}: {gib(allowance(spec, role, g.memory_bytes))} usable of {gib(g.memory_bytes)} ({kept})"
