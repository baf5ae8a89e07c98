"""`pat run JOB.yaml`: an RLHFJob as local processes -- the gang the operator runs as pods, on one machine.

Prepares the run folder (validated job, tiny model with its tokenizer, the job's control and inference tokens),
starts the generator pods and
then the trainer pods (each `pat trainer`: torch.distributed.run and the pod's ranks), or for placement colocated
the job's pods (each `pat colocated`: its generator and trainer ranks), and supervises them as one gang: when any
process fails, every process is stopped and the gang starts again (at most spec.runPolicy.backoffLimit times); the
trainer resumes from its last checkpoint.
While it runs it polls the pods' state (the layout timeline) and shows progress; at the end it writes the
summary and plots (report.py).

With --baseline the same job also runs at fixed layouts, adaptive TP off: fixed TP=1 and, where the model and the
pod's ranks allow more, fixed TP at the largest size they allow. The variants run side by side, each its own gang,
but take turns an iteration at a time (turns.py), in an order rotated every iteration, so that iteration k of each
runs back to back on the same host; their pods start one after the other, so that each measures its start-up
profile alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from tqdm import tqdm

from pat_operator.api import ModelSource, RLHFJob, RLHFJobSpec
from pat_operator.commands import colocated_args, generator_args, trainer_args
from pat_operator.fit import read_shape
from pat_operator.podclient import PodClient, http_url

from . import report
from .ports import free_port
from .turns import Turns
from .engine.tiny import make_tiny_model
from .trainer import data

POLL_S = 0.1
HOST = "127.0.0.1"  # every process's address; trainer rank 0 hosts the weight-sync store here
TOKENS = ("token", "inference-token")  # the run folder's token files: the control token, the inference token
DATASET_VOCAB = 64  # tokens of a tokenizer trained on the dataset


class LaunchError(RuntimeError):
    pass


def prepare(job: RLHFJob, run_dir: Path) -> Path:
    """Writes the run folder's inputs once (a rerun into the same folder resumes with them); returns the model."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job.model_dump(by_alias=True, exclude_none=True),
                                                     sort_keys=False))
    for name in TOKENS:
        token = run_dir / name
        if not token.exists():
            token.write_text(secrets.token_urlsafe(32))
            token.chmod(0o600)
    if job.spec.model.path:
        return Path(job.spec.model.path)
    return prepare_model(job.spec, run_dir / "model", data_dir=run_dir)


def prepare_model(spec: RLHFJobSpec, model_dir: Path, data_dir: Path) -> Path:
    """The job's tiny model, built from its seed unless model_dir holds it already. Deterministic: every pod of a
    job that builds it gets the same weights and tokenizer. Written to a temporary folder renamed into place, so
    that a reader never sees half a model."""
    if (model_dir / "config.json").exists():
        return model_dir
    tiny = spec.model.tiny
    tokenizer = None
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        if tiny.tokenizer == "dataset":  # a small vocabulary learns faster than 256 bytes would
            problems = data.load_problems(spec.dataset, base_dir=data_dir)
            corpus = [f"{p.prompt} #### {p.answer} \\boxed{{{p.answer}}}" for p in problems]  # answer formats too
            tokenizer = data.train_tokenizer(corpus, DATASET_VOCAB, staging / "tokenizer")
        make_tiny_model(staging / "model", family=tiny.family, preset=tiny.preset, seed=tiny.seed,
                        tokenizer=tokenizer)
        (staging / "model").rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_dir


@dataclass
class Gang:
    """The processes of one attempt."""
    attempt: int
    pods: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    driver: str = "trainer-0"  # the process whose exit 0 ends the job: the one that holds trainer rank 0

    def failed(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() not in (None, 0):
                return f"{name} exited with code {p.returncode}"
        return None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class LocalRun:
    def __init__(self, job: RLHFJob, run_dir: Path, progress: bool = True, env: dict[str, str] | None = None,
                 label: str | None = None, position: int = 0):
        self.job, self.spec, self.run_dir = job, job.spec, run_dir
        self.progress, self.label, self.position = progress, label or job.metadata.name, position
        self.env = env or {}  # added to every process's environment (turns.ENV)
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model = prepare(job, run_dir)
        self.token = (run_dir / "token").read_text().strip()

    def _spawn(self, gang: Gang, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.attempt{gang.attempt}.log", "w")
        gang.procs[name] = subprocess.Popen([sys.executable, "-m", "pat_workers.cli", *argv], stdout=log,
                                            stderr=subprocess.STDOUT, env={**os.environ, **self.env, **env},
                                            start_new_session=True)
        (self.run_dir / "pids.json").write_text(json.dumps({n: p.pid for n, p in gang.procs.items()}))

    def _start(self, attempt: int) -> Gang:
        """The gang's processes: generator pods, then trainer pods (they load while the pods start, then wait until
        the pods are ready); or the colocated pods. Every generator listens on a port of its own, as pods on
        separate addresses would."""
        ports = [free_port() for _ in range(self.spec.generator.replicas)]
        gang = Gang(attempt, [http_url(HOST, p) for p in ports])
        token, inference_token = (str(self.run_dir / name) for name in TOKENS)
        job_file, master = str(self.run_dir / "job.yaml"), free_port()
        env = {"PAT_ATTEMPT": str(attempt)}
        spec_at = lambda port: self.spec.model_copy(  # noqa: E731
            update={"generator": self.spec.generator.model_copy(update={"port": port})})
        if self.spec.placement == "colocated":
            gang.driver = "pod-0"
            for i, port in enumerate(ports):  # the job file a pod reads carries its port
                pod_job = self.run_dir / f"job.pod{i}.yaml"
                pod_job.write_text(yaml.safe_dump(self.job.model_copy(update={"spec": spec_at(port)}).model_dump(
                    by_alias=True, exclude_none=True), sort_keys=False))
                self._spawn(gang, f"pod-{i}", colocated_args(
                    spec_at(port), str(pod_job), str(self.model), str(self.run_dir), gang.pods, HOST, i, HOST, master,
                    HOST, token_file=token, inference_token_file=inference_token), env)
            return gang
        for i, port in enumerate(ports):
            self._spawn(gang, f"generator-{i}", generator_args(spec_at(port), str(self.model), HOST, token,
                                                               inference_token, weights_store=HOST), env)
        for i in range(self.spec.trainer.replicas):
            self._spawn(gang, f"trainer-{i}", trainer_args(
                self.spec, job_file, str(self.model), str(self.run_dir), gang.pods, HOST, i, HOST, master,
                token_file=token), env)
        return gang

    async def _attempt(self, attempt: int, bar: tqdm | None) -> str | None:
        """Runs one gang until the trainer finishes (None) or a process fails (the reason)."""
        gang = self._start(attempt)
        try:
            async with aiohttp.ClientSession() as session:
                clients = [PodClient(url, self.token, session) for url in gang.pods]
                with open(self.run_dir / "timeline.jsonl", "a") as timeline:
                    while True:
                        if (why := gang.failed()) is not None:
                            return why
                        if gang.procs[gang.driver].poll() == 0:
                            return None
                        states = await asyncio.gather(*(c.state() for c in clients), return_exceptions=True)
                        now = time.time()
                        for i, s in enumerate(states):
                            if not isinstance(s, Exception):
                                timeline.write(json.dumps({"time": now, "attempt": attempt, "pod": i,
                                                           **s.model_dump()}) + "\n")
                        if bar is not None:
                            self._show(bar, [s for s in states if not isinstance(s, Exception)])
                        await asyncio.sleep(POLL_S)
        finally:
            gang.stop()

    def _show(self, bar: tqdm, states: list) -> None:
        rows = report.read_jsonl(self.run_dir / "metrics.jsonl")
        bar.n = len(rows)
        post = {}
        if rows:
            post["reward"] = f"{rows[-1]['reward_mean']:.3f}"
            post["tok/s"] = f"{rows[-1]['tokens_per_second']:.0f}"
        if states:
            post["layout"] = " ".join(str(tuple(s.layout)) for s in states)
            post["running"] = sum(g.running + g.waiting for s in states for g in s.groups)
        bar.set_postfix(post, refresh=False)
        bar.update(0)  # redraws at most every mininterval

    def bar(self) -> tqdm:
        size = shutil.get_terminal_size((110, 24))  # a terminal of unknown size reports 0 x 0: tqdm hides bars
        return tqdm(total=self.spec.algorithm.iterations, desc=self.label, unit="it", position=self.position,
                    disable=not self.progress, file=sys.stderr, mininterval=0.25 if sys.stderr.isatty() else 10,
                    ncols=size.columns, nrows=size.lines)

    async def run_async(self, bar: tqdm | None = None) -> dict:
        """The gang's attempts until the trainer finishes; the outcome (seconds, restarts)."""
        started = time.time()
        restarts: list[dict] = []
        attempt = 0
        while (why := await self._attempt(attempt, bar)) is not None:
            restarts.append({"attempt": attempt, "time": time.time(), "reason": why})
            tqdm.write(f"{self.label}: attempt {attempt} failed: {why}; logs in {self.logs}", file=sys.stderr)
            if len(restarts) > self.spec.run_policy.backoff_limit:
                raise LaunchError(f"the job failed {len(restarts)} times (runPolicy.backoffLimit="
                                  f"{self.spec.run_policy.backoff_limit}); last: {why}")
            attempt += 1
        return {"seconds": time.time() - started, "restarts": restarts}

    def run(self) -> dict:
        bar = self.bar()
        try:
            return asyncio.run(self.run_async(bar))
        finally:
            bar.close()


def fixed_of(job: RLHFJob, model: Path, tp: int) -> RLHFJob:
    """The same job on the same model at a fixed layout: adaptive TP off, TP groups of `tp` ranks."""
    generator = job.spec.generator
    spec = job.spec.model_copy(update={
        "generator": generator.model_copy(update={"tensor_parallel_size": tp, "adaptive_tp": generator.adaptive_tp
                                                  .model_copy(update={"enabled": False})}),
        "model": ModelSource(path=str(model.resolve()))})
    return job.model_copy(update={"spec": spec})


def fixed_sizes(job: RLHFJob, model: Path) -> list[int]:
    """The fixed layouts a baseline runs: TP=1, and the largest TP the model's heads and the pod's ranks allow when
    that is more than 1 (where decode steps are memory-bound, the fastest fixed layout is usually that one or
    TP=1; the report names whichever generated faster as the best fixed layout)."""
    largest = read_shape(model / "config.json").tp_sizes(job.spec.generator.ranks)[-1]
    return sorted({1, largest})


async def interleave(runs: dict[str, LocalRun], turns: Turns) -> dict[str, dict]:
    """Runs the jobs side by side, one iteration at a time (see turns.py): their gangs start one after the other
    (each pod measures its profile alone), then each iteration goes to every job in turn, in the order
    turns.order gives. Returns each job's outcome; the first job that fails for good stops them all."""
    bars = {name: r.bar() for name, r in runs.items()}
    tasks: dict[str, asyncio.Task] = {}

    async def until(name: str, past: int) -> None:
        """Until the job waits for an iteration after `past`, or has ended (its gang stopped)."""
        while not tasks[name].done() and (turns.waiting(name) or 0) <= past:
            await asyncio.sleep(0.02)
        if tasks[name].done() and tasks[name].exception() is not None:
            raise tasks[name].exception()

    try:
        for name, r in runs.items():
            tasks[name] = asyncio.create_task(r.run_async(bars[name]))
            await until(name, 0)  # ready for its first iteration
        for iteration in range(1, max(r.spec.algorithm.iterations for r in runs.values()) + 1):
            for name in turns.order(iteration):
                turns.grant(name, iteration)
                await until(name, iteration)
        return {name: await task for name, task in tasks.items()}
    finally:
        for task in tasks.values():
            task.cancel()  # the runs still going (one failed): their gangs stop as their tasks end
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for bar in bars.values():
            bar.close()


def run(job: RLHFJob, run_dir: Path, baseline: bool = False, progress: bool = True) -> Path:
    """Runs the job; with `baseline` also the same job at fixed layouts (fixed_sizes), taking turns an iteration at a
    time with it (interleave). Returns summary.json."""
    if not baseline:
        return report.write(run_dir, job, LocalRun(job, run_dir, progress).run())
    model = prepare(job, run_dir)
    sizes = fixed_sizes(job, model)
    names = ["job", *(f"fixed-tp{tp}" for tp in sizes)]
    turns = Turns(run_dir / "turns", names)
    label = "adaptive TP" if job.spec.generator.adaptive else job.metadata.name
    runs = {"job": LocalRun(job, run_dir, progress, turns.env("job"), label)}
    for i, tp in enumerate(sizes, 1):
        runs[f"fixed-tp{tp}"] = LocalRun(fixed_of(job, model, tp), run_dir / f"fixed-tp{tp}", progress,
                                         turns.env(f"fixed-tp{tp}"), f"fixed TP={tp}", i)
    print(f"baseline: the same job at fixed {', '.join(f'TP={tp}' for tp in sizes)} (adaptive TP off), side by "
          f"side, one iteration at a time in turns: {' / '.join(names)}, the order rotated every iteration",
          file=sys.stderr, flush=True)
    outcomes = asyncio.run(interleave(runs, turns))
    return report.write(run_dir, job, outcomes["job"],
                        {tp: (run_dir / f"fixed-tp{tp}", outcomes[f"fixed-tp{tp}"]) for tp in sizes},
                        turns=[turns.order(i) for i in range(1, job.spec.algorithm.iterations + 1)])
