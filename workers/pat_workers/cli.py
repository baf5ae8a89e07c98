"""The `pat` command.

  pat run JOB.yaml [--run-dir DIR] [--baseline]   an RLHFJob as local processes (what `make run` calls)
  pat validate JOB.yaml                           checks a job spec; prints each bad field and the fix
  pat generator ...                               one generator pod (coordinator + engine ranks)
  pat trainer ...                                 one trainer rank
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pat_operator.api import JobSpecError, load_job


def _run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pat run", description="run an RLHFJob locally as processes")
    ap.add_argument("job", help="RLHFJob YAML, e.g. examples/local.yaml")
    ap.add_argument("--run-dir", help="run folder (default runs/<name>-<time>); an existing one resumes")
    ap.add_argument("--baseline", action="store_true",
                    help="then run the same job with adaptive TP off and compare generation time and tokens")
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
    ap = argparse.ArgumentParser(prog="pat validate")
    ap.add_argument("job")
    job = load_job(ap.parse_args(argv).job)
    print(f"{job.kind} {job.metadata.name}: valid")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"run": _run, "validate": _validate}
    if not argv or argv[0] not in (*commands, "generator", "trainer"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "generator":
            from .generator.__main__ import main as generator
            return generator(rest) or 0
        if command == "trainer":
            from .trainer.loop import main as trainer
            return trainer(rest) or 0
        return commands[command](rest)
    except JobSpecError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
