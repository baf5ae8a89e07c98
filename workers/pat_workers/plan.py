"""`pat plan JOB.yaml`: will the job fit? The memory of one trainer rank and one generator engine rank, term by term
(pat_operator.fit's estimate), against the GPUs the pods select, and how many sequences of maxSeq an engine rank's
KV cache holds there; exits 2 naming the field to change when a role does not fit. Colocated, one GPU's both ranks
through its phases (resident, generating, training, handing the weights over), and whether the job would fit
separate; separate, whether it would fit colocated on the same GPUs. Torch-free, like the estimate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pat_operator.api import RLHFJob, RLHFJobSpec, load_job
from pat_operator.fit import (BLOCK_SIZE, GPU, GPU_PRODUCT_LABEL, GPUS, HEADROOM, ROLES, SHAPES, FitError, ModelShape,
                              Budget, allowance, budgets, colocated_equivalent, colocated_memory, fits, gib, kv_blocks,
                              problems, read_shape, role_gpus, sequence_blocks, tiny_shape, utilization)

LABEL_WIDTH = 46
COLOCATED_WIDTH = 52  # its engine terms' labels are longer


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
    """Each role's terms and total per rank, and the verdict against its GPU (colocated: _colocated_table)."""
    spec = job.spec
    if spec.placement == "colocated":
        return _colocated_table(job, shape, gpus)
    t, g = spec.trainer, spec.generator
    lines = [f"{job.metadata.name}: {shape.name}, {shape.params:,} parameters"]
    headers = {"trainer": f"trainer: {_count(t.replicas, 'pod')} x {_count(t.ranks, 'rank')}, FSDP2 over "
                          f"{t.world_size}, micro-batches of {spec.algorithm.max_tokens_per_micro_batch} tokens",
               "generator": f"generator: {_count(g.replicas, 'pod')} x {_count(g.ranks, 'engine rank')}"}
    for role, memory in ROLES.items():
        device = gpus.get(role)
        m = memory(spec, shape, device and device.memory_bytes)
        lines += [headers[role], f"  per rank, on {_device(spec, role, gpus)}:"]
        lines += _terms(m.terms) + _terms(m.host, " (host)")
        ok = device is not None and fits(spec, shape, role, device.memory_bytes)
        verdict = "" if device is None else "  fits" if ok else "  DOES NOT FIT"
        lines.append(f"  {'total':<{LABEL_WIDTH}}{gib(m.total):>10}{verdict}")
        if role == "generator" and ok:
            lines.append(f"  {_concurrent(spec, shape, device)}")
    if (colocated := _colocated_instead(spec, shape, gpus)) is not None:
        lines.append(colocated)
    return "\n".join(lines)


def _terms(terms: tuple[tuple[str, float], ...], suffix: str = "", indent: str = "  ",
           width: int = LABEL_WIDTH) -> list[str]:
    return [f"{indent}{label + suffix:<{width + 2 - len(indent)}}{gib(b):>10}" for label, b in terms]


def _colocated_table(job: RLHFJob, shape: ModelShape, gpus: dict[str, GPU | None]) -> str:
    """One GPU of a colocated pod: what stays resident, what each phase adds, each phase's total against its limit,
    and which placement fits."""
    spec, g = job.spec, job.spec.generator
    device = gpus.get("colocated")
    memory = device and device.memory_bytes
    phases = colocated_memory(spec, shape, memory)
    unit = "GPU" if g.gpus_per_pod else "rank"
    limits = {b.name: b for b in budgets(spec, shape, "colocated", memory)} if memory else {}
    lines = [f"{job.metadata.name}: {shape.name}, {shape.params:,} parameters",
             f"colocated: {_count(g.replicas, 'pod')} x {_count(g.ranks, unit)}, each {unit} a trainer rank (FSDP2 "
             f"over {spec.trainer.world_size}, micro-batches of {spec.algorithm.max_tokens_per_micro_batch} tokens) "
             f"and an engine rank",
             f"  per {unit}, on {_device(spec, 'colocated', gpus)}:",
             "  resident (every phase):", *_terms(phases.resident, indent="    ", width=COLOCATED_WIDTH),
             *_terms(phases.host, " (host)", indent="    ", width=COLOCATED_WIDTH),
             "  generating, beside it:", *_terms(phases.generate, indent="    ", width=COLOCATED_WIDTH),
             "  training, beside it (the engine asleep: weights and KV cache released):",
             *_terms(phases.train, indent="    ", width=COLOCATED_WIDTH),
             "  handing the weights over, beside it (the gradients freed):",
             *_terms(phases.handover, indent="    ", width=COLOCATED_WIDTH),
             f"  {'resident':<{COLOCATED_WIDTH}}{gib(phases.resident_bytes):>10}"]
    for name, total in (("generate", phases.generate_bytes), ("train", phases.train_bytes),
                        ("hand-over", phases.handover_bytes)):
        limit = limits.get(name)
        verdict = "" if limit is None else f" of {gib(limit.allowed)}  {'fits' if limit.fits else 'DOES NOT FIT'}"
        lines.append(f"  {name + ': resident + its working set':<{COLOCATED_WIDTH}}{gib(total):>10}{verdict}")
    if memory is None:
        return "\n".join(lines)
    if limits["generate"].fits:
        lines.append(f"  {_concurrent(spec, shape, device)}")
    lines.append(_placements(spec, shape, device, [b for b in limits.values() if not b.fits]))
    return "\n".join(lines)


def _placements(spec: RLHFJobSpec, shape: ModelShape, device: GPU, over: list) -> str:
    """Colocated's verdict, and when it does not fit whether the same job would separate: the trainer on its own
    pods of the same GPUs (FSDP2 over as many), the engines on theirs."""
    if not over:
        return "colocated fits"
    separate = spec.model_copy(update={"placement": "separate"})
    roles = [budgets(separate, shape, role, device.memory_bytes)[0] for role in ("trainer", "generator")]
    would = "would" if all(b.fits for b in roles) else "would not either"
    return (f"colocated does not fit: {_limits(over)}; separate (the trainer on {spec.trainer.world_size} GPUs of its "
            f"own) {would}: {_limits(roles)}")


def _limits(limits: list[Budget]) -> str:
    return ", ".join(f"{b.name} {gib(b.need)} of {gib(b.allowed)}" for b in limits)


def _colocated_instead(spec: RLHFJobSpec, shape: ModelShape, gpus: dict[str, GPU | None]) -> str | None:
    """Whether a separate job would fit colocated on its GPUs (fit.colocated_equivalent), and how many sequences an
    engine rank's KV cache would hold there; None where that is not known: CPU pods, different or unknown GPUs,
    GPUs that do not make whole pods."""
    device = gpus.get("generator")
    colocated = colocated_equivalent(spec)
    if device is None or gpus.get("trainer") != device or colocated is None:
        return None
    limits = budgets(colocated, shape, "colocated", device.memory_bytes)
    g = colocated.generator
    where = f"colocated on the same {g.replicas * g.gpus_per_pod} GPUs ({_count(g.replicas, 'pod')} x {g.gpus_per_pod})"
    if not all(b.fits for b in limits):
        return f"{where} would not fit: {_limits([b for b in limits if not b.fits])}"
    held = kv_blocks(colocated, shape, device.memory_bytes)[0] // sequence_blocks(colocated)
    return (f"{where} would fit: {held} sequences of maxSeq per GPU's KV cache while generating; "
            f"{_limits(limits[1:])}")


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
    if role == "colocated":
        return (f"an {g.name}: {gib(allowance(spec, 'trainer', g.memory_bytes))} usable of {gib(g.memory_bytes)} "
                f"({HEADROOM:.0%} kept free; generating: {gib(utilization(spec) * g.memory_bytes)}, "
                f"memoryUtilization={utilization(spec)})")
    kept = (f"memoryUtilization={spec.generator.memory_utilization}" if role == "generator"
            else f"{HEADROOM:.0%} kept free")
    return f"an {g.name}: {gib(allowance(spec, role, g.memory_bytes))} usable of {gib(g.memory_bytes)} ({kept})"
