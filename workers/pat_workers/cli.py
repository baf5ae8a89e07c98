"""The `pat` command.

  pat run JOB.yaml [--run-dir DIR] [--baseline]   an RLHFJob as local processes (what `make run` calls)
  pat validate JOB.yaml                           checks a job spec and its objects; prints each bad field
  pat plan JOB.yaml [--model-config F] [--gpu G]  memory per GPU of trainer and generator ranks: will it fit?
  pat manifests JOB.yaml [--namespace NS]         every object the operator would create for the job (YAML)
  pat data JOB.yaml [--show N] [--model DIR]      the first N prompts as the generators receive them (docs/data.md)
  pat prepare --job JOB.yaml --model DIR          builds the job's tiny model into DIR (a pod's init container)
  pat simulate JOB.yaml | --preset NAME           adaptive TP vs fixed layouts under a GPU cost model (simulated)
  pat reward JOB.yaml | --function F ...         one response's score as the trainer gives it (--answer, --response)
  pat generator ...                               one generator pod (coordinator + engine ranks)
  pat trainer ... -- ...                          one trainer pod (its ranks through torch.distributed.run)
  pat colocated ...                               one pod of a colocated job: its generator and trainer ranks
  pat --version
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pat_operator import version
from pat_operator.api import JobSpecError, RLHFJobSpec, load_job


def _run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pat run", description="run an RLHFJob locally as processes")
    ap.add_argument("job", help="RLHFJob YAML, e.g. examples/local.yaml")
    ap.add_argument("--run-dir", help="run folder (default runs/<name>-<time>); an existing one resumes")
    ap.add_argument("--baseline", action="store_true",
                    help="also run the same job at fixed layouts, adaptive TP off: fixed TP=1 and the largest TP the "
                         "model and the pod's ranks allow; the runs take turns an iteration at a time (the order "
                         "rotated every iteration); compare generation time and tokens against fixed TP=1 and the "
                         "best (fastest) fixed layout")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    job = load_job(args.job)
    from .launcher import LaunchError, run  # torch and friends only once the spec is valid

    run_dir = Path(args.run_dir or f"runs/{job.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        summary = run(job, run_dir, baseline=args.baseline, progress=not args.no_progress)
    except LaunchError as e:
        print(f"pat run: {e}", file=sys.stderr)
        return 1
    print(summary)
    return 0


def _validate(argv: list[str]) -> int:
    """Every document of the file must be an RLHFJob that the operator accepts (the same api.parse_job), fit its
    GPUs wherever the model's shape and the GPUs are known here (pat plan's check), and make only objects that a
    Kubernetes API server accepts (manifests.kubernetes_errors)."""
    import yaml

    from pat_operator.api import API_VERSION, KIND, parse_job, require_unprivileged
    from pat_operator.fit import FitError, require_fit

    from .manifests import KUBERNETES_VERSION, kubernetes_errors, kubernetes_version_error
    from .plan import spec_shape

    ap = argparse.ArgumentParser(prog="pat validate", description="check RLHFJob manifests as the operator does")
    ap.add_argument("file", help="YAML with one or more RLHFJob documents")
    ap.add_argument("--kubernetes-version", default=KUBERNETES_VERSION,
                    help=f"the API server whose schemas the job's objects must pass (default {KUBERNETES_VERSION})")
    ap.add_argument("--allow-privileged-pods", action="store_true",
                    help="accept hostPath volumes in the job's own pod fields, as the operator does with "
                         "--allow-privileged-pods (the chart value jobPods.allowPrivileged)")
    args = ap.parse_args(argv)
    if error := kubernetes_version_error(args.kubernetes_version):
        ap.error(f"--kubernetes-version {args.kubernetes_version}: {error}")
    path = args.file
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except OSError as e:
        raise JobSpecError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise JobSpecError(f"{path} is not valid YAML: {e}") from None
    if not docs:
        raise JobSpecError(f"{path} holds no document; expected an RLHFJob (apiVersion: {API_VERSION}, kind: {KIND})")
    invalid = 0
    for i, doc in enumerate(docs, 1):
        source = path if len(docs) == 1 else f"{path} (document {i})"
        kind = doc.get("kind") if isinstance(doc, dict) else None
        try:
            if kind != KIND:
                raise JobSpecError(f"{source} is invalid:\n  kind: {kind!r} is not {KIND}; pat validate checks "
                                   f"RLHFJob documents only (apiVersion: {API_VERSION}, kind: {KIND})")
            job = parse_job(doc, source)
            if not args.allow_privileged_pods:
                require_unprivileged(job.spec, source)
            require_fit(job.spec, source, spec_shape(job.spec))
            if errors := kubernetes_errors(job, args.kubernetes_version):
                raise JobSpecError(f"{source} is invalid: Kubernetes would refuse its objects:\n  "
                                   + "\n  ".join(errors))
        except (JobSpecError, FitError) as e:
            print(e, file=sys.stderr)
            invalid += 1
            continue
        print(f"{job.kind} {job.metadata.name}: valid")
    return 2 if invalid else 0


def _manifests(argv: list[str]) -> int:
    """The operator's own builders, at the gang's first attempt; the job's uid and token are placeholders (the API
    server and the operator's key make them)."""
    import yaml

    from .manifests import objects

    ap = argparse.ArgumentParser(prog="pat manifests", description="print every object the operator would create "
                                 "for an RLHFJob (like helm template): the ConfigMap, Secret, Service, PodGroup "
                                 "and the pods of its first attempt")
    ap.add_argument("job", help="RLHFJob YAML")
    ap.add_argument("--namespace", help="default: the job's metadata.namespace, else 'default'")
    args = ap.parse_args(argv)
    job = load_job(args.job)
    namespace = args.namespace or job.metadata.namespace or "default"
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": namespace})})
    print(yaml.safe_dump_all(objects(job), sort_keys=False), end="")
    return 0


def _prepare(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pat prepare", description="build an RLHFJob's tiny model (model.tiny) into "
                                 "a directory; deterministic, so every pod of the job builds the same one")
    ap.add_argument("--job", required=True)
    ap.add_argument("--model", required=True, help="the model directory to create")
    ap.add_argument("--data-dir", default=".", help="dataset paths are relative to this")
    args = ap.parse_args(argv)
    job = load_job(args.job)
    if job.spec.model.tiny is None:
        print(f"pat prepare: {job.metadata.name} uses model.path={job.spec.model.path}; nothing to build")
        return 0
    from .launcher import prepare_model
    print(f"pat prepare: {prepare_model(job.spec, Path(args.model), Path(args.data_dir))}")
    return 0


def _data(argv: list[str]) -> int:
    """The trainer's own rendering (trainer/prompts.py) of the job's first prompts: text, token count, answer."""
    ap = argparse.ArgumentParser(prog="pat data", description="print an RLHFJob's first prompts exactly as the "
                                 "generators receive them: the text (chat template applied), its token count and "
                                 "the reference answer")
    ap.add_argument("job", help="RLHFJob YAML")
    ap.add_argument("--show", type=int, default=3, metavar="N", help="how many prompts, from the first (default 3)")
    ap.add_argument("--model", help="the directory with the tokenizer (default: spec.tokenizer.path, else "
                    "spec.model.path; model.tiny: built as pat run builds it)")
    ap.add_argument("--data-dir", default=".", help="a relative dataset.path is relative to this (default: the "
                    "current directory, as for pat prepare)")
    args = ap.parse_args(argv)
    job = load_job(args.job)
    from .trainer.data import load_problems
    from .trainer.prompts import load_prompts

    try:
        problems = load_problems(job.spec.dataset, base_dir=args.data_dir)
        with _tokenizer_dir(job.spec, args.model, Path(args.data_dir)) as tokenizer_dir:
            prompts = load_prompts(problems, tokenizer_dir, job.spec.dataset)
    except ValueError as e:
        print(f"pat data: {e}", file=sys.stderr)
        return 2
    for index in range(min(args.show, len(prompts))):
        rendered = prompts.render(index)
        print(f"--- prompt {index + 1} of {len(prompts)}: {len(rendered.token_ids)} tokens, answer "
              f"{problems[index].answer!r}")
        print(rendered.text)
    return 0


@contextmanager
def _tokenizer_dir(spec: RLHFJobSpec, model: str | None, data_dir: Path) -> Iterator[Path]:
    """The trainer's tokenizer directory: --model, else the job's; a tiny model is built into a temporary one."""
    if named := model or spec.tokenizer.path or spec.model.path:
        yield Path(named)
        return
    from .launcher import prepare_model

    with tempfile.TemporaryDirectory() as tmp:
        yield prepare_model(spec, Path(tmp) / "model", data_dir)


def _plan(argv: list[str]) -> int:
    from .plan import main as plan
    return plan(argv)


def _simulate(argv: list[str]) -> int:
    from pat_operator.fit import FitError

    from .sim.command import main as simulate
    from .sim.hardware import SimError

    try:
        return simulate(argv)
    except (SimError, FitError) as e:
        print(f"pat simulate: {e}", file=sys.stderr)
        return 2


def _reward(argv: list[str]) -> int:
    """The trainer's own load_reward and Grader on one response, so that a reward can be checked before a run."""
    from pydantic import ValidationError

    from pat_operator.api import Reward

    from .trainer.rewards import load_reward

    ap = argparse.ArgumentParser(prog="pat reward", description="score one response as the trainer would: the "
                                 "job's spec.reward or --function's; the score is the last line printed")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("job", nargs="?", help="RLHFJob YAML whose spec.reward scores")
    source.add_argument("--function", help="math or a plugin as module:function, its module found on PYTHONPATH")
    ap.add_argument("--answer", required=True, help="the reference answer (a dataset's answer field)")
    ap.add_argument("--response", required=True, help="the response text")
    ap.add_argument("--format-score", type=float, help="reward.formatScore (default: the job's, else 0)")
    args = ap.parse_args(argv)
    fields = load_job(args.job).spec.reward.model_dump() if args.job else {"function": args.function}
    if args.format_score is not None:
        fields["format_score"] = args.format_score
    try:
        spec = Reward.model_validate(fields)
    except ValidationError as e:  # only --format-score has a field error here; --function's names itself
        ap.error("; ".join(("--format-score: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
                           for err in e.errors()))
    if (cwd := str(Path.cwd())) not in sys.path:  # the trainer runs as `python -m`, the current directory on its path
        sys.path.insert(0, cwd)
    try:
        grader = load_reward(spec)
    except ValueError as e:
        print(f"pat reward: {e}", file=sys.stderr)
        return 2
    print(grader(args.response, args.answer))
    return 1 if grader.failures else 0  # the function raised or timed out: logged above the score


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--version"]:
        print(f"pat {version()}")
        return 0
    commands = {"run": _run, "validate": _validate, "plan": _plan, "manifests": _manifests, "prepare": _prepare,
                "simulate": _simulate, "data": _data, "reward": _reward}
    if not argv or argv[0] not in (*commands, "generator", "trainer", "colocated"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "generator":
            from .generator.__main__ import main as generator
            return generator(rest) or 0
        if command == "trainer":
            from .trainer.launch import main as trainer
            return trainer(rest) or 0
        if command == "colocated":
            from .colocated import main as colocated
            return colocated(rest)
        return commands[command](rest)
    except JobSpecError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
