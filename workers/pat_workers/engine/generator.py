"""A generator pod's ranks, driven from one process: start, submit, regroup, collect, stop.

This is what the pod's coordinator (HTTP server) wraps; tests and benchmarks use it directly. It owns the
layout's bookkeeping and the Prometheus metrics, and it makes sure no request is lost: what a failed regroup
could not carry over is submitted again.

Two ways to drive it: `run` generates a batch and returns when it is done; a caller with more to do between
steps (the coordinator) calls `submit`, then `poll` (one event at a time) and `take_finished`, which is what
`run` does. Not thread-safe: one thread drives it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pat_operator import layout as layouts
from pat_operator.layout import Group, Layout

from ..ports import free_port
from .config import ModelConfig
from .costs import Costs
from .engine import Request
from .metrics import EngineMetrics
from .rank import EngineOptions, rank_main
from .regroup import MIGRATION_MODES, RegroupReport


class GeneratorError(RuntimeError):
    pass


@dataclass
class StepRecord:
    time: float  # seconds since start of the run
    group: Group
    batch: int
    waiting: int
    seconds: float
    tokens: int
    finished: int
    prefill_tokens: int
    running: list[tuple[str, int]] = field(default_factory=list)  # (id, tokens generated) still decoding after it
    context: int = 0  # KV tokens of its batch (prompt + generated of each request, those it finished included)


@dataclass
class RegroupRecord:
    time: float
    epoch: int
    old: Layout
    new: Layout
    reports: list[RegroupReport]

    @property
    def seconds(self) -> float:
        return max((r.seconds.get("total", 0.0) for r in self.reports), default=0.0)


@dataclass
class RunResult:
    completions: dict[str, Request]
    seconds: float
    steps: list[StepRecord] = field(default_factory=list)
    regroups: list[RegroupRecord] = field(default_factory=list)


class LocalGenerator:
    """`world` engine ranks as local processes (one per GPU when CUDA is present, else one per CPU core).

    `layout`: the layout the ranks start in (default all TP=1), e.g. (2, 2) for a fixed TP=2 of 4 ranks; it must be
    among the TP sizes the model allows. It changes only by `regroup` (or a failed group's fallback to TP=1)."""

    def __init__(self, model_dir: str, world: int, options: EngineOptions = EngineOptions(),
                 env: dict[str, str] | None = None, layout: Iterable[int] | None = None):
        self.model_dir, self.world, self.options, self.env = str(model_dir), world, options, env or {}
        self.config = ModelConfig.from_dir(model_dir)  # fails here, in the caller, on a bad model directory
        self.start_layout: Layout = layouts.validate(layout or layouts.uniform(world), world,
                                                     self.config.tp_sizes(world))
        self.layout: Layout = self.start_layout
        self.epoch = 0
        self.metrics = EngineMetrics(options.max_seq)
        self.dead: set[int] = set()
        self.broken: set[Group] = set()  # blocks whose communicator failed: unusable until the pod restarts
        self._accounted_dead: set[int] = set()  # deaths a regroup fallback already handled
        self.costs: Costs | None = None
        self.tp_sizes: list[int] = [1]
        self._procs: list = []
        self._load: dict[Group, int] = {}
        self._where: dict[str, Group] = {}  # in-flight request id -> group it was sent to
        self._requests: dict[str, Request] = {}
        self._generated: dict[str, int] = {}  # in-flight request id -> tokens generated, as of its group's last step
        self._last_step: dict[Group, tuple[int, set[str]]] = {}  # group -> (queued, ids decoding) at its last step
        self._finished: list[Request] = []  # finished, not yet taken
        self._run: RunResult | None = None
        self._t0 = time.perf_counter()
        self.policy_version = 0  # the weights the ranks hold: 0 is the model directory's
        self.weights_pending: int | None = None  # the version the ranks are receiving
        self.weights_refused: str | None = None  # why the last update was refused (the ranks kept their weights)
        self._weight_reports: dict[int, str | None] = {}
        self.memory_held = True  # the ranks' KV pools and step memory (see set_memory)
        self.memory_bytes: dict[int, int] = {}  # rank -> its memory at its last set_memory
        self.weights_held = True  # False from set_memory(weights=True) until a weight update succeeds

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, timeout: float = 600.0) -> LocalGenerator:
        # A fork server imports torch once and forks every rank from that clean process: 4 ranks start in
        # ~3 s instead of ~13 s of parallel imports on 2 cores (and no rank inherits this process's threads).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["pat_workers.engine.rank"])
        self._events = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(self.world)]
        init = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(self.world):
            p = ctx.Process(target=rank_main, name=f"pat-rank-{rank}", daemon=True,
                            args=(rank, self.world, self.model_dir, self.options, init, self._commands,
                                  self._events, self.env, self.start_layout))
            p.start()
            self._procs.append(p)
        ready = 0
        while ready < self.world:
            event = self._next_event(timeout)
            if event[0] != "ready":
                raise GeneratorError(f"unexpected event while starting: {event[0]}")
            ready += 1
            if event[2] is not None:
                self.costs, self.tp_sizes = event[2], event[3]
        self._set_layout(self.layout)
        return self

    def close(self, timeout: float = 30.0) -> None:
        for g in self._live_groups():
            self._commands[g[0]].put(("stop",))
        for p in self._procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        self._procs = []

    def __enter__(self) -> LocalGenerator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------------------
    def check(self, requests: Iterable[Request]) -> None:
        """Raises ValueError, naming the request and the fix, if `submit` would refuse any of them."""
        seen: set[str] = set()
        for r in requests:
            if not r.prompt or len(r.prompt) >= self.options.max_seq:
                raise ValueError(f"request {r.id}: prompt has {len(r.prompt)} tokens; it must have 1 to "
                                 f"{self.options.max_seq - 1} (engine max_seq)")
            bad = next((t for t in r.prompt if not 0 <= t < self.config.vocab_size), None)
            if bad is not None:
                raise ValueError(f"request {r.id}: prompt token id {bad} is outside the vocabulary "
                                 f"(0..{self.config.vocab_size - 1}); tokenize with the model's tokenizer.json")
            if r.id in self._where or r.id in seen:
                raise ValueError(f"request {r.id}: another unfinished request has this id; ids must be unique")
            seen.add(r.id)

    def submit(self, requests: Iterable[Request]) -> None:
        """Sends each request to the least loaded live replica group; refuses all of them if one is invalid."""
        requests = list(requests)
        self.check(requests)
        batches: dict[Group, list[Request]] = {}
        for r in requests:
            group = min(self._live_groups(), key=lambda g: self._load[g] / len(g))
            self._load[group] += 1
            self._requests[r.id], self._where[r.id] = r, group
            self._generated[r.id] = len(r.output)
            batches.setdefault(group, []).append(r)
        for group, batch in batches.items():
            self._commands[group[0]].put(("add", batch))

    def poll(self, timeout: float) -> StepRecord | None:
        """Handles the next event of the ranks: a step's record, or None for another event or when none came
        within `timeout` seconds. Raises GeneratorError when a rank fails or dies."""
        event = self._next_event(timeout, required=False)
        return None if event is None else self._handle(event)

    def take_finished(self) -> list[Request]:
        """The requests finished since the last call, in the order they finished."""
        finished, self._finished = self._finished, []
        return finished

    def run(self, requests: Iterable[Request], policy: Callable[[LocalGenerator], Layout | None] | None = None,
            on_step: Callable[[StepRecord], None] | None = None, migration: str | None = None,
            timeout: float = 3600.0) -> RunResult:
        """Generates every request. `policy` is asked for a layout once before the first step and after every
        step event; a layout other than the current one is applied (with `migration`, default the option's)."""
        self._t0 = time.perf_counter()
        self._run = RunResult({}, 0.0)
        requests = list(requests)
        self.submit(requests)
        done: dict[str, Request] = {}
        deadline = time.monotonic() + timeout
        while True:
            target = policy(self) if policy else None
            if target is not None and tuple(target) != self.layout:
                self.regroup(target, migration)
            done.update((r.id, r) for r in self.take_finished())
            if len(done) == len(requests):
                break
            while (record := self.poll(deadline - time.monotonic())) is None:
                if time.monotonic() > deadline:
                    raise GeneratorError("timed out waiting for the engine ranks")
            if on_step:
                on_step(record)
        self._run.completions = {r.id: done[r.id] for r in requests}
        self._run.seconds = time.perf_counter() - self._t0
        result, self._run = self._run, None
        return result

    def running_lengths(self) -> dict[Group, list[tuple[int, int]]]:
        """(context tokens, generated tokens) of each unfinished request, per live group, as the planner takes
        them: a request not decoding at its group's last step is queued and holds no KV (context 0)."""
        out: dict[Group, list[tuple[int, int]]] = {g: [] for g in self._live_groups()}
        for rid, group in self._where.items():
            if group in out:
                generated = self._generated[rid]
                decoding = rid in self._last_step.get(group, (0, ()))[1]
                out[group].append((len(self._requests[rid].prompt) + generated if decoding else 0, generated))
        return out

    def occupancy(self) -> dict[Group, tuple[int, int]]:
        """(running, waiting) requests per live group, as of each group's last step."""
        out = {}
        for g, n in self.loads().items():
            waiting = min(self._last_step.get(g, (0, ()))[0], n)
            out[g] = (n - waiting, waiting)
        return out

    # -- weights -----------------------------------------------------------------------------------------
    def update_weights(self, version: int, address: str, world: int | None = None, rank_offset: int | None = None,
                       backend: str = "gloo", transport: str = "group", token: str = "") -> None:
        """Sends every rank into the weight broadcast of `version` (see weightsync), or with transport device into
        the hand-over from the trainer rank on its device (authenticated by the job's `token`), and returns; `poll`
        sets `policy_version` once every live rank holds the new weights (or `weights_refused` if a rank refused)."""
        if self._where:
            raise ValueError(f"{len(self._where)} request(s) are generating; update the weights between batches")
        if self.weights_pending is not None:
            raise ValueError(f"the ranks are still receiving version {self.weights_pending}")
        self.weights_pending, self.weights_refused, self._weight_reports = version, None, {}
        command = (("weights", version, address, world, rank_offset, backend) if transport == "group" else
                   ("weights_device", version, address, token))
        for g in self._live_groups():
            self._commands[g[0]].put(command)

    # -- memory ------------------------------------------------------------------------------------------
    def set_memory(self, held: bool, weights: bool = False, timeout: float = 300.0) -> dict[int, int]:
        """Between batches: every rank gives back (held False) or takes again (True) its KV pool and step memory
        (Engine.release_memory / acquire_memory), so that the trainer ranks on the same devices can use it; with
        `weights` it gives back its weights too, and takes its memory again only after a weight update has written
        new ones. Returns each rank's memory afterwards (memory_bytes)."""
        if self._where:
            raise ValueError(f"{len(self._where)} request(s) are generating; release memory between batches")
        if held and not self.weights_held:
            raise ValueError("the ranks released their weights: update the weights to the next version before they "
                             "take their memory back")
        for g in self._live_groups():
            self._commands[g[0]].put(("memory", held, weights))
        reported: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while set(range(self.world)) - self._dead_now() - set(reported):
            event = self._next_event(deadline - time.monotonic())
            if event[0] == "memory":
                reported[event[1]] = event[2]
            else:
                self._handle(event)
        self.memory_held, self.memory_bytes = held, reported
        self.weights_held = self.weights_held and not weights
        return reported

    # -- layouts -----------------------------------------------------------------------------------------
    def regroup(self, target: Iterable[int], migration: str | None = None, timeout: float = 300.0,
                epoch: int | None = None) -> list[RegroupReport]:
        """Applies a layout at the next step boundary of the groups it changes; returns every rank's report.

        migration: auto | kv | recompute for this regroup (default: the engine option). epoch: the layout's epoch
        afterwards (default: the current one + 1; an operator's plan brings its own)."""
        if migration not in (None, *MIGRATION_MODES):
            raise ValueError(f"migration={migration!r}: use one of {MIGRATION_MODES}")
        if epoch is not None and epoch <= self.epoch:
            raise ValueError(f"epoch {epoch} is not after the current epoch {self.epoch}")
        target = layouts.validate(tuple(target), self.world, self.tp_sizes)
        for g in layouts.groups(target):
            if len(g) > 1 and set(g) & self.dead:
                raise layouts.LayoutError(f"layout {target}: group {g} contains dead rank(s) "
                                          f"{sorted(set(g) & self.dead)}; restart the pod to use them again")
        for g in layouts.groups(target) + layouts.regions(self.layout, target):
            if g in self.broken:
                raise layouts.LayoutError(f"layout {target}: the communicator of ranks {g} failed in an earlier "
                                          f"regroup; restart the pod to use it again")
        old, self.epoch = self.layout, self.epoch + 1 if epoch is None else epoch
        started = time.perf_counter()
        for g in self._live_groups():
            self._commands[g[0]].put(("regroup", self.epoch, old, target, migration))
        touched = {r for region in layouts.regions(old, target) for r in region}
        expected = {g[0] for g in layouts.groups(old) if not set(g) & touched} | touched
        reports: list[RegroupReport] = []
        covered: set[int] = set()
        deadline = time.monotonic() + timeout
        while not expected - self._dead_now() <= covered:
            event = self._next_event(deadline - time.monotonic(), allow_dead=True)
            if event[0] != "regrouped":
                self._handle(event)
                continue
            report: RegroupReport = event[1]
            reports.append(report)
            covered |= set(report.group) if report.outcome != "unchanged" else {report.rank}
        self._apply_reports(target, reports)
        self._accounted_dead = set(self.dead)
        if self._run is not None:
            self._run.regroups.append(RegroupRecord(started - self._t0, self.epoch, old, self.layout, reports))
        return reports

    def _apply_reports(self, target: Layout, reports: list[RegroupReport]) -> None:
        self.metrics.on_regroup(reports)
        for rep in reports:  # requests now live where the reports say
            for i in rep.request_ids:
                if i in self._where:
                    self._where[i] = rep.group
        failed = {rep.region for rep in reports if rep.outcome in ("fallback", "rejected")}
        self.broken |= failed
        fell_back = {r for region in failed for r in region}
        if not fell_back:
            self._set_layout(target)
            return
        # The failed regions are TP=1 now; other regions applied the plan.
        held = {i for rep in reports for i in rep.request_ids}
        lost = [self._requests[i] for i, g in self._where.items() if set(g) & fell_back and i not in held]
        for r in lost:  # the group that held them died before it could hand them over: start them again
            r.output, r.logprobs, r.cached, r.finish_reason = [], [], 0, None
            del self._where[r.id]
        sizes: list[int] = []
        for g in layouts.groups(target):
            sizes += [1] * len(g) if set(g) & fell_back else [len(g)]
        self._set_layout(tuple(sizes))
        self.submit(lost)

    def _set_layout(self, layout: Layout) -> None:
        self.layout = layout
        counts = {g: 0 for g in layouts.groups(layout)}
        for i, g in list(self._where.items()):
            target = next(h for h in counts if set(h) & set(g))
            self._where[i] = target
            counts[target] += 1
        self._load = counts
        self._last_step = {}
        self.metrics.set_layout(list(counts), self.epoch)

    # -- events ------------------------------------------------------------------------------------------
    def _live_groups(self) -> list[Group]:
        return [g for g in layouts.groups(self.layout) if not set(g) & self._dead_now()]

    def _dead_now(self) -> set[int]:
        self.dead |= {rank for rank, p in enumerate(self._procs) if p.exitcode is not None}
        return self.dead

    def _next_event(self, timeout: float, allow_dead: bool = False, required: bool = True) -> tuple | None:
        """The next event; after `timeout` seconds without one, GeneratorError (or None if not `required`)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                event = self._events.get(timeout=min(0.2, max(deadline - time.monotonic(), 0.0)))
            except queue.Empty:
                if not allow_dead and self._dead_now() - self._accounted_dead:
                    raise GeneratorError(f"rank(s) {sorted(self.dead - self._accounted_dead)} died") from None
                if time.monotonic() >= deadline:
                    if required:
                        raise GeneratorError("timed out waiting for the engine ranks") from None
                    return None
                continue
            if event[0] == "error":
                raise GeneratorError(f"rank {event[1]} failed:\n{event[2]}")
            return event

    def _handle(self, event: tuple) -> StepRecord | None:
        if event[0] == "weights":
            self._on_weights(*event[1:])
        if event[0] != "step":
            return None
        _, group, batch, waiting, seconds, tokens, prefill_tokens, finished, running, preempted, kv_usage = event
        self._last_step[group] = (waiting, {rid for rid, _ in running})
        context = 0
        for rid, generated in running:
            if rid in self._generated:
                self._generated[rid] = generated
                context += len(self._requests[rid].prompt) + generated
        self.metrics.on_step(group, batch, len(running), waiting, seconds, tokens, context,
                             sum(generated for _, generated in running), preempted, kv_usage)
        for r in finished:
            if r.id in self._where:
                self._finished.append(r)
                del self._generated[r.id], self._requests[r.id]
                held_by = self._where.pop(r.id)
                self._load[held_by] = max(self._load.get(held_by, 1) - 1, 0)
        context += sum(len(r.prompt) + len(r.output) for r in finished)
        record = StepRecord(time.perf_counter() - self._t0, group, batch, waiting, seconds, tokens, len(finished),
                            prefill_tokens, running, context)
        if self._run is not None:
            self._run.steps.append(record)
        return record

    def _on_weights(self, rank: int, version: int, refused: str | None) -> None:
        if version != self.weights_pending:
            return
        self._weight_reports[rank] = refused
        if set(range(self.world)) - self._dead_now() - set(self._weight_reports):
            return  # a live rank is still receiving
        reasons = [f"rank {r}: {why}" for r, why in sorted(self._weight_reports.items()) if why]
        if reasons:  # a refused round moved nothing (weightsync): every rank kept its weights
            self.weights_refused = "; ".join(reasons)
        else:
            self.policy_version, self.weights_held = version, True
            self.metrics.policy_version.set(version)
        self.weights_pending = None

    def loads(self) -> dict[Group, int]:
        """Unfinished requests per live group, as the coordinator knows them."""
        return {g: n for g, n in self._load.items() if not set(g) & self.dead}
