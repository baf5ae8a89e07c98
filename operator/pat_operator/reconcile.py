"""The RLHFJob state machine, pure: from what is observed (the job, its pods, the time) to what to do.

`decide()` is level-based: it looks only at the current state, so running it twice, or after an operator restart,
does no harm. Conditions are the one source of truth; the phase is derived from them. The rules, each a step below:

- An invalid spec fails the job (InvalidSpec), naming each bad field; nothing is created. So does a tiny model
  that cannot fit the GPUs its pods select (fit.require_fit), and a pod field that grants host access unless the
  operator allows it. A change of any spec field but runPolicy once the job has started fails it too
  (ImmutableFieldChanged).
- Succeeded and Failed are terminal and sticky: afterwards only live pods are deleted (finished ones are kept
  for their logs) and, with ttlSecondsAfterFinished, the job itself is deleted when that time has passed.
- suspend deletes the pods and keeps the status; resuming creates the next pods (from the last checkpoint).
- activeDeadlineSeconds counts from the start (a resume restarts the clock, as for a Kubernetes Job).
- Only pods owned by this job's uid are its own: a job deleted and re-created under the same name never takes the
  old one's pods (still terminating) for its own. Every pod name is unique per uid, attempt and incarnation.
- The pods of an attempt are one gang: created together, Running only when all are ready. A failed pod (or one
  that disappears) is classified by runPolicy.podFailurePolicy, then the built-in rules: a DisruptionTarget
  condition (preemption, eviction, a drain, a lost node) is Ignored: the gang restarts without using backoffLimit;
  the workers' configuration exit code (2) fails the job at once; anything else Counts against backoffLimit.
- A generator pod that fails while every trainer pod is healthy (placement separate) is restarted alone: the
  trainer re-sends its requests and weights. Otherwise every pod of the attempt is deleted and, after an
  exponential backoff, all are created again as the next attempt.
- With runPolicy.schedulingTimeoutSeconds, a gang not fully scheduled in time releases its pods and tries again
  after a backoff, so two half-placed gangs cannot wait for each other forever.
- The job succeeds when every trainer pod has exited 0; the generators are then deleted.
- A pod still Terminating runPolicy.podDeletionTimeoutSeconds after its grace period (its node is lost) is
  force-deleted once; PodForceDeleted is posted when it is gone. A finalizer that still holds it is reported once
  (PodHeldByFinalizer), not fought, and the next attempt does not wait for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from . import builders, fit
from . import metric_names as names
from .api import (CONFIG_EXIT_CODE, Condition, ExitCodes, ForceDeleted, GeneratorPodStatus, JobSpecError,
                  PodConditionPattern, PodFailurePolicy, PodFailureRule, RLHFJob, RLHFJobStatus, RunPolicy,
                  parse_job, require_unprivileged)
from .layout import describe

# Condition types, in the order in which they decide the phase.
FAILED, SUCCEEDED, SUSPENDED, RESTARTING, RUNNING, CREATED = (
    "Failed", "Succeeded", "Suspended", "Restarting", "Running", "Created")
SCHEDULED = "Scheduled"  # not a phase
METRICS_AVAILABLE, REGROUPING = "MetricsAvailable", "Regrouping"  # controller operator only; not phases
PHASE_OF = {FAILED: "Failed", SUCCEEDED: "Succeeded", SUSPENDED: "Suspended", RESTARTING: "Restarting",
            RUNNING: "Running"}
DISRUPTION = "DisruptionTarget"
# After the user's rules: disruptions do not count, a configuration error is not retried.
BUILTIN_RULES = (PodFailureRule(action="Ignore", on_pod_conditions=[PodConditionPattern(type=DISRUPTION)]),
                 PodFailureRule(action="FailJob", on_exit_codes=ExitCodes(values=[CONFIG_EXIT_CODE])))


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
    owner: str | None = None  # the uid of its controller (the job)
    incarnation: int = 0
    exit_codes: tuple[tuple[str, int], ...] = ()  # (container, code) of each container that exited non-zero
    conditions: tuple[tuple[str, str], ...] = ()  # (type, status)
    scheduled: bool = False
    finalizers: tuple[str, ...] = ()

    @property
    def deleting(self) -> bool:
        return self.deletion is not None

    @property
    def slot(self) -> tuple[str, int]:
        return self.role, self.index


def pod_view(pod: dict[str, Any]) -> PodView:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    labels = meta.get("labels", {})
    containers = status.get("containerStatuses") or []
    failure, exit_codes = None, []
    for c in (status.get("initContainerStatuses") or []) + containers:
        term = (c.get("state") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            exit_codes.append((c["name"], term["exitCode"]))
            # The message's last line: a worker's log tail (FallbackToLogsOnError) ends with why it failed.
            last = (term.get("message") or "").strip().rpartition("\n")[2]
            failure = failure or f"container {c['name']} exited with code {term['exitCode']}" + "".join(
                f" ({v})" for v in (term.get("reason"), last) if v)
    phase = status.get("phase", "Pending")
    conditions = status.get("conditions") or []
    if status.get("reason") == "Evicted":  # the kubelet's eviction on clusters before 1.26 (no DisruptionTarget)
        conditions = [*conditions, {"type": DISRUPTION, "status": "True", "reason": "TerminationByKubelet",
                                    "message": status.get("message", "")}]
    disruption = next((c for c in conditions if c.get("type") == DISRUPTION and c.get("status") == "True"), None)
    if disruption is not None:
        failure = (f"disrupted ({disruption.get('reason')}: {disruption.get('message', '')})"
                   + (f"; {failure}" if failure else ""))
    if phase == "Failed" and failure is None:
        failure = status.get("message") or status.get("reason") or "the pod failed"
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    waiting = next((f"{c.get('reason')}: {c.get('message')}" for c in conditions
                    if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    for c in containers:
        w = (c.get("state") or {}).get("waiting")
        if waiting is None and w and w.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            waiting = f"{c['name']}: {w['reason']}" + (f": {w['message']}" if w.get("message") else "")
    started = any({"running", "terminated"} & set(c.get("state") or {}) for c in containers)
    deletion = meta.get("deletionTimestamp")
    owner = next((r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    scheduled = bool((pod.get("spec") or {}).get("nodeName")) or any(
        c.get("type") == "PodScheduled" and c.get("status") == "True" for c in conditions)
    return PodView(name=meta["name"], role=labels.get(builders.LABEL_ROLE, ""),
                   index=int(labels.get(builders.LABEL_INDEX, -1)), attempt=int(labels.get(builders.LABEL_ATTEMPT, -1)),
                   phase=phase, ready=ready and phase == "Running",
                   deletion=_time(deletion) if deletion else None, started=started, failure=failure,
                   ip=status.get("podIP"), waiting=waiting, owner=owner,
                   incarnation=int(labels.get(builders.LABEL_INCARNATION, 0)), exit_codes=tuple(exit_codes),
                   conditions=tuple((c.get("type", ""), c.get("status", "")) for c in conditions),
                   scheduled=scheduled, finalizers=tuple(meta.get("finalizers") or ()))


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
    force_delete_pods: list[str] = field(default_factory=list)  # stuck Terminating: deleted without a grace period
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    wake_after: float | None = None  # seconds until something is due (a backoff, a deadline, a TTL)


@dataclass(frozen=True)
class Settings:
    restart_backoff_seconds: float = 10.0  # the first restart waits this long, each next one twice as long
    restart_backoff_max_seconds: float = 300.0
    allow_privileged_pods: bool = False  # hostPath, privileged, host namespaces, added capabilities in user fields
    allowed_host_paths: tuple[str, ...] = ()  # hostPath volumes under these directories are allowed
    network_policy_from: tuple[dict[str, Any], ...] | None = None  # None: no per-job NetworkPolicy


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
    pods: list[PodView]  # the pods labelled with the job's name (an older job of the same name's too)
    now: datetime
    token_key: bytes  # the operator's key, that the job's tokens are derived from
    iteration: int | None = None  # the trainer's last completed iteration, if it could be read
    generators: dict[str, GeneratorPodStatus] = field(default_factory=dict)  # by pod name, from the pods
    errors: tuple[str, ...] = ()  # what the API server refused when the last decision was carried out
    metrics: MetricsState | None = None  # controller operator: None until the autoscaler first read Prometheus
    regrouping: tuple[str, ...] = ()  # generator pods with a regroup plan in flight
    queue_events: tuple[Event, ...] = ()  # GeneratorQueue events of the last observation, each posted once


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
    status = RLHFJobStatus.model_validate(obs.body.get("status") or {})
    book = _Book(status, obs.now, meta.get("generation"))
    pods = [p for p in obs.pods if p.owner == meta["uid"]]  # an older job of the same name's are not ours
    try:
        job = parse_body(obs.body)
        fit.require_fit(job.spec, f"{meta.get('namespace')}/{meta['name']}")  # a tiny model on known GPUs
        if not settings.allow_privileged_pods:
            require_unprivileged(job.spec, f"{meta.get('namespace')}/{meta['name']}", settings.allowed_host_paths)
    except JobSpecError as e:
        timeout = RunPolicy().pod_deletion_timeout_seconds
        force, wake = _force_stuck(pods, book, obs.now, timeout)
        live = [p.name for p in pods if not p.deleting and p.phase not in ("Succeeded", "Failed")]
        if not book.true(FAILED):
            book.set(FAILED, "True", "InvalidSpec", str(e), Event("Warning", "InvalidSpec", str(e)))
        return book.decision(delete_pods=live, force_delete_pods=force, wake_after=wake)
    force, wake = _force_stuck(pods, book, obs.now, job.spec.run_policy.pod_deletion_timeout_seconds)
    d = _decide(job, obs, pods, book, settings)
    d.force_delete_pods = force
    d.wake_after = min((w for w in (d.wake_after, wake) if w is not None), default=None)
    return d


def _force_stuck(pods: list[PodView], book: _Book, now: datetime, timeout: int) -> tuple[list[str], float | None]:
    """A pod on a lost node stays Terminating forever (no kubelet confirms its deletion), and the next attempt
    must not wait for it: past the timeout it is force-deleted, once. PodForceDeleted is posted when it is gone; a
    finalizer that still holds it (another controller's) is reported once and left alone."""
    present = {p.name: p for p in pods}
    kept, force, wake = [], [], None
    for f in book.status.force_deleted:
        p = present.get(f.pod)
        if p is None:  # gone: now it can be said
            book.events.append(Event("Warning", "PodForceDeleted", f.message))
            continue
        if p.finalizers and not f.held:
            book.events.append(Event("Warning", "PodHeldByFinalizer", (
                f"pod {p.name} was force-deleted, but finalizer(s) {', '.join(p.finalizers)} still hold it; the "
                f"operator leaves other controllers' finalizers alone and does not wait for the pod")))
            f = f.model_copy(update={"held": True})
        elif not p.finalizers:
            force.append(p.name)  # the last force delete did not take (an API error): again, silently
        kept.append(f)
    held = {f.pod for f in kept}
    for p in pods:
        if p.deletion is None or p.name in held:
            continue
        over = (now - p.deletion).total_seconds()
        if over < timeout:
            wake = min(w for w in (wake, timeout - over) if w is not None)
            continue
        force.append(p.name)
        kept.append(ForceDeleted(pod=p.name, message=(
            f"pod {p.name} was still Terminating {over:.0f} s after its grace period ended (runPolicy."
            f"podDeletionTimeoutSeconds={timeout}): its node is likely lost; force-deleted from the API server, its "
            f"processes may still run there until the node is back")))
    if kept != book.status.force_deleted:
        book.fields["forceDeleted"] = [f.model_dump(by_alias=True) for f in kept]
    book.held = {f.pod for f in kept if f.held}
    return force, wake


@dataclass(frozen=True)
class Failure:
    pod: PodView
    action: str  # FailJob | Ignore | Count
    why: str  # for people


def classify(pod: PodView, policy: PodFailurePolicy) -> Failure:
    """The first rule (the user's, then the built-in ones) that matches the failed pod decides; none: Count."""
    why = pod.failure or ("deleted before it finished" if pod.deleting else "gone: it was deleted")
    for rule in (*policy.rules, *BUILTIN_RULES):
        if _matches(rule, pod):
            builtin = "" if rule in policy.rules else "built-in "
            return Failure(pod, rule.action, f"{pod.name}: {why} ({builtin}podFailurePolicy rule: {rule.action})")
    return Failure(pod, "Count", f"{pod.name}: {why}")


def _matches(rule: PodFailureRule, pod: PodView) -> bool:
    if rule.on_exit_codes is not None:
        codes = rule.on_exit_codes
        exits = [code for name, code in pod.exit_codes if codes.container_name in (None, name)]
        return any((code in codes.values) == (codes.operator == "In") for code in exits)
    return any((c.type, c.status) in pod.conditions for c in rule.on_pod_conditions)


@dataclass
class _Gang:
    """The current attempt's pods by slot (role, index), and the stale ones (older attempts or incarnations)."""
    uid: str
    attempt: int
    incarnations: dict[str, int]  # "role-index" -> the slot's incarnation in this attempt
    expected: list[tuple[str, int]]
    current: dict[tuple[str, int], PodView]
    stale: list[PodView]

    @classmethod
    def of(cls, job: RLHFJob, uid: str, book: _Book, pods: list[PodView]) -> _Gang:
        attempt = book.get("attempt")
        attempt = book.status.restarts if attempt is None else attempt
        incarnations, expected = dict(book.get("incarnations")), builders.expected_pods(job)
        current, stale = {}, []
        for p in pods:
            if p.attempt == attempt and p.slot in expected and p.incarnation == incarnations.get(_key(p.slot), 0):
                current[p.slot] = p
            else:
                stale.append(p)
        return cls(uid, attempt, incarnations, expected, current, stale)

    def name(self, job: RLHFJob, slot: tuple[str, int]) -> str:
        return builders.pod_name(job, self.uid, *slot, self.attempt, self.incarnations.get(_key(slot), 0))


def _key(slot: tuple[str, int]) -> str:
    return f"{slot[0]}-{slot[1]}"


def _decide(job: RLHFJob, obs: Observed, pods: list[PodView], book: _Book, settings: Settings) -> Decision:
    spec, uid = job.spec, obs.body["metadata"]["uid"]
    alive = [p for p in pods if not p.deleting]
    if book.true(FAILED) or book.true(SUCCEEDED):
        return _finished(spec.run_policy, alive, book)
    if (d := _spec_changed(job, alive, book)) is not None:
        return d
    if obs.iteration is not None:
        book.fields["iteration"] = obs.iteration
    ensure = builders.job_objects(job, uid, obs.token_key)
    if settings.network_policy_from is not None:
        ensure.append(builders.network_policy(job, uid, settings.network_policy_from))
    if (d := _suspension(spec.run_policy, pods, alive, book, ensure)) is not None:
        return d
    deadline, wake_after = _deadline(spec.run_policy, book, alive)
    if deadline is not None:
        return deadline

    gang = _Gang.of(job, uid, book, pods)
    book.fields.setdefault("attempt", gang.attempt)
    blocking = [p for p in gang.stale if p.name not in book.held]
    if blocking:  # an earlier attempt's pods (or a restarted generator's) must be gone before the next ones start
        return book.decision(ensure=ensure, delete_pods=[p.name for p in blocking if not p.deleting], wake_after=1.0)
    failures = _failures(job, gang, book)
    if failures:
        return _restart(job, gang, failures, alive, book, ensure, settings)
    if (d := _trainers_done(job, gang, alive, book)) is not None:
        return d
    if (d := _scheduling_timeout(job, gang, book, ensure, settings)) is not None:
        return d
    timeout, over = spec.run_policy.scheduling_timeout_seconds, _unscheduled_for(gang, book)
    if timeout is not None and over is not None:  # woken when the scheduling timeout is due
        wake_after = min(w for w in (wake_after, max(timeout - over, 0.05)) if w is not None)

    missing = [slot for slot in gang.expected if slot not in gang.current]
    not_before = book.get("nextAttemptTime")
    if missing and not_before and (left := (_time(not_before) - book.now).total_seconds()) > 0:
        return book.decision(ensure=ensure, wake_after=left)
    create = [builders.pod(job, uid, *slot, gang.attempt, gang.incarnations.get(_key(slot), 0)) for slot in missing]
    if obs.errors:  # e.g. a quota or an admission webhook refused a pod: say so rather than look Pending
        why = "; ".join(obs.errors)
        book.set(CREATED, "False", "CreateFailed", why, Event("Warning", "CreateFailed", why))
    elif create:
        book.set(CREATED, "True", "PodsCreated", f"attempt {gang.attempt}: {len(gang.expected)} pod(s)")
        book.fields["startTime"] = book.fields.get("startTime", book.status.start_time) or stamp(book.now)
        book.fields["attemptTime"] = stamp(book.now)
    _readiness(gang, book)
    _generators(job, gang, obs, book)
    return book.decision(ensure=ensure, create_pods=create, wake_after=wake_after)


def _finished(policy: RunPolicy, alive: list[PodView], book: _Book) -> Decision:
    """Terminal and sticky: live pods are deleted (finished ones kept for their logs); the TTL deletes the job."""
    live = [p.name for p in alive if p.phase not in ("Succeeded", "Failed")]
    ttl, done = policy.ttl_seconds_after_finished, book.status.completion_time
    if ttl is None or not done:
        return book.decision(delete_pods=live)
    left = (_time(done) + timedelta(seconds=ttl) - book.now).total_seconds()
    if left <= 0:
        book.events.append(Event("Normal", "TTLExpired", f"deleting the job {ttl} s after it finished"))
        return book.decision(delete_pods=live, delete_job=True)
    return book.decision(delete_pods=live, wake_after=left)


def _spec_changed(job: RLHFJob, alive: list[PodView], book: _Book) -> Decision | None:
    digest = spec_hash(job)
    old = book.status.spec_hash
    # A hash without the prefix was taken by an operator before SPEC_HASH_PREFIX, over the defaults of its release:
    # it cannot be compared, so it is taken over. CEL refuses such an edit on Kubernetes >= 1.25; older servers don't.
    if old not in (None, digest) and old.startswith(SPEC_HASH_PREFIX):
        msg = ("a spec field other than runPolicy changed while the job ran; they are immutable: delete and "
               "re-create the job")
        book.finish(FAILED, "ImmutableFieldChanged", msg, Event("Warning", "ImmutableFieldChanged", msg))
        return book.decision(delete_pods=[p.name for p in alive])
    book.fields["specHash"] = digest
    book.fields["placement"] = job.spec.placement
    return None


def _suspension(policy: RunPolicy, pods: list[PodView], alive: list[PodView], book: _Book,
                ensure: list[dict[str, Any]]) -> Decision | None:
    if policy.suspend:
        if not book.true(SUSPENDED):
            book.set(SUSPENDED, "True", "Suspended", "runPolicy.suspend is true: the pods are deleted, the status "
                     "is kept", Event("Normal", "Suspended", f"deleting {len(alive)} pod(s)"))
            book.set(RUNNING, "False", "Suspended", "suspended")
        return book.decision(ensure=ensure, delete_pods=[p.name for p in alive])
    if book.true(SUSPENDED):
        if pods:  # the suspended gang's pods must be gone first: they are not failures of the next one
            return book.decision(ensure=ensure, delete_pods=[p.name for p in alive], wake_after=1.0)
        book.set(SUSPENDED, "False", "Resumed", "runPolicy.suspend is false again",
                 Event("Normal", "Resumed", "creating the pods again; the trainer resumes from its checkpoint"))
        book.fields.update(startTime=None, pods=[], incarnations={}, attemptTime=None, nextAttemptTime=None)
        # startTime: the deadline counts from the resume
    return None


def _deadline(policy: RunPolicy, book: _Book, alive: list[PodView]) -> tuple[Decision | None, float | None]:
    start, deadline = book.fields.get("startTime", book.status.start_time), policy.active_deadline_seconds
    if deadline is None or not start:
        return None, None
    left = (_time(start) + timedelta(seconds=deadline) - book.now).total_seconds()
    if left > 0:
        return None, left
    msg = f"the job ran longer than runPolicy.activeDeadlineSeconds={deadline}"
    book.finish(FAILED, "DeadlineExceeded", msg, Event("Warning", "DeadlineExceeded", msg))
    return book.decision(delete_pods=[p.name for p in alive]), None


def _failures(job: RLHFJob, gang: _Gang, book: _Book) -> list[Failure]:
    """The current attempt's failed pods, each classified; a pod seen before and gone now failed too."""
    seen = set(book.get("pods"))
    book.fields["pods"] = sorted(seen | {p.name for p in gang.current.values()})
    failed = [p for p in gang.current.values() if p.phase == "Failed" or p.deleting]
    failed += [_gone(name, *slot) for slot in gang.expected if slot not in gang.current
               and (name := gang.name(job, slot)) and name in seen]
    return [classify(p, job.spec.run_policy.pod_failure_policy) for p in failed]


def _restart(job: RLHFJob, gang: _Gang, failures: list[Failure], alive: list[PodView], book: _Book,
             ensure: list[dict[str, Any]], settings: Settings) -> Decision:
    """FailJob fails the job; otherwise the failed generators restart alone while the trainer is healthy, or the
    whole gang restarts as the next attempt. Count uses backoffLimit, Ignore (a disruption) its own counter."""
    policy, status = job.spec.run_policy, book.status
    why = "; ".join(f.why for f in failures)
    if fatal := [f for f in failures if f.action == "FailJob"]:
        msg = "; ".join(f.why for f in fatal) + ": the job fails at once (retrying cannot help)"
        book.finish(FAILED, "PodFailurePolicy", msg, Event("Warning", "PodFailurePolicy", msg))
        return book.decision(delete_pods=[p.name for p in alive])
    counted = any(f.action == "Count" for f in failures)
    if counted and status.restarts >= policy.backoff_limit:
        msg = f"{why}; {status.restarts} restart(s) reached runPolicy.backoffLimit={policy.backoff_limit}"
        book.finish(FAILED, "BackoffLimitExceeded", msg, Event("Warning", "BackoffLimitExceeded", msg))
        return book.decision(delete_pods=[p.name for p in alive])
    n = (status.restarts if counted else status.disruptions) + 1
    book.fields["restarts" if counted else "disruptions"] = n
    delay = restart_backoff(status.restarts + status.disruptions + 1, settings)
    count = (f"restart {n} of at most {policy.backoff_limit}" if counted else
             f"disruption {n} (not counted against runPolicy.backoffLimit)")
    reason = "PodFailed" if counted else "Disruption"
    alone = _alone(job, gang, failures)
    if alone:
        for slot in alone:
            gang.incarnations[_key(slot)] = gang.incarnations.get(_key(slot), 0) + 1
        book.fields["incarnations"] = gang.incarnations
        book.fields["pods"] = [name for name in book.fields["pods"] if name not in {f.pod.name for f in failures}]
        book.fields["nextAttemptTime"] = stamp(book.now + timedelta(seconds=delay))
        pods = ", ".join(f.pod.name for f in failures)
        book.set(RESTARTING, "True", reason, f"{count}: {pods} alone in {delay:g} s, the trainer keeps running: {why}")
        book.events.append(Event("Warning", "GeneratorRestart", f"{count}: restarting {pods} alone in {delay:g} s "
                                 f"(the trainer re-sends its requests and weights): {why}"))
        return book.decision(ensure=ensure, delete_pods=[f.pod.name for f in failures if not f.pod.deleting],
                             wake_after=delay)
    _next_attempt(book, gang, delay)
    book.set(RESTARTING, "True", reason, f"{count} in {delay:g} s: {why}")
    book.events.append(Event("Warning", "GangRestart", f"{count} in {delay:g} s: {why}"))
    book.set(RUNNING, "False", reason, why)
    return book.decision(ensure=ensure, delete_pods=[p.name for p in alive], wake_after=delay)


def _alone(job: RLHFJob, gang: _Gang, failures: list[Failure]) -> list[tuple[str, int]]:
    """The failed generator slots that restart alone: only generators failed, and every trainer pod is running."""
    if job.spec.placement != "separate" or any(f.pod.role != "generator" for f in failures):
        return []
    trainers = [slot for slot in gang.expected if slot[0] == "trainer"]
    if not all((p := gang.current.get(slot)) and p.phase == "Running" and not p.deleting for slot in trainers):
        return []
    return [f.pod.slot for f in failures]


def _next_attempt(book: _Book, gang: _Gang, delay: float | None) -> None:
    book.fields.update(attempt=gang.attempt + 1, incarnations={}, pods=[], attemptTime=None,
                       nextAttemptTime=None if delay is None else stamp(book.now + timedelta(seconds=delay)))


def _trainers_done(job: RLHFJob, gang: _Gang, alive: list[PodView], book: _Book) -> Decision | None:
    trainers = [gang.current.get(slot) for slot in gang.expected if builders.serves(slot[0], "trainer")]
    if not all(p is not None and p.phase == "Succeeded" for p in trainers):
        return None
    msg = f"the trainer finished {job.spec.algorithm.iterations} iterations"
    book.fields["iteration"] = job.spec.algorithm.iterations  # a trainer exits 0 only after the last one
    book.finish(SUCCEEDED, "TrainerSucceeded", msg, Event("Normal", "Succeeded", msg))
    return book.decision(delete_pods=[p.name for p in alive if p.phase not in ("Succeeded", "Failed")])


def _unscheduled(gang: _Gang) -> list[PodView]:
    return [p for p in gang.current.values() if not p.scheduled and not p.deleting]


def _scheduling_timeout(job: RLHFJob, gang: _Gang, book: _Book, ensure: list[dict[str, Any]],
                        settings: Settings) -> Decision | None:
    """A gang not fully placed in time releases its pods (their requests go back to other jobs) and tries again
    after a backoff, not counted against backoffLimit."""
    if gang.current:
        waiting = _unscheduled(gang)
        book.set(SCHEDULED, "False" if waiting else "True", "WaitingForScheduling" if waiting else "AllPodsScheduled",
                 f"{len(gang.current) - len(waiting)} of {len(gang.expected)} pods scheduled")
    timeout, over = job.spec.run_policy.scheduling_timeout_seconds, _unscheduled_for(gang, book)
    if timeout is None or over is None or over < timeout:
        return None
    n = book.status.scheduling_timeouts + 1
    delay = restart_backoff(n, settings)
    names = ", ".join(p.name for p in _unscheduled(gang))
    msg = (f"the gang was not fully scheduled {over:.0f} s after its pods were created (runPolicy."
           f"schedulingTimeoutSeconds={timeout}; unscheduled: {names}): its pods are released, tried again in "
           f"{delay:g} s")
    book.fields["schedulingTimeouts"] = n
    _next_attempt(book, gang, delay)
    book.set(SCHEDULED, "False", "SchedulingTimeout", msg)
    book.events.append(Event("Warning", "SchedulingTimeout", msg))
    book.set(RUNNING, "False", "SchedulingTimeout", msg)
    return book.decision(ensure=ensure, delete_pods=[p.name for p in gang.current.values() if not p.deleting],
                         wake_after=delay)


def _unscheduled_for(gang: _Gang, book: _Book) -> float | None:
    """Seconds since the gang's pods were created, while one of them is unscheduled; None when all are placed."""
    since = book.get("attemptTime")
    return (book.now - _time(since)).total_seconds() if since and _unscheduled(gang) else None


def _readiness(gang: _Gang, book: _Book) -> None:
    ready = sum(1 for p in gang.current.values() if p.ready)
    total = len(gang.expected)
    if ready == total:
        if not book.true(RUNNING):
            book.set(RUNNING, "True", "AllPodsReady", f"{ready} of {total} pods ready",
                     Event("Normal", "Running", f"attempt {gang.attempt}: all {ready} pods ready"))
        if book.true(RESTARTING):
            book.set(RESTARTING, "False", "GangRecreated", f"attempt {gang.attempt} is running")
    else:
        stuck = next((f"; {p.name}: {p.waiting}" for p in gang.current.values() if p.waiting), "")
        book.set(RUNNING, "False", "WaitingForPods", f"{ready} of {total} pods ready{stuck}")


def _generators(job: RLHFJob, gang: _Gang, obs: Observed, book: _Book) -> None:
    """The autoscaler's view (MetricsAvailable, Regrouping) and each generator pod's layout; queue depths stay in
    metrics (a status write per change of a queue would be one every few seconds per busy job)."""
    if obs.metrics is not None:
        m = obs.metrics
        book.set(METRICS_AVAILABLE, m.status, m.reason, m.message,
                 Event("Warning", "MetricsUnavailable", m.message) if m.status == "False" else None)
        book.set(REGROUPING, "True" if obs.regrouping else "False", "PlanInFlight" if obs.regrouping else "Idle",
                 f"a regroup plan is in flight to {', '.join(obs.regrouping)}" if obs.regrouping else
                 "no regroup plan in flight")
    pods = [p.name for slot, p in gang.current.items() if builders.serves(slot[0], "generator")]
    generators = [obs.generators.get(name) or _previous(book.status, name) for name in pods]
    book.events += obs.queue_events
    book.fields["generators"] = [g.model_dump(by_alias=True, exclude_none=True, exclude={"running", "waiting"})
                                 for g in generators]


SPEC_HASH_PREFIX = "w1:"  # hashes of what the user wrote


def spec_hash(job: RLHFJob) -> str:
    """The hash of the spec as the user wrote it, runPolicy aside (the CRD has no schema defaults: the stored object
    holds only what was written). Defaults are left out, so an operator release that adds a field or changes a
    default keeps every running job's hash."""
    spec = job.spec.model_dump(by_alias=True, exclude={"run_policy"}, exclude_unset=True)
    return SPEC_HASH_PREFIX + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


ITERATION_WRITE_SECONDS = 30.0  # the trainer's progress alone is written at most this often


def needs_write(old: dict[str, Any] | None, new: dict[str, Any], seconds_since_write: float) -> bool:
    """Whether the new status is worth a write: a phase, condition, layout or counter changed; the trainer's
    iteration alone at most every ITERATION_WRITE_SECONDS (it rides along with every other write)."""
    old = old or {}
    if {k: v for k, v in new.items() if k != "iteration"} != {k: v for k, v in old.items() if k != "iteration"}:
        return True
    return new.get("iteration") != old.get("iteration") and seconds_since_write >= ITERATION_WRITE_SECONDS


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


_STATUS_FIELDS = {f.alias: name for name, f in RLHFJobStatus.model_fields.items()}


class _Book:
    """The new status, built up from the old one: conditions change only when their status, reason or message
    does (lastTransitionTime only when the status does), and every transition can post an event."""

    def __init__(self, status: RLHFJobStatus, now: datetime, generation: int | None):
        self.status, self.now, self.generation = status, now, generation
        self.conditions = {c.type: c for c in status.conditions}
        self.fields: dict[str, Any] = {}
        self.events: list[Event] = []
        self.held: set[str] = set()  # force-deleted pods a finalizer holds: they block nothing

    def get(self, name: str) -> Any:
        """A status field as this decision has it so far (camelCase name)."""
        return self.fields[name] if name in self.fields else getattr(self.status, _STATUS_FIELDS[name])

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


def _gone(name: str, role: str, index: int) -> PodView:
    return PodView(name, role, index, -1, "Failed", False, None, True, None)


def _previous(status: RLHFJobStatus, pod: str) -> GeneratorPodStatus:
    return next((g for g in status.generators if g.pod == pod), GeneratorPodStatus(pod=pod))


def stamp(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time(s: str) -> datetime:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
