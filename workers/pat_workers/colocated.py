"""`pat colocated`: one pod of a colocated job (spec.placement: colocated), its generator and its trainer ranks on
the same devices.

It starts the pod's two command lines (pat_operator.commands: generator_args and trainer_args, from the same job
file) as child processes and keeps them one unit: it ends when the trainer ends, with the trainer's exit code, after
stopping the generator; when the generator fails first, it stops the trainer and fails, so that the operator
restarts the gang. SIGTERM stops both. On GPUs the generator's KV cache leaves each device what the trainer rank
beside it keeps between phases (fit.trainer_resident_bytes).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from pat_operator import commands
from pat_operator.api import load_job
from pat_operator.fit import read_shape, trainer_resident_bytes

POLL_SECONDS = 0.2
STOP_SECONDS = 20.0  # a child's grace period after SIGTERM


def command_lines(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The generator's and the trainer's arguments after `pat`."""
    spec = load_job(args.job).spec
    # Trainer rank 0, on pod 0 (master_addr), hosts the job's weight-sync store.
    generator = commands.generator_args(spec, args.model, args.generator_host, args.token_file,
                                        args.inference_token_file, weights_store=args.master_addr)
    if spec.generator.gpus_per_pod:
        reserved = trainer_resident_bytes(spec, read_shape(Path(args.model) / "config.json"))
        generator += ["--reserved-bytes", str(int(reserved))]
    trainer = commands.trainer_args(spec, args.job, args.model, args.run_dir, args.generators.split(","), args.host,
                                    args.pod_index, args.master_addr, args.master_port, args.metrics_port,
                                    token_file=args.token_file, bind=args.bind)
    return generator, trainer


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pat colocated", description="one pod of a colocated job: its generator and "
                                 "its trainer ranks on the same devices")
    ap.add_argument("--job", required=True, help="RLHFJob YAML")
    ap.add_argument("--model", required=True, help="the initial policy's model directory")
    ap.add_argument("--run-dir", required=True, help="the trainer's run folder")
    ap.add_argument("--generators", required=True, help="comma-separated URLs of every pod's generator")
    ap.add_argument("--host", required=True, help="the trainer's address (the pod's IP)")
    ap.add_argument("--generator-host", required=True, help="the address the generator listens on")
    ap.add_argument("--pod-index", type=int, required=True)
    ap.add_argument("--master-addr", required=True, help="pod 0's address: the trainer's rendezvous")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, default=0)
    ap.add_argument("--token-file", help="the job's control token (default: env PAT_JOB_TOKEN)")
    ap.add_argument("--inference-token-file", help="the job's inference token, for the generator (default: env "
                    "PAT_INFERENCE_TOKEN)")
    ap.add_argument("--bind", help="the trainer's metrics address (default: --host)")
    generator_args, trainer_args = command_lines(ap.parse_args(argv))
    spawn = lambda args: subprocess.Popen([sys.executable, "-m", "pat_workers.cli", *args])  # noqa: E731
    generator = spawn(generator_args)
    trainer = spawn(trainer_args)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while not stopping:
        if trainer.poll() is not None:
            _stop([generator])
            return trainer.returncode
        if generator.poll() is not None:
            print(f"pat colocated: the generator exited with code {generator.returncode}; stopping the trainer",
                  file=sys.stderr, flush=True)
            _stop([trainer])
            return generator.returncode or 1
        time.sleep(POLL_SECONDS)
    _stop([trainer, generator])
    return 0
