"""`pat simulate JOB.yaml` or `pat simulate --preset NAME`: should adaptive TP be on for this job, and what does it
buy? Simulates one rollout batch of one generator pod under every policy; prints a table, writes PNG plots into
--out and, last, one JSON object. Every figure is simulated.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pat_operator.api import RLHFJob, load_job
from pat_operator.fit import GPU_PRODUCT_LABEL, GPUS, SHAPES, ModelShape, read_shape, selected_gpu, tiny_shape

from .hardware import Roofline, SimError, StepCosts, hardware
from .lengths import deepscaler_lengths, read_lengths
from .report import Trainer, compare, plots, summary, table
from .simulate import Scenario


@dataclass(frozen=True)
class Preset:
    """A setup of the paper's evaluation (arXiv 2605.23945): its models on DeepScaleR-like lengths, one 8-GPU pod.
    The rollout batch is DeepScaleR's (train_batch_size 128 prompts x rollout.n 8 samples in its verl/rllm
    scripts); the prompt length and max_batch are assumptions."""
    model: str
    cap: int
    gpu: str = "H200"
    world: int = 8
    prompts: int = 128
    samples: int = 8
    prompt_tokens: int = 256
    max_batch: int = 256  # sequences per TP=1 replica: high, so that the KV capacity is what limits a group


@dataclass(frozen=True)
class Setup:
    """What one `pat simulate` compares: the batch on one pod, its costs, the trainer and the planner that counts."""
    scenario: Scenario
    shape: ModelShape
    costs: StepCosts
    trainer_gpus: int
    planner: str  # the policy the reductions are of: the job's controller
    about: dict[str, Any]  # for the JSON: what was simulated


PRESETS = {"paper-llama8b": Preset("llama-3.1-8b", 8192), "paper-qwen14b": Preset("qwen3-14b", 16384)}
TRAINER_GPUS = 8  # a preset's trainer: one pod of 8 GPUs of the generator's type


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pat simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", nargs="?", help="an RLHFJob YAML (its generator, algorithm and adaptiveTP settings)")
    ap.add_argument("--preset", help=f"instead of a job: one of {', '.join(PRESETS)}")
    ap.add_argument("--hardware", help=f"a GPU ({', '.join(GPUS)}; default: the job's {GPU_PRODUCT_LABEL} node "
                                       f"selector, else H200) or a JSON profile: one the engine "
                                       f"measured (Costs.to_json, e.g. bench/sim_vs_real.py --save-profile) or a GPU's "
                                       f"numbers")
    ap.add_argument("--model", help=f"a built-in model shape ({', '.join(SHAPES)}) instead of the job's model")
    ap.add_argument("--model-config", type=Path, help="a Hugging Face config.json for the model's shape")
    ap.add_argument("--lengths", type=Path, help="response lengths: a JSON list, or a `pat run` folder (its "
                                                 "rollouts); default DeepScaleR-like, drawn")
    ap.add_argument("--cap", type=int, help="response length cap (default: the job's maxResponseTokens)")
    ap.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default 256, or what the job's maxSeq "
                                                      "leaves)")
    ap.add_argument("--seed", type=int, default=0, help="of the drawn lengths (the planner learns from seed + 1)")
    ap.add_argument("--trainer-mfu", type=float, default=0.4, help="assumed MFU of the trainer (default 0.4)")
    ap.add_argument("--plan-seconds", type=float, default=0.01,
                    help="a pod's plan() duration, which spaces its plans (default 0.01 s)")
    ap.add_argument("--out", type=Path, help="folder for the plots (default runs/simulate-<time>)")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if (args.job is None) == (args.preset is None):
        raise SimError("give a job YAML or --preset NAME (one of them)")
    for flag in ("cap", "prompt_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SimError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: use 1 or more tokens")
    if not 0 < args.trainer_mfu <= 1 or args.plan_seconds < 0:
        raise SimError(f"--trainer-mfu={args.trainer_mfu} (use a fraction in (0, 1]) or --plan-seconds="
                       f"{args.plan_seconds} (use >= 0) is out of range")
    setup = _from_preset(args) if args.preset is not None else _from_job(args)
    scenario, shape, costs, controller = setup.scenario, setup.shape, setup.costs, setup.planner
    trainer_gpu = costs.gpu if isinstance(costs, Roofline) else GPUS["H200"]
    trainer = Trainer(trainer_gpu, setup.trainer_gpus, args.trainer_mfu)
    tokens = sum(scenario.lengths) + scenario.prompt_tokens * len(scenario.lengths)
    train_seconds = trainer.seconds(shape, tokens * setup.about["generator_pods"])

    print(f"model: {shape.name} ({shape.params / 1e6:,.0f}M parameters); costs: {costs.description}")
    lengths = scenario.lengths
    print(f"batch: {len(lengths)} responses on one pod of {scenario.world} ranks, lengths mean "
          f"{sum(lengths) / len(lengths):.0f} / max {max(lengths)} (cap {scenario.max_tokens}), prompts "
          f"{scenario.prompt_tokens} tokens; KV capacity per TP=1 group {costs.kv_capacity(1):.0f} tokens")
    print(f"training: {train_seconds:.2f} s, {trainer.describe()}\n", flush=True)
    started = time.perf_counter()
    results = compare(scenario, costs)
    print(table(results, train_seconds))
    out = args.out or Path("runs") / f"simulate-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    about = setup.about | {"hardware": costs.description, "model": shape.name, "trainer": trainer.describe(),
                           "simulation_seconds": round(time.perf_counter() - started, 2)}
    result = summary(results, scenario, controller, train_seconds, about)
    result["plots"] = plots(results, len(scenario.lengths), train_seconds, out)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    print(f"\nsimulated, not measured: the planner ({controller}) vs the best fixed layout ({result['best_fixed']}): "
          f"generation {result['generation_reduction']:+.1%}, iteration {result['iteration_reduction']:+.1%}; "
          f"planner / oracle {result['planner_over_oracle']:.3f}; plots in {out}")
    print(json.dumps(result))
    return 0


def _from_preset(args: argparse.Namespace) -> Setup:
    preset = PRESETS.get(args.preset)
    if preset is None:
        raise SimError(f"--preset {args.preset!r} is unknown; known: {', '.join(PRESETS)}")
    shape = _shape(args) or SHAPES[preset.model]
    costs = hardware(args.hardware or preset.gpu, shape)
    cap = args.cap or preset.cap
    n = preset.prompts * preset.samples
    lengths, prior = _lengths(args, n, cap)
    scenario = Scenario(lengths, args.prompt_tokens or preset.prompt_tokens, cap, preset.world, preset.max_batch,
                        tuple(shape.tp_sizes(preset.world)), prior, plan_seconds=args.plan_seconds)
    about = {"preset": args.preset, "rollout_batch": f"{preset.prompts} prompts x {preset.samples} samples",
             "generator_pods": 1}
    return Setup(scenario, shape, costs, TRAINER_GPUS, "planner (pod)", about)


def _from_job(args: argparse.Namespace) -> Setup:
    job: RLHFJob = load_job(args.job)
    spec, gen, alg = job.spec, job.spec.generator, job.spec.algorithm
    shape = _shape(args)
    if shape is None and spec.model.tiny is not None:
        shape = tiny_shape(spec.model.tiny.preset, spec.model.tiny.family)
    elif shape is None:
        raise SimError(f"model.path={spec.model.path!r} is not read by the simulator; pass --model-config "
                       f"{spec.model.path}/config.json, or --model with one of {', '.join(SHAPES)}")
    costs = hardware(args.hardware or _gpu_of(gen.node_selector), shape)
    cap = args.cap or alg.max_response_tokens
    prompt_tokens = args.prompt_tokens or min(256, gen.max_seq - alg.max_response_tokens)
    # The trainer sends all G samples of a prompt to one pod, prompts round-robin: the first pod gets the most.
    n = math.ceil(alg.prompts_per_iteration / gen.replicas) * alg.samples_per_prompt
    tp_sizes = [t for t in gen.tp_sizes if t in shape.tp_sizes(gen.ranks)]
    adaptive = gen.adaptive_tp
    lengths, prior = _lengths(args, n, cap)
    scenario = Scenario(lengths, prompt_tokens, cap, gen.ranks, gen.max_batch, tuple(tp_sizes), prior,
                        margin=adaptive.min_gain,
                        cooldown_steps=adaptive.cooldown_steps, query_interval=adaptive.prometheus.query_interval,
                        cooldown_seconds=adaptive.cooldown_seconds, plan_seconds=args.plan_seconds)
    about = {"job": job.metadata.name, "rollout_batch": f"{n // alg.samples_per_prompt} prompts x "
             f"{alg.samples_per_prompt} samples per pod", "generator_pods": gen.replicas,
             "adaptive_tp_enabled": gen.adaptive}
    trainer_gpus = max(spec.trainer.replicas * spec.trainer.gpus_per_pod, 1)
    return Setup(scenario, shape, costs, trainer_gpus, f"planner ({adaptive.controller})", about)


def _gpu_of(node_selector: dict[str, str]) -> str:
    """The built-in GPU a job's generator nodes are selected for (GPU feature discovery's product label), H200
    without the label; FitError for a label the table does not know."""
    selected = selected_gpu(node_selector)
    return "H200" if selected is None else selected.name


def _shape(args: argparse.Namespace) -> ModelShape | None:
    """The shape --model-config or --model name; None without either."""
    if args.model_config is not None:
        return read_shape(args.model_config)
    if args.model is not None and args.model not in SHAPES:
        raise SimError(f"--model {args.model!r} is unknown; known: {', '.join(SHAPES)} (or --model-config)")
    return SHAPES[args.model] if args.model else None


def _lengths(args: argparse.Namespace, n: int, cap: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The batch's response lengths, and the earlier ones the planner learns from: a second draw, or for given
    lengths the same ones (RLHF length distributions drift slowly)."""
    if args.lengths is None:
        return tuple(deepscaler_lengths(n, cap, args.seed)), tuple(deepscaler_lengths(n, cap, args.seed + 1))
    lengths = tuple(min(length, cap) for length in read_lengths(args.lengths))
    return lengths, lengths
