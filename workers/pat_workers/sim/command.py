"""`pat simulate JOB.yaml` or `pat simulate --preset NAME`: should adaptive TP be on for this job, and what does it
buy? Simulates one rollout batch of one generator pod under every policy; prints a table, writes PNG plots into
--out and, last, one JSON object. Every figure is simulated. A GPU's step costs come from the GPU model fitted to
published measurements (docs/cost-model.md); paper-llama8b also runs on this engine's own H200 step costs when
`make gpu-check` has measured the current engine on an H200 (bench/results/gpu-check-engine-profile.json), and says
so when it has not. --placement both: the iteration separate and colocated at the same GPU count (placement.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pat_operator.api import RLHFJob, load_job
from pat_operator.fit import GPU_PRODUCT_LABEL, GPUS, SHAPES, ModelShape, read_shape, selected_gpu, tiny_shape

from .calibration import fitted
from .hardware import (ENGINE_PROFILE, HOW_TO_MEASURE, Efficiency, OtherEngine, Roofline, SimError, StepCosts,
                       hardware, measured_profile)
from .lengths import deepscaler_lengths, read_lengths, with_cap_share
from .placement import Placement, job_placements, preset_placements, resized, switch_seconds
from .report import Trainer, compare, headline, plots, summary, table
from .simulate import ENGINES, POLICIES, Scenario, adaptive_pod, fixed

ROOT = Path(__file__).resolve().parents[3]  # the repository, where bench/results is (absent from an installed wheel)
VERL_ROLLOUT_TP = 2  # verl's default rollout tensor_model_parallel_size (ppo_trainer.yaml)
# --sweep: the shares of responses at the cap, and the GPU model's least certain terms: its fitted per-layer floor
# scaled, and a per-step CPU time (the fit has none: a graph-captured engine whose scheduling overlaps the GPU step;
# 2.5 ms is an engine whose host work does not overlap). Assumed ranges, not measurements.
SWEEP_CAP_SHARES = (0.0, 0.05, 0.125, 0.25)
SWEEP_FLOOR_SCALES = (0.5, 1.0, 2.0)
SWEEP_STEP_CPU_SECONDS = (0.0, 2.5e-3)


@dataclass(frozen=True)
class Preset:
    """A setup of the paper's evaluation (arXiv 2605.23945): its models on DeepScaleR-like lengths, one 8-GPU pod.
    The rollout batch is DeepScaleR's (train_batch_size 128 prompts x rollout.n 8 samples in its verl/rllm
    scripts); the prompt length and max_batch are assumptions."""
    model: str
    cap: int
    verl_tp: int  # verl's rollout TP for this model size in its examples (the paper's baseline, "original verl")
    engine_profile: str | None = None  # this engine's measured step costs on the preset's GPU (make gpu-check)
    gpu: str = "H200"
    world: int = 8
    prompts: int = 128
    samples: int = 8
    prompt_tokens: int = 256
    max_batch: int = 256  # sequences per TP=1 replica: high, so that the KV capacity is what limits a group


@dataclass(frozen=True)
class Setup:
    """What one `pat simulate` compares: the batch on one pod of its own placement, its costs, the placements at its
    GPU count and the planner that counts."""
    scenario: Scenario
    shape: ModelShape
    costs: StepCosts
    placement: str  # its own: the job's spec.placement (a preset's: separate)
    placements: dict[str, Placement]  # its own, and the other one at the same GPU count where there is one
    prompts: int  # per iteration, each with `samples` responses, split over the generator pods
    samples: int
    planner: str  # the policy the reductions are of: the job's controller
    about: dict[str, Any]  # for the JSON: what was simulated
    verl_tp: int | None  # the fixed layout verl's default is (None: not one of this pod's TP sizes)
    engine_profile: StepCosts | None = None  # the same batch on this engine's measured step costs, beside
    no_engine_profile: str | None = None  # why a preset that names such costs runs without them
    not_placed: dict[str, str] = field(default_factory=dict)  # why a placement has no setup at this GPU count


PRESETS = {"paper-llama8b": Preset("llama-3.1-8b", 8192, verl_tp=2,
                                   engine_profile=ENGINE_PROFILE),
           "paper-qwen14b": Preset("qwen3-14b", 16384, verl_tp=4)}
TRAINER_GPUS = 8  # a preset's trainer: one pod of 8 GPUs of the generator's type
PLACEMENTS = ("colocated", "separate", "both")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pat simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", nargs="?", help="an RLHFJob YAML (its generator, algorithm and adaptiveTP settings)")
    ap.add_argument("--preset", help=f"instead of a job: one of {', '.join(PRESETS)}")
    ap.add_argument("--hardware", help=f"a GPU ({', '.join(GPUS)}; default: the job's {GPU_PRODUCT_LABEL} node "
                                       f"selector, else H200), costed by the fitted GPU model, or a JSON profile: one "
                                       f"the current engine measured (Costs.to_json with its revision, e.g. "
                                       f"bench/sim_vs_real.py --save-profile or make gpu-check's {ENGINE_PROFILE}) "
                                       f"or a GPU's numbers")
    ap.add_argument("--model", help=f"a built-in model shape ({', '.join(SHAPES)}) instead of the job's model")
    ap.add_argument("--model-config", type=Path, help="a Hugging Face config.json for the model's shape")
    ap.add_argument("--lengths", type=Path, help="response lengths: a JSON list, or a `pat run` folder (its "
                                                 "rollouts); default DeepScaleR-like, drawn")
    ap.add_argument("--cap", type=int, help="response length cap (default: the job's maxResponseTokens)")
    ap.add_argument("--cap-share", type=float, help="the share of the drawn responses that run to the cap "
                                                    "(truncated), e.g. 0.125; default none beyond the draw's")
    ap.add_argument("--engine", choices=ENGINES, default="pat",
                    help="the generator pods' engine: pat (regroups in place, KV moved or recomputed) or vllm (one "
                         "engine per group of every layout, all awake, a moved request re-prefilled; fixed layouts "
                         "hold only their own engines)")
    ap.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default 256, or what the job's maxSeq "
                                                      "leaves)")
    ap.add_argument("--seed", type=int, default=0, help="of the drawn lengths (the planner learns from seed + 1)")
    ap.add_argument("--trainer-mfu", type=float, default=0.4, help="assumed MFU of the trainer (default 0.4)")
    ap.add_argument("--no-guard", action="store_true", help="the pod's controller without its guard, which judges "
                                                            "each regroup by its first steps (as the generator's "
                                                            "--no-guard)")
    ap.add_argument("--plan-seconds", type=float, default=0.01,
                    help="a pod's plan() duration, which spaces its plans (default 0.01 s)")
    ap.add_argument("--placement", choices=PLACEMENTS,
                    help="the iteration colocated (every GPU generates, then every GPU trains) or separate (generator "
                         "pods and trainer GPUs), or both at the same GPU count (default: the job's spec.placement; "
                         "a preset's setup is separate)")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of one batch, a grid: shares at the cap (of drawn lengths) x the GPU model's "
                         "per-layer floor at half, once and twice its fit x a per-step CPU time of 0 or 2.5 ms; "
                         "prints each fixed layout's worst loss against the planner across it")
    ap.add_argument("--out", type=Path, help="folder for the plots (default runs/simulate-<time>)")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if (args.job is None) == (args.preset is None):
        raise SimError("give a job YAML or --preset NAME (one of them)")
    for flag in ("cap", "prompt_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SimError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: use 1 or more tokens")
    if args.cap_share is not None and (not 0 <= args.cap_share <= 1 or args.lengths is not None or args.sweep):
        raise SimError(f"--cap-share={args.cap_share}: give a share in [0, 1] of the drawn lengths (not with "
                       f"--lengths, which are given, nor with --sweep, which varies it)")
    if not 0 < args.trainer_mfu <= 1 or args.plan_seconds < 0:
        raise SimError(f"--trainer-mfu={args.trainer_mfu} (use a fraction in (0, 1]) or --plan-seconds="
                       f"{args.plan_seconds} (use >= 0) is out of range")
    calibration = fitted()
    setup = (_from_preset if args.preset is not None else _from_job)(args, calibration.gpu_model)
    chosen = args.placement or setup.placement
    name = setup.placement if chosen == "both" else chosen
    if name not in setup.placements:
        raise SimError(f"--placement {name}: {setup.not_placed[name]}; use --placement {setup.placement}")
    shape, costs = setup.shape, setup.costs
    # The iteration's tokens, the same in every placement: its responses at the mean of the pod's batch (given
    # lengths: the batch of each of its own placement's pods).
    own = setup.scenario
    responses = (len(own.lengths) * setup.placements[setup.placement].pods if args.lengths
                 else setup.prompts * setup.samples)
    tokens = (sum(own.lengths) + own.prompt_tokens * len(own.lengths)) / len(own.lengths) * responses
    gpu = costs.gpu if isinstance(costs, Roofline) else GPUS["H200"]
    placement = setup.placements[name]
    scenario, costs = _placed(setup, placement, args), _placed_costs(costs, placement)
    if args.sweep:
        return _sweep(setup, scenario, costs, args)
    trainer = Trainer(gpu, placement.trainer_gpus, args.trainer_mfu)
    train_seconds, switch = trainer.seconds(shape, tokens), switch_seconds(shape, gpu, placement)

    print(f"model: {shape.name} ({shape.params / 1e6:,.0f}M parameters); costs: {costs.description}")
    if args.engine == "vllm":
        print("engine: vllm (adaptive: one engine per group of every layout, all awake, KV per TP=1 group "
              f"{adaptive_pod(scenario, costs, 'vllm')[1].kv_capacity(1):.0f} tokens; a moved request re-prefilled)")
    lengths = scenario.lengths
    print(f"placement: {placement.describe()} ({placement.gpus} GPUs)")
    print(f"batch: {len(lengths)} responses on one pod of {scenario.world} ranks, lengths mean "
          f"{sum(lengths) / len(lengths):.0f} / max {max(lengths)} (cap {scenario.max_tokens}), prompts "
          f"{scenario.prompt_tokens} tokens; KV capacity per TP=1 group {costs.kv_capacity(1):.0f} tokens")
    switching = f"; switching between the phases {switch:.2f} s (assumed, sim/placement.py)" if switch else ""
    print(f"training: {train_seconds:.2f} s, {trainer.describe()}{switching}\n", flush=True)
    if setup.no_engine_profile:
        print(f"{setup.no_engine_profile}\n", flush=True)
    out = args.out or Path("runs") / f"simulate-{time.strftime('%Y%m%d-%H%M%S')}"
    gpu_modelled = isinstance(costs, Roofline) and costs.efficiency == calibration.gpu_model
    # A job's batch is one pod's share of the iteration, in this placement
    share = ({"rollout_batch": f"{len(lengths) // setup.samples} prompts x {setup.samples} samples per pod"}
             if "job" in setup.about else {})
    about = setup.about | share | {"model": shape.name, "trainer": trainer.describe(), "placement": name,
                           "generator_pods": placement.pods, "gpus": placement.gpus,
                           # of the GPU model's fit (docs/cost-model.md); none for a measured profile
                           "holdout_error": round(calibration.holdout_error, 4) if gpu_modelled else None}
    about |= {"engine": args.engine}
    result = _compare(setup, scenario, costs, train_seconds, switch, about, out, args.engine)
    if chosen == "both":
        result |= _placements(setup, args, result, tokens, gpu)
    if setup.engine_profile is not None and args.engine == "pat":  # measured: this engine's step costs
        print(f"\nthe same batch on this engine's measured step costs: {setup.engine_profile.description}")
        result["engine_profile"] = _compare(setup, scenario, setup.engine_profile, train_seconds, switch, {},
                                            out / "engine-profile")
    elif setup.no_engine_profile:
        result |= {"engine_profile": None, "no_engine_profile": setup.no_engine_profile}
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    print(f"\nplots and summary.json in {out}")
    print(json.dumps(result))
    return 0


def _sweep(setup: Setup, scenario: Scenario, costs: StepCosts, args: argparse.Namespace) -> int:
    """--sweep: every fixed layout and the planner at each point of the grid; prints the grid and, per fixed layout,
    its worst and best ratio to the planner (above 1: the layout is slower), then one JSON object."""
    if not isinstance(costs, Roofline):
        raise SimError("--sweep varies the GPU model's terms: give a GPU (--hardware NAME), not a measured profile")
    shares = SWEEP_CAP_SHARES if args.lengths is None else (None,)  # given lengths: those alone
    points = []
    print(f"sweep: {setup.planner} against every fixed layout, engine {args.engine}, {len(scenario.lengths)} responses "
          f"(cap {scenario.max_tokens}); simulated, not measured\n"
          f"{'cap share':>9s} {'floor':>6s} {'cpu ms':>6s} {'planner s':>9s}  fixed / planner")
    for share in shares:
        batch = scenario if share is None else replace(scenario, **dict(zip(("lengths", "prior"), _at_cap(
            scenario.lengths, scenario.prior, scenario.max_tokens, share, args.seed))))
        for scale in SWEEP_FLOOR_SCALES:
            for cpu in SWEEP_STEP_CPU_SECONDS:
                varied = replace(costs, efficiency=replace(costs.efficiency, step_overhead_s=cpu,
                                                           layer_floor_s=costs.efficiency.layer_floor_s * scale))
                planned = POLICIES[setup.planner](*adaptive_pod(batch, varied, args.engine)).seconds
                ratios = {f"fixed TP{tp}": fixed(batch, varied, tp).seconds / planned for tp in batch.tp_sizes}
                points.append({"cap_share": share, "floor_scale": scale, "step_cpu_seconds": cpu,
                               "planner_seconds": round(planned, 3), "fixed_over_planner": {
                                   k: round(r, 4) for k, r in ratios.items()}})
                print(f"{'given' if share is None else share:>9} {scale:>6g} {cpu * 1e3:>6g} {planned:>9.2f}  " +
                      "  ".join(f"{k.removeprefix('fixed ')} {r:.3f}" for k, r in ratios.items()), flush=True)
    layouts = points[0]["fixed_over_planner"]
    worst = {k: max(p["fixed_over_planner"][k] for p in points) for k in layouts}
    best = {k: min(p["fixed_over_planner"][k] for p in points) for k in layouts}
    print(f"\nacross the {len(points)} points, each fixed layout against {setup.planner} (above 1: slower):")
    for k in layouts:
        print(f"  {k}: worst {worst[k]:.3f}, best {best[k]:.3f}" + ("  <- beats the planner somewhere"
                                                                    if best[k] < 1 else ""))
    planner_vs_best = max(1 / min(p["fixed_over_planner"].values()) for p in points)
    print(f"  the planner at most {planner_vs_best:.3f}x the best fixed layout of its point")
    print(json.dumps({"simulated": True, "sweep": points, "engine": args.engine, "planner": setup.planner,
                      "fixed_worst_over_planner": worst, "fixed_best_over_planner": best,
                      "planner_worst_over_best_fixed": round(planner_vs_best, 4)}))
    return 0


def _placed(setup: Setup, placement: Placement, args: argparse.Namespace) -> Scenario:
    """One pod's batch in `placement`: the setup's own, or the iteration's prompts over its pods (drawn lengths: the
    same draw's first ones; given lengths: as many of them as its share)."""
    own = setup.placements[setup.placement]
    if placement == own:
        return setup.scenario
    if args.lengths is None:
        n = math.ceil(setup.prompts / placement.pods) * setup.samples
        lengths, prior = _lengths(args, n, setup.scenario.max_tokens)
    else:
        n = max(round(len(setup.scenario.lengths) * own.pods / placement.pods), 1)
        lengths = prior = resized(setup.scenario.lengths, n)
    return replace(setup.scenario, lengths=lengths, prior=prior)


def _placed_costs(costs: StepCosts, placement: Placement) -> StepCosts:
    """Colocated, a GPU model's KV cache gets less: the trainer rank keeps its resident states beside the engine (a
    measured profile's cache is the engine's own maxBatch slots, as before)."""
    return replace(costs, reserved_bytes=placement.resident_bytes) if isinstance(costs, Roofline) else costs


def _placements(setup: Setup, args: argparse.Namespace, result: dict[str, Any], tokens: int,
                gpu: Any) -> dict[str, Any]:
    """--placement both: the planner's iteration in each placement at the same GPU count (the other one simulated
    with the planner alone), printed and for the JSON, with colocated_over_separate_iteration."""
    placed: dict[str, Any] = {}
    for name in ("separate", "colocated"):
        placement = setup.placements.get(name)
        if placement is None:
            placed[name] = None
            continue
        if name == result["placement"]:
            generation = result["policies"][setup.planner]["generation_seconds"]
        else:
            scenario, costs = _placed(setup, placement, args), _placed_costs(setup.costs, placement)
            generation = POLICIES[setup.planner](*adaptive_pod(scenario, costs, args.engine)).seconds
        train = Trainer(gpu, placement.trainer_gpus, args.trainer_mfu).seconds(setup.shape, tokens)
        switch = switch_seconds(setup.shape, gpu, placement)
        iteration = (result["policies"][setup.planner]["iteration_seconds"] if name == result["placement"]
                     else generation + train + switch)  # as the table has it
        seconds = {"generation_seconds": generation, "train_seconds": train, "switch_seconds": switch,
                   "iteration_seconds": iteration}
        placed[name] = {"describe": placement.describe(), "gpus": placement.gpus, "generator_pods": placement.pods,
                        "trainer_gpus": placement.trainer_gpus} | {k: round(s, 3) for k, s in seconds.items()}
    both = placed["separate"] is not None and placed["colocated"] is not None
    ratio = (round(placed["colocated"]["iteration_seconds"] / placed["separate"]["iteration_seconds"], 4) if both
             else None)
    gpus = next(p["gpus"] for p in placed.values() if p is not None)
    print(f"\nplacements at {gpus} GPUs, {setup.planner} (simulated, not measured):")
    for name, p in placed.items():
        if p is None:
            print(f"  {name}: none: {setup.not_placed[name]}")
            continue
        switching = f" + switching {p['switch_seconds']:.2f} s" if p["switch_seconds"] else ""
        print(f"  {p['describe']}: generation {p['generation_seconds']:.2f} s + training {p['train_seconds']:.2f} s "
              f"on {p['trainer_gpus']} GPUs{switching} = {p['iteration_seconds']:.2f} s per iteration")
    if ratio is not None:
        print(f"  colocated / separate iteration: {ratio:.3f}")
    not_placed = {"no_placement": setup.not_placed} if setup.not_placed else {}
    return {"placements": placed, "colocated_over_separate_iteration": ratio} | not_placed


def _compare(setup: Setup, scenario: Scenario, costs: StepCosts, train_seconds: float, switch_seconds: float,
             about: dict[str, Any], out: Path, engine: str = "pat") -> dict[str, Any]:
    """Every policy on `costs` with pods of `engine`: prints the table and the headline, writes the plots into
    `out`; the summary."""
    started = time.perf_counter()
    results = compare(scenario, costs, engine)
    rest = train_seconds + switch_seconds  # of the iteration, beside generation
    print(table(results, rest))
    about = about | {"hardware": costs.description, "simulation_seconds": round(time.perf_counter() - started, 2)}
    result = summary(results, scenario, setup.planner, rest, about, setup.verl_tp)
    result |= {"train_seconds": round(train_seconds, 3), "switch_seconds": round(switch_seconds, 3)}
    out.mkdir(parents=True, exist_ok=True)
    result["plots"] = plots(results, len(scenario.lengths), rest, out)
    print(f"simulated, not measured: {headline(result)}")
    return result


def _from_preset(args: argparse.Namespace, gpu_model: Efficiency) -> Setup:
    preset = PRESETS.get(args.preset)
    if preset is None:
        raise SimError(f"--preset {args.preset!r} is unknown; known: {', '.join(PRESETS)}")
    given_shape = _shape(args)
    shape = given_shape or SHAPES[preset.model]
    costs = hardware(args.hardware or preset.gpu, shape, gpu_model)
    # Measured for the preset's model on its GPU: beside the GPU model unless either is changed
    engine_profile, no_engine_profile = (_engine_profile(preset, shape) if preset.engine_profile and
                                         args.hardware is None and given_shape is None else (None, None))
    cap = args.cap or preset.cap
    n = preset.prompts * preset.samples
    lengths, prior = _lengths(args, n, cap)
    scenario = Scenario(lengths, args.prompt_tokens or preset.prompt_tokens, cap, preset.world, preset.max_batch,
                        tuple(shape.tp_sizes(preset.world)), prior, guard=not args.no_guard,
                        plan_seconds=args.plan_seconds)
    about = {"preset": args.preset, "rollout_batch": f"{preset.prompts} prompts x {preset.samples} samples"}
    return Setup(scenario, shape, costs, "separate", preset_placements(preset.world, TRAINER_GPUS, shape),
                 preset.prompts, preset.samples, "planner (pod)", about, preset.verl_tp, engine_profile,
                 no_engine_profile)


def _engine_profile(preset: Preset, shape: ModelShape) -> tuple[StepCosts | None, str | None]:
    """The preset's measured engine profile, or why there is none: absent, of another engine revision (OtherEngine),
    or of another GPU or model."""
    path = ROOT / preset.engine_profile
    name = f"{preset.engine_profile}"
    if not path.is_file():
        return None, (f"no profile of the current engine on an {preset.gpu}: {name} is absent; `make gpu-check` on an "
                      f"{preset.gpu} writes it (docs/benchmarks.md). Simulated on the GPU model alone.")
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        if (d.get("gpu"), d.get("model")) != (preset.gpu, preset.model):
            return None, (f"{name} measured {d.get('model')} on {d.get('gpu')}, not this preset's {preset.model} on "
                          f"{preset.gpu}: not used (--hardware {name} simulates on it). Simulated on the GPU model "
                          f"alone.")
        return measured_profile(d, shape, name), None
    except OtherEngine as e:
        return None, f"{e}. Simulated on the GPU model alone."
    except ValueError as e:  # SimError included
        raise SimError(f"{name}: {e}; {HOW_TO_MEASURE} again") from None


def _from_job(args: argparse.Namespace, gpu_model: Efficiency) -> Setup:
    job: RLHFJob = load_job(args.job)
    spec, gen, alg = job.spec, job.spec.generator, job.spec.algorithm
    shape = _shape(args)
    if shape is None and spec.model.tiny is not None:
        shape = tiny_shape(spec.model.tiny.preset, spec.model.tiny.family)
    elif shape is None:
        raise SimError(f"model.path={spec.model.path!r} is not read by the simulator; pass --model-config "
                       f"{spec.model.path}/config.json, or --model with one of {', '.join(SHAPES)}")
    costs = hardware(args.hardware or _gpu_of(gen.node_selector), shape, gpu_model)
    cap = args.cap or alg.max_response_tokens
    prompt_tokens = args.prompt_tokens or min(256, gen.max_seq - alg.max_response_tokens)
    # The trainer sends all G samples of a prompt to one pod, prompts round-robin: the first pod gets the most.
    n = math.ceil(alg.prompts_per_iteration / gen.replicas) * alg.samples_per_prompt
    tp_sizes = [t for t in gen.tp_sizes if t in shape.tp_sizes(gen.ranks)]
    adaptive = gen.adaptive_tp
    lengths, prior = _lengths(args, n, cap)
    scenario = Scenario(lengths, prompt_tokens, cap, gen.ranks, gen.max_batch, tuple(tp_sizes), prior,
                        margin=adaptive.min_gain, guard=not args.no_guard,
                        cooldown_steps=adaptive.cooldown_steps, query_interval=adaptive.prometheus.query_interval,
                        cooldown_seconds=adaptive.cooldown_seconds, plan_seconds=args.plan_seconds)
    about = {"job": job.metadata.name, "adaptive_tp_enabled": gen.adaptive}
    verl_tp = VERL_ROLLOUT_TP if VERL_ROLLOUT_TP in tp_sizes else None
    placements, not_placed = job_placements(spec, shape)
    return Setup(scenario, shape, costs, spec.placement, placements, alg.prompts_per_iteration,
                 alg.samples_per_prompt, f"planner ({adaptive.controller})", about, verl_tp, not_placed=not_placed)


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
        lengths, prior = (tuple(deepscaler_lengths(n, cap, seed)) for seed in (args.seed, args.seed + 1))
        return (lengths, prior) if args.cap_share is None else _at_cap(lengths, prior, cap, args.cap_share, args.seed)
    lengths = tuple(min(length, cap) for length in read_lengths(args.lengths))
    return lengths, lengths


def _at_cap(lengths: Sequence[int], prior: Sequence[int], cap: int, share: float, seed: int
            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The batch's drawn lengths and the prior's with `share` of each at the cap (the prior with the next seed, as
    it was drawn)."""
    return (tuple(with_cap_share(list(lengths), cap, share, seed)),
            tuple(with_cap_share(list(prior), cap, share, seed + 1)))
