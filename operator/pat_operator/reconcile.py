"""The RLHFJob state machine, pure: from what is observed (the job, its pods, the time) to what to do.

`decide()` is level-based: it looks only at the current state, so running it twice, or after an operator restart,
does no harm. Conditions are the one source of truth; the phase is derived from them. The rules:

- An invalid spec fails the job (InvalidSpec), naming each bad field; nothing is created. So does a tiny model
  that cannot fit the GPUs its pods select (fit.require_fit). A change of any spec field but runPolicy once the
  job has started fails it too (ImmutableFieldChanged).
- Succeeded and Failed are terminal and sticky: afterwards only live pods are deleted (finished ones are kept
  for their logs) and, with ttlSecondsAfterFinished, the job itself is deleted when that time has passed.
- suspend deletes the pods and keeps the status; resuming creates the next pods (from the last checkpoint).
- activeDeadlineSeconds counts from the start (a resume restarts the clock, as for a Kubernetes Job).
- The pods of an attempt are one gang: created together, Running only when all are ready. When any pod fails
  (or disappears once the gang has started), every pod of the attempt is deleted and, after an exponential
  backoff, all are created again as the next attempt -- up to runPolicy.backoffLimit restarts, then Failed.
- The job succeeds when every trainer pod has exited 0; the generators are then deleted.
- A pod still Terminating runPolicy.podDeletionTimeoutSeconds after its grace period (its node is lost) is
  force-deleted, with a PodForceDeleted event, so the next attempt does not wait for it forever.
- A generator pod whose requests (running + waiting, from Prometheus) go from none to some posts GeneratorQueue.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from . import builders, fit
from . import metric_names as names
from .api import Condition, GeneratorPodStatus, JobSpecError, RLHFJob, RLHFJobStatus, RunPolicy, parse_job
from .layout import describe

# Condition types, in the order in which they decide the phase.
FAILED, SUCCEEDED, SUSPENDED, RESTARTING, RUNNING, CREATED = (
    "Failed", "Succeeded", "Suspended", "Restarting", "Running", "Created")
METRICS_AVAILABLE, REGROUPING = "MetricsAvailable", "Regrouping"  # controller operator only; not phases
PHASE_OF = {FAILED: "Failed", SUCCEEDED: "Succeeded", SUSPENDED: "Suspended", RESTARTING: "Restarting",
            RUNNING: "Running"}


@dataclass(frozen=True)
class PodView:
    """What the state machine needs to know of one pod."""
    name: str
    role: str
    index: int
    attempt: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool
    deletion: datetime | None  # the deletionTimestamp: when its grace period ends (None: not being deleted)
    started: bool  # a container has run (so the gang has started)
    failure: str | None  # why the pod failed, for people
    ip: str | None = None
    waiting: str | None = None  # why it is not running yet (unschedulable, image pull, ...), for people

    @property
    def deleting(self) -> bool:
        return self.deletion is not None


def pod_view(pod: dict[str, Any]) -> PodView:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    labels = meta.get("labels", {})
    containers = status.get("containerStatuses") or []
    failure = None
    for c in (status.get("initContainerStatuses") or []) + containers:
        term = (c.get("state") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            # The message's last line: a worker's log tail (FallbackToLogsOnError) ends with why it failed.
            last = (term.get("message") or "").strip().rpartition("\n")[2]
            failure = f"container {c['name']} exited with code {term['exitCode']}" + "".join(
                f" ({v})" for v in (term.get("reason"), last) if v)
            break
    phase = status.get("phase", "Pending")
    if phase == "Failed" and failure is None:
        failure = status.get("message") or status.get("reason") or "the pod failed"
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    waiting = next((f"{c.get('reason')}: {c.get('message')}" for c in conditions
                    if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    for c in containers:
        w = (c.get("state") or {}).get("waiting")
        if waiting is None and w and w.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            waiting = f"{c['name']}: {w['reason']}" + (f": {w['message']}" if w.get("message") else "")
    started = any({"running", "terminated"} & set(c.get("state") or {}) for c in containers)
    deletion = meta.get("deletionTimestamp")
    return PodView(name=meta["name"], role=labels.get(builders.LABEL_ROLE, ""),
                   index=int(labels.get(builders.LABEL_INDEX, -1)), attempt=int(labels.get(builders.LABEL_ATTEMPT, -1)),
                   phase=phase, ready=ready and phase == "Running",
                   deletion=_time(deletion) if deletion else None, started=started, failure=failure,
                   ip=status.get("podIP"), waiting=waiting)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: dict[str, Any]  # the whole new status (camelCase); written only if it differs from the old one
    ensure: list[dict[str, Any]] = field(default_factory=list)  # children that must exist (created once)
    create_pods: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    # Stuck Terminating: deleted without a grace period, each with its PodForceDeleted event's message (posted only
    # by the delete that removed it: the watch may show the pod once more after that).
    force_delete_pods: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    wake_after: float | None = None  # seconds until something is due (a backoff, a deadline, a TTL)


@dataclass(frozen=True)
class Settings:
    restart_backoff_seconds: float = 10.0  # the first restart waits this long, each next one twice as long
    restart_backoff_max_seconds: float = 300.0


@dataclass(frozen=True)
class MetricsState:
    """What the operator's autoscaler last made of Prometheus (controller operator): the MetricsAvailable
    condition."""
    status: str  # True | False
    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    body: dict[str, Any]  # the RLHFJob as the API server has it
    pods: list[PodView]
    now: datetime
    token: str
    iteration: int | None = None  # the trainer's last completed iteration, if it could be read
    generators: dict[str, GeneratorPodStatus] = field(default_factory=dict)  # by pod name, from the pods
    errors: tuple[str, ...] = ()  # what the API server refused when the last decision was carried out
    metrics: MetricsState | None = None  # controller operator: None until the autoscaler first read Prometheus
    regrouping: tuple[str, ...] = ()  # generator pods with a regroup plan in flight


def restart_backoff(restarts: int, settings: Settings) -> float:
    return min(settings.restart_backoff_seconds * 2 ** max(restarts - 1, 0), settings.restart_backoff_max_seconds)


def parse_body(body: dict[str, Any]) -> RLHFJob:
    """The job's spec as the models read it (the API server's metadata and status left out); JobSpecError names
    each bad field. A job without spec.placement runs as its status says it started (status.placement); one that an
    operator from before placement existed already ran (a specHash, no status.placement) stays separate, the only
    placement there was: a new default must not move a running job's pods."""
    meta, spec, status = body["metadata"], body.get("spec"), body.get("status") or {}
    if isinstance(spec, dict) and "placement" not in spec:
        started = status.get("placement") or ("separate" if status.get("specHash") else None)
        spec = {**spec, "placement": started} if started else spec
    return parse_job({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                      "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
                      "spec": spec}, f"{meta.get('namespace')}/{meta['name']}")


def decide(obs: Observed, settings: Settings = Settings()) -> Decision:
    meta = obs.body["metadata"]
    generation = meta.get("generation")
    status = RLHFJobStatus.model_validate(obs.body.get("status") or {})
    book = _Book(status, obs.now, generation)
    try:
        job = parse_body(obs.body)
        fit.require_fit(job.spec, f"{meta.get('namespace')}/{meta['name']}")  # a tiny model on known GPUs
    except JobSpecError as e:
        live = [p.name for p in obs.pods if not p.deleting and p.phase not in ("Succeeded", "Failed")]
        if not book.true(FAILED):
            book.set(FAILED, "True", "InvalidSpec", str(e), Event("Warning", "InvalidSpec", str(e)))
        return _force_stuck(book.decision(delete_pods=live), obs, RunPolicy().pod_deletion_timeout_seconds)
    return _force_stuck(_decide(job, obs, book, settings), obs, job.spec.run_policy.pod_deletion_timeout_seconds)


def _force_stuck(d: Decision, obs: Observed, timeout: int) -> Decision:
    """A pod on a lost node stays Terminating forever (no kubelet confirms its deletion), and the next attempt
    waits for the last one's pods to be gone: past the timeout such a pod is force-deleted."""
    for p in obs.pods:
        if p.deletion is None:
            continue
        over = (obs.now - p.deletion).total_seconds()
        if over < timeout:
            d.wake_after = min(w for w in (d.wake_after, timeout - over) if w is not None)
            continue
        d.force_delete_pods[p.name] = (
            f"pod {p.name} was still Terminating {over:.0f} s after its grace period ended (runPolicy."
            f"podDeletionTimeoutSeconds={timeout}): its node is likely lost; force-deleted from the API server, "
            f"its processes may still run there until the node is back")
    return d


def _decide(job: RLHFJob, obs: Observed, book: _Book, settings: Settings) -> Decision:
    spec, status, now, uid = job.spec, book.status, obs.now, obs.body["metadata"]["uid"]
    policy = spec.run_policy
    alive = [p for p in obs.pods if not p.deleting]

    if book.true(FAILED) or book.true(SUCCEEDED):  # terminal: sticky
        live = [p.name for p in alive if p.phase not in ("Succeeded", "Failed")]
        ttl = policy.ttl_seconds_after_finished
        if ttl is not None and status.completion_time:
            left = (_time(status.completion_time) + timedelta(seconds=ttl) - now).total_seconds()
            if left <= 0:
                book.events.append(Event("Normal", "TTLExpired", f"deleting the job {ttl} s after it finished"))
                return book.decision(delete_pods=live, delete_job=True)
            return book.decision(delete_pods=live, wake_after=left)
        return book.decision(delete_pods=live)

    digest = spec_hash(job)
    # A hash without the prefix was taken by an operator before SPEC_HASH_PREFIX, over the defaults of its release:
    # it cannot be compared, so it is taken over. CEL refuses such an edit on Kubernetes >= 1.25; older servers don't.
    if status.spec_hash not in (None, digest) and status.spec_hash.startswith(SPEC_HASH_PREFIX):
        msg = ("a spec field other than runPolicy changed while the job ran; they are immutable: delete and "
               "re-create the job")
        book.finish(FAILED, "ImmutableFieldChanged", msg, Event("Warning", "ImmutableFieldChanged", msg))
        return book.decision(delete_pods=[p.name for p in alive])
    book.fields["specHash"] = digest
    book.fields["placement"] = spec.placement
    if obs.iteration is not None:
        book.fields["iteration"] = obs.iteration
    ensure = builders.job_objects(job, uid, obs.token)

    if policy.suspend:
        if not book.true(SUSPENDED):
            book.set(SUSPENDED, "True", "Suspended", "runPolicy.suspend is true: the pods are deleted, the status "
                     "is kept", Event("Normal", "Suspended", f"deleting {len(alive)} pod(s)"))
            book.set(RUNNING, "False", "Suspended", "suspended")
        return book.decision(ensure=ensure, delete_pods=[p.name for p in alive])
    if book.true(SUSPENDED):
        if obs.pods:  # the suspended gang's pods must be gone first: they are not failures of the next one
            return book.decision(ensure=ensure, delete_pods=[p.name for p in alive], wake_after=1.0)
        book.set(SUSPENDED, "False", "Resumed", "runPolicy.suspend is false again",
                 Event("Normal", "Resumed", "creating the pods again; the trainer resumes from its checkpoint"))
        book.fields["startTime"] = None  # the deadline counts from the resume

    start = book.fields.get("startTime", status.start_time)
    deadline = policy.active_deadline_seconds
    wake_after = None
    if deadline is not None and start:
        left = (_time(start) + timedelta(seconds=deadline) - now).total_seconds()
        if left <= 0:
            msg = f"the job ran longer than runPolicy.activeDeadlineSeconds={deadline}"
            book.finish(FAILED, "DeadlineExceeded", msg, Event("Warning", "DeadlineExceeded", msg))
            return book.decision(delete_pods=[p.name for p in alive])
        wake_after = left

    attempt = status.restarts
    current = {p.name: p for p in obs.pods if p.attempt == attempt}
    stale = [p for p in obs.pods if p.attempt != attempt]
    if stale:  # an earlier attempt's pods (or the failed gang's) must be gone before the next gang starts
        return book.decision(ensure=ensure, delete_pods=[p.name for p in stale if not p.deleting],
                             wake_after=1.0)

    expected = {builders.pod_name(job, role, i): (role, i) for role, i in builders.expected_pods(job)}
    started = any(p.started for p in current.values())
    failed = [p for p in current.values() if p.phase == "Failed" or p.deleting]
    failed += [_gone(name) for name in expected if name not in current and started]
    if failed:
        why = "; ".join(f"{p.name}: {p.failure}" for p in failed)
        if attempt >= policy.backoff_limit:
            msg = f"{why}; {attempt} restart(s) reached runPolicy.backoffLimit={policy.backoff_limit}"
            book.finish(FAILED, "BackoffLimitExceeded", msg, Event("Warning", "BackoffLimitExceeded", msg))
            return book.decision(delete_pods=[p.name for p in alive])
        book.fields["restarts"] = attempt + 1
        delay = restart_backoff(attempt + 1, settings)
        book.set(RESTARTING, "True", "PodFailed", f"restart {attempt + 1} of at most {policy.backoff_limit} in "
                 f"{delay:g} s: {why}")
        book.events.append(Event("Warning", "GangRestart", f"restart {attempt + 1} in {delay:g} s: {why}"))
        book.set(RUNNING, "False", "PodFailed", why)
        return book.decision(ensure=ensure, delete_pods=[p.name for p in alive], wake_after=delay)

    trainers = [p for p in current.values() if builders.serves(p.role, "trainer")]
    expected_trainers = sum(builders.serves(role, "trainer") for role, _ in expected.values())
    if len(trainers) == expected_trainers and all(p.phase == "Succeeded" for p in trainers):
        msg = f"the trainer finished {spec.algorithm.iterations} iterations"
        book.fields["iteration"] = spec.algorithm.iterations  # a trainer exits 0 only after the last one
        book.finish(SUCCEEDED, "TrainerSucceeded", msg, Event("Normal", "Succeeded", msg))
        return book.decision(delete_pods=[p.name for p in alive if p.phase not in ("Succeeded", "Failed")])

    missing = [name for name in expected if name not in current]
    if missing and book.true(RESTARTING):
        restarted = _time(book.condition(RESTARTING).last_transition_time)
        left = (restarted + timedelta(seconds=restart_backoff(attempt, settings)) - now).total_seconds()
        if left > 0:
            return book.decision(ensure=ensure, wake_after=left)
    create = [builders.pod(job, uid, *expected[name], attempt) for name in missing]
    if obs.errors:  # e.g. a quota or an admission webhook refused a pod: say so rather than look Pending
        why = "; ".join(obs.errors)
        book.set(CREATED, "False", "CreateFailed", why, Event("Warning", "CreateFailed", why))
    elif create:
        book.set(CREATED, "True", "PodsCreated", f"attempt {attempt}: {len(expected)} pod(s)")
        book.fields["startTime"] = start or stamp(now)

    ready = sum(1 for name in expected if name in current and current[name].ready)
    if ready == len(expected):
        if not book.true(RUNNING):
            book.set(RUNNING, "True", "AllPodsReady", f"{ready} of {len(expected)} pods ready",
                     Event("Normal", "Running", f"attempt {attempt}: all {ready} pods ready"))
        if book.true(RESTARTING):
            book.set(RESTARTING, "False", "GangRecreated", f"attempt {attempt} is running")
    else:
        stuck = next((f"; {p.name}: {p.waiting}" for p in current.values() if p.waiting), "")
        book.set(RUNNING, "False", "WaitingForPods", f"{ready} of {len(expected)} pods ready{stuck}")
    if obs.metrics is not None:
        m = obs.metrics
        book.set(METRICS_AVAILABLE, m.status, m.reason, m.message,
                 Event("Warning", "MetricsUnavailable", m.message) if m.status == "False" else None)
        book.set(REGROUPING, "True" if obs.regrouping else "False", "PlanInFlight" if obs.regrouping else "Idle",
                 f"a regroup plan is in flight to {', '.join(obs.regrouping)}" if obs.regrouping else
                 "no regroup plan in flight")
    generators = [obs.generators.get(name) or _previous(status, name)
                  for name in expected if builders.serves(expected[name][0], "generator")]
    book.events += [e for g in generators if (e := queue_event(_previous(status, g.pod), g, spec.generator.engine))]
    book.fields["generators"] = [g.model_dump(by_alias=True, exclude_none=True) for g in generators]
    return book.decision(ensure=ensure, create_pods=create, wake_after=wake_after)


SPEC_HASH_PREFIX = "w1:"  # hashes of what the user wrote


def spec_hash(job: RLHFJob) -> str:
    """The hash of the spec as the user wrote it, runPolicy aside (the CRD has no schema defaults: the stored object
    holds only what was written). Defaults are left out, so an operator release that adds a field or changes a
    default keeps every running job's hash."""
    spec = job.spec.model_dump(by_alias=True, exclude={"run_policy"}, exclude_unset=True)
    return SPEC_HASH_PREFIX + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def phase_of(conditions: list[Condition]) -> str:
    true = {c.type for c in conditions if c.status == "True"}
    for kind, phase in PHASE_OF.items():
        if kind in true:
            return phase
    return "Pending"


QUEUE_SOURCES = {"pat": names.GENERATOR_REQUESTS_RUNNING.removesuffix("running") + "*",
                 "vllm": names.VLLM_REQUESTS_RUNNING.removesuffix("running") + "*"}


def queue_event(old: GeneratorPodStatus, new: GeneratorPodStatus, engine: str) -> Event | None:
    """GeneratorQueue, when a generator pod goes from idle (no request running or waiting, or none known) to busy:
    once per busy spell, not on every observation."""
    def load(g: GeneratorPodStatus) -> int:
        return (g.running or 0) + (g.waiting or 0)

    if load(new) == 0 or load(old) > 0:
        return None
    shown = ["?" if n is None else str(n) for n in (new.running, new.waiting)]
    return Event("Normal", "GeneratorQueue", f"pod {new.pod}: {shown[0]} running, {shown[1]} waiting "
                                             f"({QUEUE_SOURCES.get(engine, engine)})")


def tp_summary(generators: list[dict[str, Any]]) -> str:
    """The TP layouts of the generator pods, e.g. '2+1+1 4' (one layout per pod)."""
    return " ".join(describe(g["layout"]) for g in generators if g.get("layout"))


class _Book:
    """The new status, built up from the old one: conditions change only when their status, reason or message
    does (lastTransitionTime only when the status does), and every transition can post an event."""

    def __init__(self, status: RLHFJobStatus, now: datetime, generation: int | None):
        self.status, self.now, self.generation = status, now, generation
        self.conditions = {c.type: c for c in status.conditions}
        self.fields: dict[str, Any] = {}
        self.events: list[Event] = []

    def true(self, kind: str) -> bool:
        c = self.conditions.get(kind)
        return c is not None and c.status == "True"

    def condition(self, kind: str) -> Condition:
        return self.conditions[kind]

    def set(self, kind: str, status: str, reason: str, message: str, event: Event | None = None) -> None:
        old = self.conditions.get(kind)
        if old is not None and (old.status, old.reason, old.message) == (status, reason, message):
            return
        changed = old is None or old.status != status
        self.conditions[kind] = Condition(
            type=kind, status=status, reason=reason, message=message, observed_generation=self.generation,
            last_transition_time=stamp(self.now) if changed else old.last_transition_time)
        if event is not None and changed:
            self.events.append(event)

    def finish(self, kind: str, reason: str, message: str, event: Event) -> None:
        self.set(kind, "True", reason, message, event)
        for other in (RUNNING, RESTARTING):
            if other in self.conditions:
                self.set(other, "False", reason, message)
        self.fields["completionTime"] = stamp(self.now)

    def decision(self, **kwargs: Any) -> Decision:
        new = {**self.status.model_dump(by_alias=True, exclude_none=True), **self.fields}
        conditions = list(self.conditions.values())
        new["conditions"] = [c.model_dump(by_alias=True, exclude_none=True) for c in conditions]
        new["phase"] = phase_of(conditions)
        new["observedGeneration"] = self.generation
        new["tp"] = tp_summary(new.get("generators", []))
        kwargs.setdefault("events", []).extend(self.events)
        # No empty strings: the v1.20 server reads "" in a merge patch as null (and refuses it for a string).
        return Decision(status={k: v for k, v in new.items() if v not in (None, "")}, **kwargs)


def _gone(name: str) -> PodView:
    return PodView(name, "", -1, -1, "Failed", False, None, True, "the pod was deleted")


def _previous(status: RLHFJobStatus, pod: str) -> GeneratorPodStatus:
    return next((g for g in status.generators if g.pod == pod), GeneratorPodStatus(pod=pod))


def stamp(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
