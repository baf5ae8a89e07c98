"""The generator pod's coordinator: one thread that owns the pod's engine ranks (a LocalGenerator) and does what
the HTTP API asks of them, between decode steps.

The LocalGenerator is not thread-safe, so only this thread touches it. Others hand it commands through `post`
(a thread-safe inbox; the reply comes back through a callback, on this thread) and read `state`, a PodState
snapshot it republishes as things change. Between commands the thread pumps the ranks' events: finished
requests complete the open rollout batch, and with controller=pod every decode step is a chance to regroup
(pat_operator.planner decides; the pod applies it at the next step boundary).

Errors a client can fix are raised as PodError subclasses carrying their HTTP status; each is raised before
anything changed.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pat_operator import layout as layouts
from pat_operator.planner import (PLAN_SPACING, REGROUP_FIXED_SECONDS, Controller, Decision, LengthPredictor,
                                  Profile, RegroupCosts)
from pat_operator.prometheus import PRIOR_LENGTHS
from pat_operator.podapi import (SLEEP_LEVELS, BatchStatus, Completion, GroupState, PodState, RegroupAck,
                                 RegroupPlan, RolloutBatch, RolloutRequest, WeightUpdate)

from ..engine.engine import Request
from ..engine.generator import GeneratorError, LocalGenerator, StepRecord
from ..engine.loader import load_tokenizer
from ..engine.rank import EngineOptions
from ..engine.sampling import SamplingParams
from .errors import Conflict, Invalid, NotFound, PodError, Unavailable, check_plan, check_weight_update

log = logging.getLogger("pat.generator")

IDLE_POLL_SECONDS = 0.02  # the longest the thread waits for a rank event before it looks at its inbox again
STATE_PERIOD_SECONDS = 0.05  # during a batch, `state` is republished at most this often (and at every command)
KEPT_BATCHES = 8  # finished batches whose completions stay fetchable


@dataclass(frozen=True)
class PodConfig:
    model_dir: str
    ranks: int
    options: EngineOptions = EngineOptions()  # options.migration is also the migration mode of every regroup
    controller: Literal["pod", "operator"] = "pod"
    margin: float = 0.1
    cooldown_steps: int = 4
    guard: bool = True  # judge each regroup by its steps (planner.Controller); off only to measure what it saves
    profile: str | None = None  # an offline T(tp, batch, context) profile (Profile.to_json); default: measured at start
    tokenizer_dir: str | None = None  # default: the model directory's tokenizer.json
    tp_sizes: tuple[int, ...] | None = None  # the TP sizes plans may use; default: all the model allows
    tp: int = 1  # above 1: a fixed layout of ranks / tp groups of tp ranks (generator.tensorParallelSize), no plans


@dataclass
class _Batch:
    batch_id: str
    policy_version: int
    ids: list[str]  # in request order
    finished: dict[str, Request] = field(default_factory=dict)  # id -> the ranks' finished copy
    watchers: list[Callable[[], None]] = field(default_factory=list)  # called once, when the batch is done

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.ids)


Reply = Callable[[Any, BaseException | None], None]


class Coordinator:
    def __init__(self, config: PodConfig, env: dict[str, str] | None = None, token: str = ""):
        self.config, self.token = config, token  # the job's token also authenticates the in-pod weight hand-over
        if config.ranks < 1:
            raise ValueError(f"ranks={config.ranks}: use 1 or more (one engine rank per device)")
        if config.controller not in ("pod", "operator"):
            raise ValueError(f"controller={config.controller!r}: use pod (plans its own regroups) or operator")
        if config.tp < 1 or config.tp & (config.tp - 1) or config.ranks % config.tp:
            raise ValueError(f"--tensor-parallel-size={config.tp} must be a power of two dividing --ranks="
                             f"{config.ranks}")
        if config.tp > 1 and config.controller == "pod":
            raise ValueError(f"--tensor-parallel-size={config.tp} is a fixed layout: the pod plans no regroups; use "
                             f"--controller operator (generator.adaptiveTP.enabled: false)")
        self._offline_profile = _read_profile(config.profile) if config.profile else None
        self.gen = LocalGenerator(config.model_dir, config.ranks, config.options, env,
                                  layouts.uniform(config.ranks, config.tp))
        self.tokenizer = load_tokenizer(config.tokenizer_dir or config.model_dir)
        self.ready = threading.Event()  # ranks up and profiled
        self.failure: str | None = None  # why the thread stopped, if it failed
        self.dead_ranks: frozenset[int] = frozenset()
        self._inbox: queue.Queue[tuple[Callable, tuple, Reply]] = queue.Queue()
        self._closed = False  # set under _inbox_lock once the thread no longer serves its inbox
        self._inbox_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="pat-coordinator", daemon=True)
        self._on_exit: Callable[[], None] | None = None
        self._batches: OrderedDict[str, _Batch] = OrderedDict()
        self._batch: _Batch | None = None  # the newest batch
        self._next_plan = 0.0  # perf_counter time before which the pod does not plan again
        self._lengths: deque[int] = deque(maxlen=PRIOR_LENGTHS)  # earlier batches' lengths: the predictor's prior
        self._last_ack: RegroupAck | None = None  # of the operator's last plan, for a retry of it
        self._receiving: int | None = None  # the weight version the ranks were sent into
        self._published = 0.0
        self.state: PodState = self._snapshot()
        # controller=pod only, set once the ranks have measured their costs
        self.controller: Controller | None = None
        self.profile: Profile | None = None
        self.costs: RegroupCosts | None = None
        self._predictor: LengthPredictor | None = None

    # -- lifecycle (any thread) ---------------------------------------------------------------------------
    def start(self, on_exit: Callable[[], None] | None = None) -> None:
        """Starts the thread; it starts the ranks. `on_exit` is called from it when it ends (failed or stopped)."""
        self._on_exit = on_exit
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def post(self, command: Callable, *args: Any, reply: Reply) -> None:
        """Runs `command` (a method of this coordinator) on its thread; `reply(result, error)` is called there.
        Before the ranks are ready and after the thread ended the reply is Unavailable, at once."""
        with self._inbox_lock:
            if self.ready.is_set() and not self._closed:
                self._inbox.put((command, args, reply))
                return
        reply(None, Unavailable(self.failure or ("the pod is stopping" if self._closed else
                                "the pod is starting: its engine ranks load and profile the model; retry once "
                                "/readyz answers 200")))

    def health(self) -> str | None:
        """Why the pod is unhealthy, or None."""
        if self.failure:
            return self.failure
        if self.dead_ranks:
            return f"engine rank(s) {sorted(self.dead_ranks)} died; the pod must restart"
        if self._thread.ident is not None and not self._thread.is_alive():
            return "the coordinator thread has stopped"
        return None

    # -- the thread -----------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.gen.start()
            self._setup_planner()
            self.ready.set()
            self._publish(force=True)
            log.info("ready: %d rank(s), layout %s, TP sizes %s, controller=%s", self.gen.world, self.gen.layout,
                     self.gen.tp_sizes, self.config.controller)
            while not self._stop.is_set():
                self._serve_inbox()
                record = self.gen.poll(IDLE_POLL_SECONDS)
                if record is not None:
                    self._on_step(record)
                self._collect_finished()
                self._check_weights()
                self.dead_ranks = frozenset(self.gen.dead)
                if self.dead_ranks:  # one a regroup's fallback survived: the gang restarts anyway, so now
                    raise GeneratorError(f"engine rank(s) {sorted(self.dead_ranks)} died")
                self._publish()
        except BaseException as e:  # the pod's life ends with this thread: report why
            self.failure = f"{type(e).__name__}: {e}"
            log.error("coordinator stopped: %s", self.failure)
        finally:
            self.ready.clear()
            with self._inbox_lock:
                self._closed = True
            while not self._inbox.empty():
                _, _, reply = self._inbox.get_nowait()
                reply(None, Unavailable(self.failure or "the pod is stopping"))
            for batch in self._batches.values():  # long polls end now (with 503), not at their timeout
                for notify in batch.watchers:
                    notify()
            self.gen.close(timeout=5.0 if self.failure else 30.0)
            if self._on_exit:
                self._on_exit()

    def _serve_inbox(self) -> None:
        while True:
            try:
                command, args, reply = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                result, error = command(*args), None
            except PodError as e:
                result, error = None, e
            except BaseException as e:  # the ranks failed, or a bug: the pod must not go on
                reply(None, e)
                raise
            self._publish(force=True)  # before the reply: whoever reads GET /v1/state next sees what it did
            reply(result, error)

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._published >= STATE_PERIOD_SECONDS:
            self.state, self._published = self._snapshot(), now

    def _snapshot(self) -> PodState:
        occupancy = self.gen.occupancy()
        return PodState(
            ready=self.ready.is_set(), layout=list(self.gen.layout), epoch=self.gen.epoch,
            groups=[GroupState(ranks=list(g), tp=len(g), running=occupancy.get(g, (0, 0))[0],
                               waiting=occupancy.get(g, (0, 0))[1]) for g in layouts.groups(self.gen.layout)],
            policy_version=self.gen.policy_version, batch_id=self._batch.batch_id if self._batch else None,
            batch_done=not self._generating(), controller=self.config.controller, world=self.gen.world,
            weight_receivers=self.gen.world, dtype=self.config.options.dtype,
            memory="held" if self.gen.memory_held else "released",
            weights="held" if self.gen.weights_held else "released",
            memory_bytes=[self.gen.memory_bytes.get(r, 0) for r in range(self.gen.world)] if self.gen.memory_bytes
            else [])

    def _generating(self) -> bool:
        return self._batch is not None and not self._batch.done

    # -- planning (controller=pod) ----------------------------------------------------------------------
    def _setup_planner(self) -> None:
        """The planner's inputs, exported as metrics too (controller=operator plans with them); and with
        controller=pod the planner itself."""
        measured = self.gen.costs
        self.profile = self._offline_profile or Profile.measured(measured)
        cfg = self.gen.config
        kv_bytes_per_token = cfg.kv_bytes_per_token(_itemsize(self.config.options))
        self.costs = RegroupCosts.measured(REGROUP_FIXED_SECONDS, kv_bytes_per_token, measured.link_bytes_per_s,
                                           measured.prefill)
        self._export_costs()
        if self.config.controller != "pod":
            return
        allowed = self.config.tp_sizes or self.gen.tp_sizes
        self.controller = Controller([t for t in self.gen.tp_sizes if t in allowed], self.config.margin,
                                     self.config.cooldown_steps, self.config.guard)

    def _export_costs(self) -> None:
        costs = self.controller.regroup_costs(self.costs) if self.controller else self.costs  # as measured
        self.gen.metrics.set_costs(self.profile.to_json(), costs.fixed_seconds, costs.kv_seconds_per_token,
                                   dict(costs.prefill))

    def _on_step(self, record: StepRecord) -> None:
        decode = record.batch and not record.prefill_tokens  # prefill is costed apart
        if self.controller is not None and decode:
            self.controller.observe(record.group, record.batch, record.seconds, record.context, self.profile)
        elif self.profile and decode and len(record.group) in self.profile.tp_sizes:
            self.profile.observe(len(record.group), record.batch, record.seconds, record.context)
        if self.controller is None or not self._generating():
            return
        self.controller.step()
        # Re-plan when the controller is due, and no sooner than PLAN_SPACING plans' durations after the last
        # one: a plan is ms of Python, CPU that the ranks need on a small host, so planning stays under
        # ~1/PLAN_SPACING of a core.
        if not self.controller.due(sum(self.gen.loads().values())) or time.perf_counter() < self._next_plan:
            return
        started = time.perf_counter()
        judged = len(self.controller.verdicts)
        decision = self.controller.decide(self.gen.layout, self.gen.running_lengths(), self.profile,
                                          self._predictor, self.costs)
        self._next_plan = started + PLAN_SPACING * (time.perf_counter() - started)
        for verdict in self.controller.verdicts[judged:]:
            log.info("%s", verdict.line)
            self.gen.metrics.guard_verdicts.labels("lost" if verdict.lost else "held").inc()
        if decision.layout is not None:
            self.controller.regrouped(self._apply(decision))

    def _apply(self, decision: Decision) -> float | None:
        """Applies a planned regroup; returns its seconds (the slowest rank's), None if it was not applied."""
        old = self.gen.layout
        try:
            reports = self.gen.regroup(decision.layout)
        except layouts.LayoutError as e:  # e.g. a block whose communicator failed earlier
            log.warning("planned regroup %s -> %s not applied: %s", old, decision.layout, e)
            return None
        applied = [r.seconds["total"] for r in reports if r.outcome == "applied"]
        seconds = max(applied) if applied and all(r.outcome in ("applied", "unchanged") for r in reports) else None
        log.info("regroup %s -> %s (epoch %d, %s%s) with %d request(s) unfinished: %s", old, self.gen.layout,
                 self.gen.epoch, _outcome(reports), f", {1e3 * seconds:.3g} ms" if seconds is not None else "",
                 sum(self.gen.loads().values()), decision.reason)
        return seconds

    # -- batches ----------------------------------------------------------------------------------------
    def _collect_finished(self) -> None:
        finished = self.gen.take_finished()
        batch = self._batch
        if not finished or batch is None:
            return
        for r in finished:
            batch.finished[r.id] = r
        if batch.done:
            lengths = [len(r.output) for r in batch.finished.values()]
            self._lengths.extend(lengths)
            metrics = self.gen.metrics
            for n in lengths:
                metrics.response_tokens.observe(n)
            metrics.batches.inc()
            metrics.batch_open.set(0)
            self._export_costs()  # the profile as refined during the batch
            log.info("batch %s done: %d responses, %d tokens", batch.batch_id, len(lengths), sum(lengths))
            self._publish(force=True)
            for notify in batch.watchers:
                notify()
            batch.watchers.clear()

    def _check_weights(self) -> None:
        if self._receiving is None or self.gen.weights_pending is not None:
            return
        if self.gen.policy_version == self._receiving:
            log.info("every rank holds the weights of version %d", self._receiving)
        else:  # PodState has no field for it: the trainer sees policy_version stay, the log says why
            log.error("the weights of version %d were refused, the ranks keep version %d: %s", self._receiving,
                      self.gen.policy_version, self.gen.weights_refused)
        self._receiving = None
        self._publish(force=True)

    def _request(self, r: RolloutRequest) -> Request:
        prompt = list(r.prompt_token_ids) if r.prompt_token_ids is not None else self.tokenizer.encode(r.prompt).ids
        s = r.sampling
        return Request(r.id, prompt, SamplingParams(
            max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
            stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos))

    def _status(self, batch: _Batch) -> BatchStatus:
        done = [batch.finished[i] for i in batch.ids] if batch.done else []
        completions = [Completion(id=r.id, token_ids=r.output, logprobs=r.logprobs, finish_reason=r.finish_reason,
                                  policy_version=batch.policy_version, text=self.tokenizer.decode(r.output))
                       for r in done]
        return BatchStatus(batch_id=batch.batch_id, done=batch.done, total=len(batch.ids),
                           finished=len(batch.finished), completions=completions)

    def _lookup(self, batch_id: str) -> _Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id!r} is unknown here: the pod keeps the open batch and the last "
                           f"{KEPT_BATCHES} finished ones")
        return batch

    def _refuse_while_busy(self, what: str) -> None:
        if self._generating():
            b = self._batch
            raise Conflict(f"{what}: batch {b.batch_id!r} is generating ({len(b.finished)}/{len(b.ids)} "
                           f"done); wait until GET /v1/rollouts/{b.batch_id} reports done")
        if self.gen.weights_pending is not None:
            raise Conflict(f"{what}: the ranks are receiving the weights of version {self.gen.weights_pending}; "
                           f"retry once GET /v1/state shows that policy_version")

    # -- commands (run on the thread, through post) ------------------------------------------------------
    def submit(self, rollouts: RolloutBatch) -> BatchStatus:
        """Starts generating a batch (one at a time: synchronous RLHF generates each batch with one policy). A
        batch with a request the engine can never generate (a prompt of maxSeq tokens or more, a token outside the
        vocabulary) is refused whole (422) even while another batch generates, which goes on: waiting would not
        help it."""
        requests = [self._request(r) for r in rollouts.requests]
        # The engine also refuses the id of an unfinished request: from a busy pod that is the 409 below instead
        # (e.g. the same batch sent again while it generates).
        if not (self._generating() and not {r.id for r in requests}.isdisjoint(self._batch.ids)):
            try:
                self.gen.check(requests)
            except ValueError as e:
                raise Invalid(str(e)) from None
        self._refuse_while_busy("a new batch")
        if not self.gen.memory_held:
            raise Conflict("the ranks have released their memory (POST /v1/sleep): POST /v1/wake_up before a batch")
        if rollouts.policy_version != self.gen.policy_version:
            raise Conflict(f"policy_version: the batch asks for version {rollouts.policy_version}, the pod holds "
                           f"version {self.gen.policy_version}; send the weights first (POST /v1/weights) or ask "
                           f"for {self.gen.policy_version}")
        max_tokens = max(r.params.max_tokens for r in requests)
        if self.controller is not None:
            self._predictor = LengthPredictor(max_tokens, prior=list(self._lengths))
            # Against the layout the last batch started in if it held (Controller.start_batch), not the last batch's
            # tail layout: nothing is cached at a boundary, so the margin must not keep a tail's merge for the bulk.
            decision = self.controller.start_batch(self.gen.world, [len(r.prompt) for r in requests], self.profile,
                                                   self._predictor, self.costs)
        else:  # the operator's plans are for a batch's tail: each batch starts in the base layout
            decision = Decision(None, 0.0, 0.0, 0.0, "a new batch starts in the base layout")
        target = decision.layout or self.gen.start_layout  # all TP=1, or the fixed layout
        if target != self.gen.layout:
            self._apply(replace(decision, layout=target))  # the pod is idle: nothing to move
        self.gen.submit(requests)
        self.gen.metrics.batch_open.set(1)
        self.gen.metrics.batch_max_tokens.set(max_tokens)
        batch = _Batch(rollouts.batch_id, rollouts.policy_version, [r.id for r in requests])
        self._batches.pop(batch.batch_id, None)
        self._batches[batch.batch_id] = self._batch = batch
        while len(self._batches) > KEPT_BATCHES + 1:  # + the open one
            self._batches.popitem(last=False)
        log.info("batch %s: %d requests, policy version %d, layout %s", batch.batch_id, len(requests),
                 batch.policy_version, self.gen.layout)
        return self._status(batch)

    def status(self, batch_id: str) -> BatchStatus:
        return self._status(self._lookup(batch_id))

    def watch(self, batch_id: str, notify: Callable[[], None]) -> None:
        """Calls `notify()` (on this thread) once the batch is done: at once if it is."""
        batch = self._lookup(batch_id)
        if batch.done:
            notify()
        else:
            batch.watchers.append(notify)

    def regroup(self, plan: RegroupPlan) -> RegroupAck:
        """Applies an operator's plan at the next step boundary of the groups it changes."""
        if self.config.controller != "operator":
            raise Conflict("this pod plans its own regroups (adaptiveTP.controller=pod); set adaptiveTP.controller"
                           "=operator for the operator's plans to apply")
        if self.config.tp > 1:
            raise Conflict(f"this pod runs a fixed layout {list(self.gen.start_layout)} (generator.tensorParallelSize"
                           f"={self.config.tp}, adaptive TP off): it takes no plans")
        if self.gen.weights_pending is not None:
            raise Conflict(f"the ranks are receiving the weights of version {self.gen.weights_pending}; retry once "
                           f"GET /v1/state shows that policy_version")
        if not self.gen.memory_held:
            raise Conflict("the ranks have released their memory (POST /v1/sleep): plans apply after POST /v1/wake_up")
        if (retry := check_plan(plan, self.gen.epoch, list(self.gen.layout), self._last_ack)) is not None:
            return retry
        try:
            reports = self.gen.regroup(plan.layout, epoch=plan.epoch)
        except ValueError as e:  # LayoutError included
            raise Invalid(f"layout: {e}") from None
        changed = [r for r in reports if r.outcome in ("applied", "fallback")]
        moved: dict[str, int] = {}
        for r in changed:
            for mode, count in r.modes.items():
                moved[mode] = moved.get(mode, 0) + count
        self._last_ack = RegroupAck(
            applied_epoch=self.gen.epoch, layout=list(self.gen.layout), outcome=_outcome(reports), requests=moved,
            seconds=max((r.seconds.get("total", 0.0) for r in changed), default=0.0),
            error=next((r.error for r in reports if r.error), None))
        log.info("regroup to %s (epoch %d, %s): the operator's plan", self.gen.layout, self.gen.epoch,
                 self._last_ack.outcome)
        return self._last_ack

    def update_weights(self, update: WeightUpdate) -> PodState:
        """Sends the ranks into the trainer's weight broadcast; policy_version follows once all of them hold it."""
        self._refuse_while_busy("new weights")
        check_weight_update(update, self.gen.policy_version, self.gen.world)
        self.gen.update_weights(update.version, update.address, update.world, update.rank_offset, update.backend,
                                update.transport, self.token)
        self._receiving = update.version
        if update.transport == "device":
            log.info("receiving the weights of version %d from the trainer ranks on the pod's devices", update.version)
        else:
            log.info("receiving the weights of version %d from %s (ranks %d..%d of %d)", update.version,
                     update.address, update.rank_offset, update.rank_offset + self.gen.world - 1, update.world)
        return self._snapshot()

    def sleep(self, level: int = 1) -> PodState:
        """Between batches: the ranks give back their KV pools and step memory (placement colocated: the trainer
        ranks on the same devices train in it). Level 1 keeps the weights; level 2 gives them back too, for a caller
        that sends the next version before waking the pod (vLLM's sleep levels)."""
        if level not in SLEEP_LEVELS:
            raise Invalid(f"level: {level} is not a sleep level; use 1 (keep the weights) or 2 (release them too)")
        self._refuse_while_busy("sleep")
        if self.gen.memory_held:
            self.gen.set_memory(False, weights=level == 2)
            log.info("memory released (level %d): %s", level, _sizes(self.gen.memory_bytes))
        elif level == 2 and self.gen.weights_held:
            raise Conflict("level: the pod sleeps at level 1, its weights held; POST /v1/wake_up, then sleep at "
                           "level 2")
        return self._snapshot()

    def wake_up(self) -> PodState:
        """The ranks take their KV pools back, every block free."""
        self._refuse_while_busy("wake up")
        if not self.gen.weights_held:
            raise Conflict(f"the ranks released their weights (POST /v1/sleep?level=2): POST /v1/weights with version "
                           f"{self.gen.policy_version + 1} or later before waking the pod")
        if not self.gen.memory_held:
            self.gen.set_memory(True)
            log.info("memory taken back: %s", _sizes(self.gen.memory_bytes))
        return self._snapshot()


def _outcome(reports) -> Literal["applied", "unchanged", "fallback"]:
    outcomes = {r.outcome for r in reports}
    if outcomes & {"fallback", "rejected"}:
        return "fallback"
    return "applied" if "applied" in outcomes else "unchanged"


def _sizes(per_rank: dict[int, int]) -> str:
    return ", ".join(f"rank {r} {n / (1 << 20):.0f} MiB" for r, n in sorted(per_rank.items()))


def _itemsize(options: EngineOptions) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[options.dtype]


def _read_profile(path: str) -> Profile:
    try:
        return Profile.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:
        raise ValueError(f"--profile {path}: {e}; give the JSON that Profile.to_json (or the engine's Costs.to_json) "
                         f"writes") from None
