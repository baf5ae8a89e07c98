"""A discrete-event simulation of one generator pod through one synchronous rollout batch, under a TP policy.

Each TP group decodes on its own clock with continuous batching: it holds at most max_batch * tp sequences and
as many as its paged KV cache has room for; queued ones are admitted (and prefilled, in that step) as others
finish, and when the running ones outgrow the cache the newest is preempted. Between two of its finishes a
group's batch is constant and its step time linear in the context (StepCosts), so the loop jumps from event to
event: a group's next finish or full cache, a planner call, a regroup's barrier. A regroup waits for the groups
it merges to end their step, moves each running request's KV or recomputes it (the cheaper), and the other
groups keep decoding meanwhile.

Policies: fixed layouts; the planner as the pod runs it (Controller.start_batch at the boundary, then due() and
decide() at step boundaries, no sooner than PLAN_SPACING plan durations apart, cooldown in steps); the planner
as the operator runs it (autoscaler.decide from the per-group means the pod exports, every queryInterval,
cooldownSeconds after a regroup); and a clairvoyant oracle.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from heapq import heapify, heappop, heappush

from pat_operator import metric_names, planner
from pat_operator.autoscaler import decide as operator_decide
from pat_operator.layout import Group, Layout, groups, uniform
from pat_operator.planner import PLAN_SPACING, REGROUP_FIXED_SECONDS
from pat_operator.prometheus import PodMetrics, group_requests, histogram_lengths

from .hardware import Roofline, StepCosts

KV_WATERMARK = 0.99  # of the KV cache that admissions may fill (vLLM keeps 1% free)
MAX_STEPS = 1 << 62  # a chunk's room when the KV cache never fills
ORACLE_EVERY_FINISH_BELOW = 64  # the oracle re-decides at every finish once this few are left, else every n/64-th


Seq = tuple[int, int, int, int]  # (id, prompt tokens, response length, generated so far) of a queued request
Running = tuple[int, int, int, int]  # (the group step at which it finishes, id, prompt tokens, response length)


@dataclass(frozen=True)
class Scenario:
    """One rollout batch on one generator pod."""
    lengths: tuple[int, ...]  # response lengths of the batch's requests
    prompt_tokens: int
    max_tokens: int  # the response cap (the planner's horizon)
    world: int  # ranks (GPUs) of the pod
    max_batch: int  # sequences per TP=1 replica (a TP=t group: t times as many)
    tp_sizes: tuple[int, ...]
    prior: tuple[int, ...]  # lengths of earlier batches: what the planner's length predictor learns from
    margin: float = 0.1
    cooldown_steps: int = 4
    guard: bool = True  # the pod's controller judges each regroup by its steps (planner.Controller)
    query_interval: float = 1.0
    cooldown_seconds: float = 2.0
    plan_seconds: float = 0.01  # one plan()'s duration on the pod's CPU: spaces the pod's plans (PLAN_SPACING)
    regroup_fixed_seconds: float = REGROUP_FIXED_SECONDS
    kv_moves: bool = True  # this engine moves KV between groups; vLLM engines only re-prefill a moved request


@dataclass
class Result:
    policy: str
    seconds: float  # generation time of the batch
    regroups: list[tuple[float, Layout, Layout, float]] = field(default_factory=list)  # (time, old, new, seconds)
    plans: int = 0
    finishes: list[tuple[float, int]] = field(default_factory=list)  # (time, requests that finished then)
    start_layout: Layout = ()

    def unfinished(self, total: int) -> list[tuple[float, int]]:
        """(time, unfinished requests) from the start, in time order."""
        out, left = [(0.0, total)], total
        for t, n in sorted(self.finishes):
            left -= n
            out.append((t, left))
        return out

    def layouts(self) -> list[tuple[float, Layout]]:
        """(time, layout) from the start: each regroup's layout from when it is done."""
        return [(0.0, self.start_layout)] + sorted((at + took, new) for at, _, new, took in self.regroups)


@dataclass
class _Group:
    """A TP group: its running requests in a heap by the step (of this group's count) at which each finishes, so
    that a request's progress is implicit: generated = length - (finishes_at - steps)."""
    ranks: Group
    running: list[Running]
    queue: deque[Seq]
    steps: int = 0  # decode steps this group has run
    room: int = 0  # steps of this chunk before its KV cache is full
    held: int = 0  # sum of (prompt + length - finishes_at) over running: context = held + len(running) * steps
    start: float = 0.0  # the current chunk's start (a step boundary, or the end of a regroup)
    prefill: float = 0.0  # seconds its first step spends prefilling admitted requests
    alpha: float = 0.0  # its first decode step's seconds ...
    beta: float = 0.0  # ... each next one's more (the context grows)
    seen: int = 0  # steps of this chunk the pod has observed

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def end_steps(self) -> int:
        """Steps of this chunk until its next finish, or until its KV cache is full."""
        return min(self.running[0][0] - self.steps, self.room)

    @property
    def end(self) -> float:
        return self.boundary(self.end_steps) if self.running else math.inf

    def boundary(self, k: int) -> float:
        """When its k-th step (k >= 1) of this chunk ends."""
        return self.start + self.prefill + k * self.alpha + self.beta * k * (k - 1) / 2

    def steps_by(self, t: float) -> int:
        """Steps of this chunk done by time t."""
        if not self.running or t < self.start + self.prefill + self.alpha:
            return 0
        x = t - self.start - self.prefill
        a, b = self.beta / 2, self.alpha - self.beta / 2
        k = int(x / b) if a == 0 else int((-b + math.sqrt(b * b + 4 * a * x)) / (2 * a))
        k = min(k, self.end_steps)
        while k > 0 and self.boundary(k) > t:
            k -= 1
        while k < self.end_steps and self.boundary(k + 1) <= t:
            k += 1
        return k

    def requests(self, k: int = 0) -> list[planner.Request]:
        """(context, generated) of each request k steps into this chunk, as the planner takes them."""
        out = []
        for finishes_at, _, prompt, length in self.running:
            generated = length - (finishes_at - self.steps - k)
            out.append((prompt + generated, generated))
        return out + [(0, generated) for *_, generated in self.queue]

    def context(self) -> int:
        return self.held + len(self.running) * self.steps

    def progress(self, k: int) -> tuple[float, int]:
        """k steps on (k <= end_steps), the finished requests out: (that boundary's time, how many finished)."""
        t = self.boundary(k) if k else self.start
        self.steps += k
        finished = 0
        while self.running and self.running[0][0] <= self.steps:
            finishes_at, _, prompt, length = heappop(self.running)
            self.held -= prompt + length - finishes_at
            finished += 1
        return t, finished

    def preempt_newest(self) -> None:
        """Back to the queue's front, its KV freed (re-prefilled when admitted again), as vLLM preempts."""
        newest = max(range(len(self.running)), key=lambda i: self.running[i][1])
        finishes_at, i, prompt, length = self.running[newest]
        self.running[newest] = self.running[-1]
        self.running.pop()
        heapify(self.running)
        self.held -= prompt + length - finishes_at
        self.queue.appendleft((i, prompt, length, length - (finishes_at - self.steps)))

    def take(self, requests: list[Running], steps: int) -> None:
        """Requests of another group, whose step count was `steps`."""
        for finishes_at, i, prompt, length in requests:
            entry = (finishes_at - steps + self.steps, i, prompt, length)
            heappush(self.running, entry)
            self.held += prompt + length - entry[0]

    def copy(self) -> _Group:
        return replace(self, running=list(self.running), queue=deque(self.queue))


class Pod:
    """The groups of one pod and the mechanics shared by every policy."""

    def __init__(self, scenario: Scenario, costs: StepCosts, layout: Sequence[int]):
        self.s, self.costs = scenario, costs
        self.layout: Layout = tuple(layout)
        seqs = [(i, scenario.prompt_tokens, max(n, 1), 0) for i, n in enumerate(scenario.lengths)]
        placed = planner.spread(seqs, groups(self.layout))
        self.groups = {g: _Group(g, [], deque(placed[g])) for g in groups(self.layout)}
        self.unfinished = len(seqs)
        self.finished_at = 0.0
        self.steps_done = 0  # decode steps of all groups in finished chunks
        self.regroups: list[tuple[float, Layout, Layout, float]] = []
        self.finishes: list[tuple[float, int]] = []
        # per chunk: (group, steps, batch, mean step s, mean context)
        self.observed: list[tuple[Group, int, int, float, float]] = []
        for g in self.groups.values():
            self._admit_and_start(g, 0.0)

    # -- a group's chunks --------------------------------------------------------------------------------
    def _admit_and_start(self, g: _Group, at: float) -> None:
        """Paged KV, as vLLM and SGLang: a queued request is admitted while its context fits beside the running
        ones' (a 1% watermark kept free); when the running ones outgrow the cache, the newest is preempted."""
        capacity = self.costs.kv_capacity(g.tp)
        while g.running and g.context() + len(g.running) > capacity:
            g.preempt_newest()
        admitted: list[int] = []
        while g.queue and len(g.running) < self.s.max_batch * g.tp:
            i, prompt, length, generated = g.queue[0]
            if g.context() + len(g.running) + prompt + generated + 1 > KV_WATERMARK * capacity:
                if not g.running:
                    raise ValueError(f"a TP={g.tp} group cannot hold one sequence of {prompt + generated} tokens "
                                     f"(KV capacity {capacity:.0f} tokens); lower the cap or use a larger GPU")
                break
            g.queue.popleft()
            admitted.append(prompt + generated)
            # A new request's prefill samples its first token; a preempted one's recomputes what it had.
            g.take([(max(length - max(generated, 1), 1), i, prompt, length)], 0)
        g.start, g.prefill = at, self.costs.prefill_seconds(g.tp, admitted) if admitted else 0.0
        if g.running:
            base, per_context = self.costs.decode(g.tp, len(g.running))
            g.alpha = base + per_context * g.context()
            g.beta = per_context * len(g.running)
            g.room = MAX_STEPS if math.isinf(capacity) else int(capacity - g.context()) // len(g.running)

    def _advance(self, g: _Group, k: int) -> float:
        """Ends g's chunk after k steps (k <= end_steps); returns that boundary's time."""
        self._observe(g, k)
        g.seen = 0
        t, done = g.progress(k)
        self.steps_done += k
        if done:
            self.unfinished -= done
            self.finished_at = max(self.finished_at, t)
            self.finishes.append((t, done))
        return t

    def observe_until(self, t: float) -> None:
        """The steps every group has run by t, as the pod's step records report them."""
        for g in self.groups.values():
            self._observe(g, g.steps_by(t))

    def _observe(self, g: _Group, k: int) -> None:
        """Steps seen..k of g's chunk, as one observation of their mean."""
        if k > g.seen:
            middle = (g.seen + k - 1) / 2
            self.observed.append((g.ranks, k - g.seen, len(g.running), g.alpha + g.beta * middle,
                                  g.context() + len(g.running) * middle))
            g.seen = k

    def group_end(self, g: _Group) -> float:
        """When g would be done if nothing changed (g itself is left as it is)."""
        g = g.copy()
        t = g.start
        while g.running:
            t, _ = g.progress(g.end_steps)
            self._admit_and_start(g, t)
        return t

    def next_finish(self) -> tuple[float, _Group | None]:
        return min(((g.end, g) for g in self.groups.values() if g.running), default=(math.inf, None),
                   key=lambda e: e[0])

    def finish_chunk(self, g: _Group) -> None:
        self._admit_and_start(g, self._advance(g, g.end_steps))

    def steps_by(self, t: float) -> int:
        """Decode steps of all groups so far (this batch), at time t."""
        return self.steps_done + sum(g.steps_by(t) for g in self.groups.values())

    def next_boundary_after(self, t: float) -> float:
        return min((g.boundary(g.steps_by(t) + 1) for g in self.groups.values() if g.running and g.end > t),
                   default=math.inf)

    # -- what the planners see ------------------------------------------------------------------------------
    def running_lengths(self, t: float) -> dict[Group, list[planner.Request]]:
        """As LocalGenerator.running_lengths: (context, generated) per request, (0, generated) while queued."""
        return {key: g.requests(g.steps_by(t)) for key, g in self.groups.items()}

    # -- regroups ----------------------------------------------------------------------------------------
    def regroup(self, target: Sequence[int], t: float) -> float:
        """Regroups into `target` at the groups' next step boundary after t: merges, or the guard's split back of
        a merged group; returns when the last region is done."""
        target = tuple(target)
        old = self.layout
        done_at = t
        for new in groups(target):
            if new in self.groups:
                continue
            whole = next((h for h in self.groups if set(new) < set(h)), None)
            if whole is not None:
                for part in self._split(self.groups.pop(whole), [p for p in groups(target) if set(p) <= set(whole)],
                                        t):
                    self.groups[part.ranks] = part
                    done_at = max(done_at, part.start)
            else:
                parts = [self.groups.pop(h) for h in list(self.groups) if set(h) <= set(new)]
                self.groups[new] = self._merged(new, parts, t, self._advance)
                done_at = max(done_at, self.groups[new].start)
        self.groups = dict(sorted(self.groups.items()))
        self.layout = target
        self.regroups.append((t, old, target, done_at - t))
        return done_at

    def _merged(self, ranks: Group, parts: list[_Group], t: float, advance: Callable[[_Group, int], float]) -> _Group:
        """The group `ranks` made of `parts` at their next step boundary after t, started once the regroup is done."""
        barrier = max([t] + [advance(h, min(h.steps_by(t) + 1, h.end_steps)) for h in parts if h.running])
        merged = _Group(ranks, [], deque(r for h in parts for r in h.queue))
        for h in parts:
            merged.take(h.running, h.steps)
        cost = self.regroup_seconds(len(ranks), [context for context, _ in merged.requests() if context])
        self._admit_and_start(merged, barrier + cost)
        return merged

    def _split(self, whole: _Group, parts: list[Group], t: float) -> list[_Group]:
        """`whole`'s requests spread over the groups `parts` at its next step boundary after t, each part started
        once it has taken in its share."""
        barrier = self._advance(whole, min(whole.steps_by(t) + 1, whole.end_steps)) if whole.running else t
        running, queued = planner.spread(whole.running, parts), planner.spread(list(whole.queue), parts)
        out = []
        for ranks in parts:
            part = _Group(ranks, [], deque(queued[ranks]))
            part.take(running[ranks], whole.steps)
            cost = self.regroup_seconds(len(ranks), [context for context, _ in part.requests() if context])
            self._admit_and_start(part, barrier + cost)
            out.append(part)
        return out

    def held_end(self, layout: Layout, t: float, ends: dict[Group, float]) -> float:
        """When the batch would end if the pod regrouped into `layout` at t and held it (ends: a cache of group
        ends for this state); the pod itself is left as it is."""
        out = self.finished_at
        for new in groups(layout):
            if new not in ends:
                if new in self.groups:
                    ends[new] = self.group_end(self.groups[new])
                else:
                    parts = [h.copy() for k, h in self.groups.items() if set(k) <= set(new)]
                    ends[new] = self.group_end(self._merged(new, parts, t, lambda h, k: h.progress(k)[0]))
            out = max(out, ends[new])
        return out

    def regroup_seconds(self, tp: int, contexts: Sequence[int]) -> float:
        """Barrier and bookkeeping, then per request the cheaper of moving its KV and re-prefilling it (vLLM: the
        re-prefill)."""
        kv = self.costs.kv_bytes_per_token
        move = self.costs.migrate_seconds if self.s.kv_moves else lambda nbytes: math.inf
        return self.s.regroup_fixed_seconds + sum(
            min(move(kv * n), self.costs.prefill_seconds(tp, [n])) for n in contexts)

    def run_to_end(self) -> float:
        while (g := self.next_finish()[1]) is not None:
            self.finish_chunk(g)
        return self.finished_at


# -- the planner's inputs, as the pod derives them from its measured costs ---------------------------------

@dataclass
class PlannerInputs:
    profile: planner.Profile
    costs: planner.RegroupCosts
    tp_sizes: list[int]


def planner_inputs(scenario: Scenario, costs: StepCosts) -> PlannerInputs:
    """What a pod measures at start (its profiling pass) and plans with."""
    capacity = scenario.max_batch * max(scenario.tp_sizes)  # as the engine's ranks profile (engine/rank.py)
    batches = sorted({1 << i for i in range(capacity.bit_length())} | {capacity})
    measured = costs.engine_costs(list(scenario.tp_sizes), batches)
    tp_sizes = [t for t in scenario.tp_sizes if t in measured.decode]
    regroup = (planner.RegroupCosts.measured(scenario.regroup_fixed_seconds, costs.kv_bytes_per_token,
                                             measured.link_bytes_per_s, measured.prefill) if scenario.kv_moves
               else planner.RegroupCosts(scenario.regroup_fixed_seconds, math.inf, dict(measured.prefill)))
    return PlannerInputs(planner.Profile.measured(measured), regroup, tp_sizes)


# -- policies ----------------------------------------------------------------------------------------------

def fixed(scenario: Scenario, costs: StepCosts, tp: int) -> Result:
    pod = Pod(scenario, costs, uniform(scenario.world, tp))
    pod.run_to_end()
    return _result(f"fixed TP{tp}", pod, 0, pod.layout)


def pod_planner(scenario: Scenario, costs: StepCosts) -> Result:
    """The pod's controller: start_batch at the boundary, then at step boundaries when due() and spaced."""
    inputs = planner_inputs(scenario, costs)
    predictor = planner.LengthPredictor(scenario.max_tokens, prior=scenario.prior)
    controller = planner.Controller(inputs.tp_sizes, scenario.margin, scenario.cooldown_steps, scenario.guard)
    start = controller.start_batch(scenario.world, [scenario.prompt_tokens] * len(scenario.lengths), inputs.profile,
                                   predictor, inputs.costs).layout or uniform(scenario.world)
    pod = Pod(scenario, costs, start)
    plans, counted, allowed = 1, 0, 0.0
    while True:
        t_finish, g = pod.next_finish()
        if g is None:
            break
        t_plan = pod.next_boundary_after(allowed)
        if t_finish <= t_plan:
            pod.finish_chunk(g)
            continue
        steps = pod.steps_by(t_plan)
        for _ in range(steps - counted):
            controller.step()
        counted = steps
        allowed = t_plan
        pod.observe_until(t_plan)
        _refine(controller, inputs.profile, pod)
        if not controller.due(pod.unfinished):
            continue
        decision = controller.decide(pod.layout, pod.running_lengths(t_plan), inputs.profile, predictor, inputs.costs)
        plans += 1
        allowed = t_plan + PLAN_SPACING * scenario.plan_seconds
        if decision.layout is not None:
            allowed = max(allowed, pod.regroup(decision.layout, t_plan + scenario.plan_seconds))
            controller.regrouped()
    return _result("planner (pod)", pod, plans, start)


def operator_planner(scenario: Scenario, costs: StepCosts) -> Result:
    """The operator's autoscaler: every queryInterval, autoscaler.decide() on the metrics the pod exports."""
    inputs = planner_inputs(scenario, costs)
    buckets = metric_names.response_token_buckets(scenario.prompt_tokens + scenario.max_tokens)
    lengths = histogram_lengths([(edge, sum(n <= edge for n in scenario.prior)) for edge in buckets]
                                + [(math.inf, len(scenario.prior))], scenario.max_tokens)
    pod = Pod(scenario, costs, uniform(scenario.world))
    plans, epoch, last_regroup, t = 0, 0, -math.inf, 0.0
    while True:
        t_finish, g = pod.next_finish()
        if g is None:
            break
        if t_finish <= t + scenario.query_interval:
            pod.finish_chunk(g)
            continue
        t += scenario.query_interval
        if t - last_regroup < scenario.cooldown_seconds:  # in flight (t < last_regroup), or cooling down
            continue
        plans += 1
        decision = operator_decide(_pod_metrics(pod, t, epoch, lengths, inputs), inputs.tp_sizes, scenario.margin)
        if decision.layout is not None:
            last_regroup, epoch = pod.regroup(decision.layout, t), epoch + 1
    return _result("planner (operator)", pod, plans, uniform(scenario.world))


def oracle(scenario: Scenario, costs: StepCosts) -> Result:
    """Knows every length. From each start (the layout that ends the batch first when held, each candidate
    simulated with the exact lengths, and every uniform layout) it merges, at finish events, into the coarsening
    that ends first if held from now, regroup included, no margin -- unless merging into it later (once half, a
    quarter, ... of the unfinished are left) ends sooner; the best start wins. A clairvoyant greedy search over
    the planner's candidate layouts, not a proven bound."""
    options = planner.coarsenings(uniform(scenario.world), scenario.tp_sizes)  # from TP1 replicas: every layout
    held = min(options, key=lambda o: (Pod(scenario, costs, o).held_end(o, 0.0, {}), -len(o)))
    starts = dict.fromkeys([held] + [uniform(scenario.world, tp) for tp in scenario.tp_sizes])
    return min((_greedy(scenario, costs, start) for start in starts), key=lambda r: r.seconds)


def _greedy(scenario: Scenario, costs: StepCosts, start: Layout) -> Result:
    pod = Pod(scenario, costs, start)
    plans, finishes = 0, 0
    while True:
        t, g = pod.next_finish()
        if g is None:
            break
        pod.finish_chunk(g)
        finishes += 1
        if not pod.unfinished or finishes % max(1, pod.unfinished // ORACLE_EVERY_FINISH_BELOW):
            continue
        plans += 1
        best, end = _best_merge(pod, t)
        if best != pod.layout and not _later_is_better(pod, end):
            pod.regroup(best, t)
    return _result("oracle", pod, plans, start)


def _best_merge(pod: Pod, t: float) -> tuple[Layout, float]:
    ends: dict[Group, float] = {}
    options = planner.coarsenings(pod.layout, pod.s.tp_sizes)
    best = min(options, key=lambda o: (pod.held_end(o, t, ends), o != pod.layout))
    return best, pod.held_end(best, t, ends)


def _later_is_better(pod: Pod, end: float) -> bool:
    """Whether staying until fewer requests are left (1/2, 1/4, ... of them), then merging, ends before `end`."""
    twin = _copy(pod)
    left = pod.unfinished // 2
    while left:
        while twin.unfinished > left:
            t, g = twin.next_finish()
            twin.finish_chunk(g)
        if _best_merge(twin, t)[1] < end:
            return True
        left //= 2
    return False


def _copy(pod: Pod) -> Pod:
    twin = object.__new__(Pod)
    twin.__dict__.update(pod.__dict__)
    twin.groups = {k: g.copy() for k, g in pod.groups.items()}
    twin.regroups, twin.finishes, twin.observed = [], [], []
    return twin


def _refine(controller: planner.Controller, profile: planner.Profile, pod: Pod) -> None:
    """The pod's controller sees every decode step; the simulator's each chunk's mean step, counted as up to
    GUARD_SKIP + GUARD_STEPS steps (enough to judge a regroup, no more: the refinement moves per observation)."""
    for group, steps, batch, seconds, context in pod.observed:
        for _ in range(min(steps, controller.GUARD_SKIP + controller.GUARD_STEPS)):
            controller.observe(group, batch, seconds, context, profile)
    pod.observed.clear()


def _pod_metrics(pod: Pod, t: float, epoch: int, lengths: list[int], inputs: PlannerInputs) -> PodMetrics:
    """The gauges a pod exports at t (per group: running, waiting, context and generated sums), read back as the
    operator reads Prometheus."""
    running, waiting, context, generated = {}, {}, {}, {}
    for key, g in pod.groups.items():
        decoding = [r for r in g.requests(g.steps_by(t)) if r[0]]
        running[key], waiting[key] = len(decoding), len(g.queue)
        context[key] = sum(c for c, _ in decoding)
        generated[key] = sum(n for _, n in decoding)
    requests = group_requests(list(pod.groups), running, waiting, context, generated)
    return PodMetrics(layout=pod.layout, epoch=epoch, running=requests, batch_open=True,
                      max_tokens=pod.s.max_tokens, lengths=lengths, profile=inputs.profile, costs=inputs.costs)


def _result(name: str, pod: Pod, plans: int, start: Layout) -> Result:
    return Result(name, pod.finished_at, pod.regroups, plans, pod.finishes, start)


ENGINES = ("pat", "vllm")


def adaptive_pod(scenario: Scenario, costs: StepCosts, engine: str) -> tuple[Scenario, StepCosts]:
    """The batch and costs of an adaptive pod of `engine`: this engine's as they are; vLLM's runs one engine per
    group of every layout, all awake (on a GPU model, their weights beside each other leave less KV cache), and
    moves a request by re-prefilling it on the new group (no KV moves between engines). A fixed layout's vLLM pod
    runs only its own engines: `scenario` and `costs` as they are."""
    if engine == "pat":
        return scenario, costs
    if isinstance(costs, Roofline):
        costs = replace(costs, resident_tp_sizes=scenario.tp_sizes)
    return replace(scenario, kv_moves=False), costs


POLICIES: dict[str, Callable[[Scenario, StepCosts], Result]] = {
    "planner (pod)": pod_planner, "planner (operator)": operator_planner, "oracle": oracle}
