"""When a generator pod should regroup its ranks into other TP groups, and into which layout (PAT's planner).

The model. A response still running after g generated tokens is still running k steps later with probability
survival(g, k) (LengthPredictor: the lengths of earlier batches). A TP group of size t expects
n(k) = sum of its requests' survivals at its k-th next decode step, holding c(k) = the same sum weighted by each
one's KV tokens then; that step takes T(t, n(k), c(k)) seconds (Profile), so its remaining time is
sum_k T(t, n(k), c(k)); the pod is done when its slowest group is. A regroup costs a fixed
barrier plus resharding the requests it touches (RegroupCosts). plan() regroups when the predicted gain beats
that cost by a margin; Controller adds a cooldown around it, and a guard that judges each regroup by the steps it
delivers (a profile can be wrong: a loaded host, another model than the one profiled, a stale offline table).

During a rollout batch only merges are candidates: a split would move requests away from the ranks that hold
their caches, for no gain in a shrinking tail. At a batch boundary nothing is cached, so every valid layout is.
Pure Python: the pod's coordinator calls plan() between decode steps, and the operator imports it too.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from itertools import accumulate, product
from operator import mul
from typing import NamedTuple, Protocol, TypeVar

from .layout import Group, Layout, groups, uniform, validate

Request = tuple[int, int]  # (context_tokens, generated_tokens) of one unfinished request
Runs = tuple[tuple[float, ...], float]  # per segment of future steps the requests running; KV tokens held in all
Item = TypeVar("Item")  # what spread() places: requests, or the simulator's sequences

# What a regroup costs besides moving requests: two barriers, one exchange of request state and a KV cache
# allocation. RegroupReport.seconds["total"] of a regroup with nothing to move is 1-3 ms on a 2-core CPU over
# shared memory; 5 ms is on the safe side there and for NCCL.
REGROUP_FIXED_SECONDS = 0.005
PLAN_SPACING = 20  # a pod plans at least this many plans' durations apart (its CPU is the ranks')


class LengthPredictor:
    """Empirical survival of response lengths (generated tokens) from earlier batches; a prior before any.

    P(L > x) is estimated from the last `window` observed lengths plus one pseudo-response whose length is
    uniform in 1..max_tokens. Before the first observe() the `prior` lengths stand in for the observations;
    with none, the pseudo-response alone makes the prior uniform over 1..max_tokens. Afterwards it only matters
    for a response that outlived every observation: that one is expected to end uniformly before max_tokens
    rather than at once.
    """

    def __init__(self, max_tokens: int, prior: Sequence[int] = (), window: int = 4096):
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: use the response length cap, 1 or more")
        if window < 1:
            raise ValueError(f"window={window}: use 1 or more (how many recent lengths to keep)")
        self.max_tokens = max_tokens
        self._window: deque[int] = deque(maxlen=window)
        self._fit(self._clamped(prior))

    def observe(self, lengths: Iterable[int]) -> None:
        """Lengths of a batch's finished responses (those cut at max_tokens count as max_tokens); none: no change."""
        lengths = self._clamped(lengths)
        if lengths:
            self._window.extend(lengths)
            self._fit(self._window)

    def survival(self, generated: int, k: int) -> float:
        """P(a response still running after `generated` tokens is still running after k more)."""
        if k < 0:
            raise ValueError(f"k={k}: use 0 or more (steps ahead)")
        g = self._index(generated)
        return self._above[min(g + k, self.max_tokens)] / self._above[g] if self._above[g] else 0.0

    def expected_remaining(self, generated: int) -> float:
        """E[remaining tokens | still running after `generated`]; 0 at max_tokens."""
        return self.running_sums({generated: (1, 0)}, self.max_tokens + 1, 1)[0][0]

    def running_sums(self, load: Mapping[int, tuple[int, int]], width: int,
                     segments: int) -> tuple[list[float], float]:
        """For requests still running (load: generated tokens -> (how many, their prompt tokens in all)): per
        segment of `width` decode steps from now (`segments` of them) the expected number of them running, summed
        over the segment's steps; and the expected KV tokens they hold (prompt + generated), summed over every
        step until the cap."""
        rows, weights, held = [], [], 0.0
        end = len(self._summed_above) - 1
        for generated, (count, prompt_tokens) in load.items():
            g = self._index(generated)
            if self._above[g]:  # at max_tokens nothing can still run
                row = self._summed_above[g:g + width * segments + 1:width]
                rows.append(row + [self._summed_above[end]] * (segments + 1 - len(row)))  # none run past the cap
                weights.append(count / self._above[g])
                # at x generated tokens a request holds prompt + x: the sum over x of (prompt + x) P(running at x)
                held += (prompt_tokens * (self._summed_above[end] - self._summed_above[g])
                         + count * (self._summed_x_above[end] - self._summed_x_above[g])) / self._above[g]
        # Column-wise in C (map, sum): a pod of 512 requests with distinct lengths so far stays within a few ms.
        summed = [sum(map(mul, weights, column)) for column in zip(*rows)] or [0.0] * (segments + 1)
        return [hi - lo for lo, hi in zip(summed, summed[1:])], held

    def _index(self, generated: int) -> int:
        if generated < 0:
            raise ValueError(f"generated={generated}: use 0 or more (tokens generated so far)")
        return min(generated, self.max_tokens)

    def _clamped(self, lengths: Iterable[int]) -> list[int]:
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths):
            raise ValueError(f"lengths: {min(lengths)} is negative; a response length is 0 or more tokens")
        return [min(n, self.max_tokens) for n in lengths]

    def _fit(self, lengths: Iterable[int]) -> None:
        m = self.max_tokens
        ended_at = [0] * (m + 1)
        for n in lengths:
            ended_at[n] += 1
        # x -> max_tokens * P(L > x) * (observations + 1), in integers so that the sums below are exact:
        # max_tokens per observation longer than x, plus the uniform pseudo-response's max_tokens - x.
        self._above = [0] * (m + 1)
        longer = 0
        for x in range(m, -1, -1):
            self._above[x] = m * longer + m - x
            longer += ended_at[x]
        # x -> sum of _above[y] (and of y * _above[y]) for y < x; floats multiply faster than large ints
        self._summed_above = [float(a) for a in accumulate(self._above, initial=0)]
        self._summed_x_above = [float(a) for a in accumulate((x * a for x, a in enumerate(self._above)), initial=0)]


class MeasuredDecode(Protocol):
    decode: Mapping[int, Mapping[int, float]]  # tp -> batch -> seconds per step at decode_context per sequence
    kv_seconds: Mapping[int, float]  # tp -> seconds per step per KV token beyond that
    decode_context: int


class Profile:
    """T(tp, batch, context): seconds per decode step of a TP group whose batch holds `context` KV tokens in all.

    A table over batch sizes measured at `decode_context` tokens per sequence, plus kv_seconds[tp] per KV token
    held beyond that (or less per token short of it): attention reads every one, so that a step of a long tail
    costs more than the table says. Measured at start, refined online.
    """

    REFINE_WEIGHT = 0.1  # one observation moves a point by this fraction of its relative error ...
    REFINE_MAX_RATIO = 2.0  # ... an error counted as at most 2x (or 1/2x): one outlier moves it <= 10%

    def __init__(self, measured: Mapping[int, Mapping[int, float]], kv_seconds: Mapping[int, float] | None = None,
                 decode_context: int = 0):
        if not measured:
            raise ValueError("profile: no TP size measured; give tp -> batch -> seconds for at least one TP")
        kv_seconds = {int(tp): float(s) for tp, s in (kv_seconds or {}).items()}
        if decode_context < 0 or any(s < 0 for s in kv_seconds.values()):
            raise ValueError(f"profile: decode_context={decode_context}, kv_seconds={kv_seconds}; use 0 or more "
                             f"tokens per sequence and seconds per KV token")
        self.decode_context = int(decode_context)
        self.kv_seconds = {tp: kv_seconds.get(tp, 0.0) for tp in map(int, measured)}  # none measured: no term
        self._batches: dict[int, list[int]] = {}
        self._seconds: dict[int, list[float]] = {}
        self._pieces: dict[int, list[tuple[float, float]]] = {}  # tp -> per batch interval: (intercept, slope)
        for tp, row in measured.items():
            points = sorted((int(b), float(s)) for b, s in row.items())
            if not points or points[0][0] < 1 or any(s <= 0 for _, s in points):
                raise ValueError(f"profile: TP={tp} has {dict(row)}; measure batch sizes >= 1, each with "
                                 f"seconds > 0")
            self._batches[int(tp)] = [b for b, _ in points]
            self._seconds[int(tp)] = [s for _, s in points]
            self._fit(int(tp))

    @classmethod
    def measured(cls, costs: MeasuredDecode) -> Profile:
        """From what the engine's profiling pass measured (engine.costs.Costs, the simulator's EngineCosts)."""
        return cls(costs.decode, costs.kv_seconds, costs.decode_context)

    @property
    def tp_sizes(self) -> list[int]:
        return sorted(self._batches)

    def step_seconds(self, tp: int, batch: float, context: float | None = None) -> float:
        """Interpolated linearly between measured batch sizes (0 at batch 0, extrapolated above), plus the KV term
        for `context` tokens in all (None: decode_context per sequence, as measured)."""
        if tp not in self._pieces:
            raise ValueError(f"profile has no TP={tp}; measured: {self.tp_sizes}. Profile that TP size or "
                             f"leave it out of tp_sizes")
        if batch <= 0:
            return 0.0
        intercept, slope = self._pieces[tp][bisect_left(self._batches[tp], batch)]
        seconds = intercept + slope * batch
        return max(seconds + self.context_seconds(tp, batch, context), 0.0) if context is not None else seconds

    def context_seconds(self, tp: int, batch: float, context: float) -> float:
        """The KV term: what `context` tokens in all add to a step of `batch` sequences beyond the measured context
        (negative when they hold less). Linear: for steps summed, the sums' term."""
        return self.kv_seconds[tp] * (context - batch * self.decode_context)

    def observe(self, tp: int, batch: float, seconds: float, context: float | None = None,
                at_once: bool = False) -> float:
        """A measured decode step (holding `context` KV tokens, if known): the nearest measured batch size (the
        smaller on ties) moves toward it by REFINE_WEIGHT of the relative error, an EMA of the ratio observed /
        predicted. at_once: the measured points the prediction of this batch size is drawn from (itself, the two
        around it, or the last two) are scaled, uncapped, so that it predicts exactly this step: the guard's
        correction, from the median of several steps. Only there: a step time's shape over batch sizes is the
        device's (on a CPU, 8 rows can take longer than 16), so a step of 8 says little about a step of 64. Returns
        the factor applied."""
        if batch < 1 or seconds <= 0:
            raise ValueError(f"observed step TP={tp} batch={batch} seconds={seconds}: a decode step has "
                             f"batch >= 1 and seconds > 0")
        if at_once:
            table = self.step_seconds(tp, batch)
            beyond = self.context_seconds(tp, batch, context) if context is not None else 0.0
            ratio = max(seconds - beyond, 1e-12) / max(table, 1e-12)  # the table's part of the step
            bs, i = self._batches[tp], bisect_left(self._batches[tp], batch)
            around = ({i} if i == 0 or (i < len(bs) and bs[i] == batch) else {i - 1, i} if i < len(bs)
                      else {max(i - 2, 0), i - 1})  # a measured batch size itself; between two; beyond the last two
            for j in around:
                self._seconds[tp][j] *= ratio
            self._fit(tp)
            return ratio
        ratio = seconds / max(self.step_seconds(tp, batch, context), 1e-12)
        ratio = 1 + self.REFINE_WEIGHT * (min(max(ratio, 1 / self.REFINE_MAX_RATIO), self.REFINE_MAX_RATIO) - 1)
        bs = self._batches[tp]
        self._seconds[tp][min(range(len(bs)), key=lambda i: (abs(bs[i] - batch), bs[i]))] *= ratio
        self._fit(tp)
        return ratio

    def row(self, tp: int) -> tuple[float, ...]:
        """The measured steps of TP size tp, as refined so far (restore() puts them back)."""
        return tuple(self._seconds[tp])

    def restore(self, tp: int, row: Sequence[float]) -> None:
        self._seconds[tp] = list(row)
        self._fit(tp)

    def _fit(self, tp: int) -> None:
        """The line through each interval between measured points, so that step_seconds is one bisect away: from
        the origin to the first point, then point to point, then beyond the last along the last segment (never
        sloping down: a noisy last segment may)."""
        bs, ts = self._batches[tp], self._seconds[tp]
        slopes = [ts[0] / bs[0]] + [(t1 - t0) / (b1 - b0) for b0, b1, t0, t1 in zip(bs, bs[1:], ts, ts[1:])]
        slopes.append(max(slopes[-1], 0.0))
        self._pieces[tp] = [(0.0, slopes[0])] + [(t - slope * b, slope) for b, t, slope in zip(bs, ts, slopes[1:])]

    def to_json(self) -> dict:
        """The fields of the engine's measured costs (engine.costs.Costs.to_json) that a profile is made of."""
        return {"decode": {str(tp): {str(b): s for b, s in zip(self._batches[tp], self._seconds[tp])}
                           for tp in self.tp_sizes},
                "decode_context": self.decode_context,
                "kv_seconds": {str(tp): s for tp, s in self.kv_seconds.items()}}

    @classmethod
    def from_json(cls, d: Mapping) -> Profile:
        """Profile.to_json's output, or the engine's whole cost profile (Costs.to_json)."""
        try:
            measured = {int(tp): {int(b): float(s) for b, s in row.items()} for tp, row in d["decode"].items()}
            kv_seconds = {int(tp): float(s) for tp, s in d.get("kv_seconds", {}).items()}
            return cls(measured, kv_seconds, int(d.get("decode_context", 0)))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"profile JSON: expected {{\"decode\": {{tp: {{batch: seconds}}}}, \"decode_context\": "
                             f"tokens, \"kv_seconds\": {{tp: seconds}}}} with integer keys ({type(e).__name__}: "
                             f"{e})") from None


@dataclass(frozen=True)
class RegroupCosts:
    fixed_seconds: float  # barrier + commit + bookkeeping of one regroup
    kv_seconds_per_token: float  # moving one context token's KV (all layers) to its new group
    prefill: Mapping[int, tuple[float, float]]  # tp -> (a, b): re-prefilling L context tokens costs a + b * L

    def __post_init__(self):
        for name in ("fixed_seconds", "kv_seconds_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"regroup costs: {name}={getattr(self, name)} is negative; use seconds >= 0")

    @classmethod
    def measured(cls, fixed_seconds: float, kv_bytes_per_token: int, link_bytes_per_s: float,
                 prefill: Mapping[int, tuple[float, float]]) -> RegroupCosts:
        """As a pod derives them from its measured costs: KV moves at the link's bandwidth."""
        return cls(fixed_seconds, kv_bytes_per_token / link_bytes_per_s, dict(prefill))

    def request_seconds(self, tp: int, context_tokens: int) -> float:
        """Moving one request into a group of size tp: the cheaper of moving its KV and re-prefilling it, as the
        engine picks per request (a TP size without a prefill measurement can only move KV)."""
        a, b = self.prefill.get(tp, (math.inf, 0.0))
        if context_tokens == 0:  # a waiting request: nothing to move (and inf * 0, where KV cannot move, is nan)
            return 0.0
        return min(self.kv_seconds_per_token * context_tokens, a + b * context_tokens)


@dataclass(frozen=True)
class Decision:
    layout: Layout | None  # None: stay
    stay_seconds: float  # predicted remaining generation time of the pod if it stays (0 when not planned)
    best_seconds: float  # ... with the best candidate, excluding the regroup cost
    cost_seconds: float  # predicted regroup cost of that candidate
    reason: str  # one human-readable line


def coarsenings(layout: Sequence[int], tp_sizes: Sequence[int]) -> list[Layout]:
    """Every layout whose groups are unions of the current groups, of sizes in tp_sizes (the current one
    included, whatever its sizes)."""
    return _layouts(sum(layout), tp_sizes, keep=set(groups(layout)))


def plan(layout: Sequence[int], running: Mapping[Group, Sequence[Request]], profile: Profile,
         predictor: LengthPredictor, costs: RegroupCosts, tp_sizes: Sequence[int], margin: float = 0.1,
         at_boundary: bool = False, segments: int = 256, split: Mapping[Group, Sequence[Group]] | None = None
         ) -> Decision:
    """The layout to regroup into, if its predicted gain beats its cost by `margin` (a fraction of the time
    left); Decision.layout None to stay.

    running: per current group, one (context_tokens, generated_tokens) pair per unfinished request, waiting
    ones included with generated 0; context_tokens are those whose KV the request holds (0 while waiting).
    During a batch the candidates are merges and each pays for resharding its requests. at_boundary: a new
    batch is about to be submitted, nothing is cached (generated 0); every valid layout is a candidate, the
    current one included, with all the requests spread over its groups as the pod submits them (whatever
    group they are keyed by), and a change costs fixed_seconds only. split (the guard's question, during a batch):
    the one candidate is the current layout with each group in `split` split back into the groups given for it,
    its requests spread over them as the pod submits them, each paying for resharding. The horizon of future
    decode steps is cut
    into at most `segments` segments, each costed at its mean expected batch and KV held (exact with one step
    each).
    """
    layout = validate(layout, sum(layout))
    current = groups(layout)
    if set(running) - set(current):
        raise ValueError(f"running: group(s) {sorted(set(running) - set(current))} are not groups of layout "
                         f"{layout}; key the requests by the current groups {current}")
    if margin < 0 or segments < 1:
        raise ValueError(f"margin={margin}, segments={segments}: use a margin >= 0 (a fraction of the time left) "
                         f"and segments >= 1")
    placed = {g: list(running.get(g, ())) for g in current}
    everyone = [r for g in current for r in placed[g]]
    if not everyone:
        return Decision(None, 0.0, 0.0, 0.0, "stay: nothing running")
    if at_boundary and any(generated for _, generated in everyone):
        raise ValueError("running: at a batch boundary every request is new; give generated_tokens 0 (or plan "
                         "with at_boundary=False during a batch)")

    # Future decode steps in at most `segments` segments of equal width (the last may run past max_tokens,
    # where nothing runs), each costed at its mean expected batch and KV held.
    steps = predictor.max_tokens - min(min(generated for _, generated in everyone), predictor.max_tokens)
    width = max(1, -(-steps // segments))
    used = -(-steps // width)

    @cache  # per group load (generated -> requests, prompt tokens); a load recurs across candidates
    def expected_running(load: frozenset[tuple[int, tuple[int, int]]]) -> Runs:
        running, held = predictor.running_sums(dict(load), width, used)
        return tuple(running), held

    @cache
    def group_seconds(tp: int, runs: Runs) -> float:
        running, held = runs  # the KV term is linear in the context: summed over all the steps at once
        return (width * sum(profile.step_seconds(tp, n / width) for n in running)
                + profile.context_seconds(tp, sum(running), held))

    def load(requests: Sequence[Request]) -> frozenset[tuple[int, tuple[int, int]]]:
        per: dict[int, tuple[int, int]] = {}
        for context, generated in requests:
            count, prompts = per.get(generated, (0, 0))
            per[generated] = (count + 1, prompts + max(context - generated, 0))  # waiting ones hold no KV yet
        return frozenset(per.items())

    allowed = [t for t in tp_sizes if t in profile.tp_sizes]
    if at_boundary:
        options = [layout] + [o for o in _layouts(sum(layout), allowed, keep=set()) if o != layout]
        loads = {o: {g: expected_running(load(requests)) for g, requests in spread(everyone, groups(o)).items()}
                 for o in options}
    elif split:
        # The guard's split back: the merged group's requests spread over the groups it replaced, each resharding.
        apart = {h: r for g in current
                 for h, r in (spread(placed[g], split[g]) if g in split else {g: placed[g]}).items()}
        loads = {layout: {g: expected_running(load(placed[g])) for g in current},
                 tuple(map(len, apart)): {h: expected_running(load(r)) for h, r in apart.items()}}
        reshard = {h: costs.fixed_seconds + sum(costs.request_seconds(len(h), context) for context, _ in apart[h])
                   for h in apart if h not in current}
    else:
        merges = coarsenings(layout, allowed)
        members = {g: [h for h in current if set(h) <= set(g)] for o in merges for g in groups(o)}
        parts = {h: expected_running(load(placed[h])) for h in current}
        merged = {g: _added(parts[h] for h in hs) for g, hs in members.items()}  # n(k) and the KV held add up
        loads = {o: {g: merged[g] for g in groups(o)} for o in merges}
        # Every request a merged group takes in reshards into it; the regions of a merge regroup concurrently.
        reshard = {g: costs.fixed_seconds + sum(costs.request_seconds(len(g), context)
                                                for h in hs for context, _ in placed[h])
                   for g, hs in members.items() if g not in current}

    def pod_seconds(option: Layout) -> float:  # the pod is done when its slowest group is
        return max(group_seconds(len(g), runs) for g, runs in loads[option].items())

    def regroup_seconds(option: Layout) -> float:
        if at_boundary:
            return costs.fixed_seconds
        return max(reshard[g] for g in groups(option) if g in reshard)

    stay = pod_seconds(layout)
    others = [option for option in loads if option != layout]
    if not others:
        return Decision(None, stay, stay, 0.0, f"stay: no {'other layout' if at_boundary else 'merge'} of {layout} "
                                               f"is allowed (TP sizes {allowed})")
    scored = {option: (pod_seconds(option), regroup_seconds(option)) for option in others}
    best = min(others, key=lambda o: (sum(scored[o]), -len(o), _changed_ranks(layout, o)))  # ties: small
    best_seconds, cost = scored[best]
    change = f"{layout}->{best}: {stay:.3g} s -> {best_seconds:.3g} s + {cost:.3g} s regroup"
    if stay - (best_seconds + cost) > margin * stay:
        return Decision(best, stay, best_seconds, cost,
                        f"{'regroup' if at_boundary else 'split back' if split else 'merge'} {change}")
    if stay - best_seconds > margin * stay:
        return Decision(None, stay, best_seconds, cost, f"stay: the regroup cost eats the gain ({change})")
    return Decision(None, stay, best_seconds, cost, f"stay: the gain is under the {margin:.0%} margin ({change})")


class Verdict(NamedTuple):
    lost: bool  # by the corrected profile, splitting back beats keeping it: split back
    line: str  # what was measured and predicted, and the split-back plan, for the pod's log


@dataclass
class _Watch:
    """A regrouped group on trial: the groups it replaced, their last measured steps, and its own first ones."""
    members: list[Group]
    measured: list[tuple[int, float, float, float | None]]  # members' median steps: (tp, batch, seconds, context)
    steps: list[tuple[float, float, float | None]] | None = None  # its decode steps once applied


class Controller:
    """Hysteresis around plan(): a cooldown after each regroup, and no planning while one is in flight (from a
    decide() that proposed it until regrouped()). due() says when a pod asks again: once a request finished
    since the last decide() (else every REPLAN_STEPS decode steps), as a decision barely changes in between.

    The guard (observe(), fed every decode step) judges each regroup by what it delivers. A group the planner
    formed (a merge, or a layout picked at a batch boundary) is on trial for GUARD_STEPS decode steps after its
    first GUARD_SKIP (the new group's warm-up). Then the profile rows of its TP size, and of the groups it replaced
    where they ran GUARD_STEPS steps just before, are corrected at once to those steps' medians, and the next
    decide() asks plan() again, over the same horizon as the plan that formed it: the rest of the batch in this
    layout, or the group split back into the groups it replaced (paying to reshard its requests). The group lost if
    splitting back wins by the margin: it is split back (the engine moves or recomputes the requests, losing none),
    and the margin goes up by GUARD_RAISE for the rest of this batch. The corrected profile keeps the next batches
    from the same regroup: a wrong profile costs one regroup, not one per batch.

    A lost verdict's correction is doubted, not kept for good: a TP size no group runs gets no more steps to refine
    it, so one disturbed trial (another process on the host) would keep it out for the rest of the job. After
    DOUBT_BATCHES more batch starts, doubled for each loss of that TP size in a row, start_batch() puts its profile
    row back as it was before the first of those losses, and the pod tries that TP size again where the profile
    says it pays. A held verdict ends the doubt. Where the size really loses, that costs one trial per 2, 4, 8, ...
    batches.

    Every step also refines the profile slowly (Profile.observe). With guard=False the profile is trusted as it
    was given. The regroup costs' fixed part is measured too: regrouped(seconds) compares what an applied regroup
    took with what its plan predicted (regroup_costs).
    """

    REPLAN_STEPS = 16  # decode steps (of any group) between decisions while no request finishes
    GUARD_SKIP = 1  # a regrouped group's first decode steps, not judged: caches and the new group warm up
    GUARD_STEPS = 4  # decode steps that judge a regrouped group: the median, so one outlier step does not
    GUARD_RAISE = 0.25  # a losing regroup adds this to the margin for the rest of its batch
    DOUBT_BATCHES = 2  # batch starts until a lost verdict's correction is taken back, doubled per loss in a row
    FIXED_OBSERVED = 8  # regroups whose measured fixed part (median) replaces RegroupCosts.fixed_seconds

    def __init__(self, tp_sizes: Sequence[int], margin: float = 0.1, cooldown_steps: int = 4, guard: bool = True):
        if cooldown_steps < 0:
            raise ValueError(f"cooldown_steps={cooldown_steps}: use 0 or more decode steps")
        self.tp_sizes, self.margin, self.cooldown_steps, self.guard = list(tp_sizes), margin, cooldown_steps, guard
        self._cooldown = 0  # decode steps to wait before planning again
        self._in_flight = False
        self._decided_for: int | None = None  # unfinished requests at the last decide()
        self._steps_since = 0  # decode steps since the last decide()
        self._recent: dict[Group, deque[tuple[float, float, float | None]]] = {}  # group -> last decode steps
        self._trials: dict[Group, _Watch] = {}  # groups on trial (proposed, then applied)
        # judged groups -> (what they replaced, verdict, the factor their TP size's profile was corrected by, and
        # its profile row before)
        self._recheck: dict[Group, tuple[list[Group], str, float, tuple[float, ...]]] = {}
        self._raised = False  # the margin, for the rest of this batch
        self._base: Layout | None = None  # the layout this batch started in, while no verdict of this batch lost
        self._losses: dict[int, int] = {}  # TP size -> lost verdicts in a row
        self._doubts: dict[int, tuple[tuple[float, ...], int]] = {}  # TP size -> (its row before, batch starts left)
        self._proposed: tuple[float, float] | None = None  # (predicted cost, fixed_seconds in it) of the regroup
        self._fixed: deque[float] = deque(maxlen=self.FIXED_OBSERVED)  # fixed parts of the last regroups applied
        self.verdicts: list[Verdict] = []  # one per judged group, for the pod's log and metrics

    @property
    def effective_margin(self) -> float:
        return self.margin + (self.GUARD_RAISE if self._raised else 0.0)

    def regroup_costs(self, costs: RegroupCosts) -> RegroupCosts:
        """`costs` with the fixed part measured: the median over the last FIXED_OBSERVED regroups applied (their time
        less what the plan predicted for moving and recomputing requests), once one was. The start value is a guess
        (barrier, commit, bookkeeping), and what a regroup costs depends on the host and the ranks' link."""
        if not self._fixed:
            return costs
        return replace(costs, fixed_seconds=statistics.median(self._fixed))

    def step(self) -> None:
        """One decode step happened."""
        self._cooldown = max(self._cooldown - 1, 0)
        self._steps_since += 1

    def due(self, unfinished: int) -> bool:
        """Whether to decide() now: a request finished since the last decision, REPLAN_STEPS steps passed, or a
        regroup's trial ended."""
        return bool(self._recheck) or unfinished != self._decided_for or self._steps_since >= self.REPLAN_STEPS

    def observe(self, group: Group, batch: int, seconds: float, context: float | None, profile: Profile) -> None:
        """A decode step of `group` (no prefill in it): refines the profile, and judges a group on trial."""
        if not self.guard:
            return
        tp = len(group)
        recent = self._recent.setdefault(group, deque(maxlen=self.GUARD_STEPS))
        recent.append((batch, seconds, context))
        trial = self._trials.get(group)
        if trial is None or trial.steps is None:
            if tp in profile.tp_sizes:
                profile.observe(tp, batch, seconds, context)
            return
        trial.steps.append((batch, seconds, context))  # judged against the profile the plan was made on
        if len(trial.steps) < self.GUARD_SKIP + self.GUARD_STEPS:
            return
        del self._trials[group]
        batch, seconds, context = _median_step(trial.steps[self.GUARD_SKIP:])
        predicted = profile.step_seconds(tp, batch, context) if tp in profile.tp_sizes else math.nan
        before = profile.row(tp) if tp in profile.tp_sizes else ()
        factor = profile.observe(tp, batch, seconds, context, at_once=True) if tp in profile.tp_sizes else 1.0
        for step in trial.measured:
            if step[0] in profile.tp_sizes:
                profile.observe(*step, at_once=True)
        self._recheck[group] = (trial.members, f"guard: {'+'.join(map(str, map(len, trial.members)))}->{tp} "
                                               f"{{}}: a step of {batch:g} takes {1e3 * seconds:.4g} ms (predicted "
                                               f"{1e3 * predicted:.4g})", factor, before)

    def decide(self, layout: Sequence[int], running: Mapping[Group, Sequence[Request]], profile: Profile,
               predictor: LengthPredictor, costs: RegroupCosts) -> Decision:
        """plan() during a batch, unless a regroup is in flight, cooling down or on trial; after a trial, whether
        to split back. Call regrouped() once a proposed layout has been applied (or has failed)."""
        self._decided_for, self._steps_since = sum(map(len, running.values())), 0
        costs = self.regroup_costs(costs)
        if self._in_flight:
            return Decision(None, 0.0, 0.0, 0.0, "in flight: the proposed regroup is not applied yet")
        # A trial ends without a verdict when its group is gone (a failed regroup) or has nothing left to run.
        self._trials = {g: t for g, t in self._trials.items() if running.get(g)}
        judged = {g: v for g, v in self._recheck.items() if running.get(g)}
        self._recheck = {}
        if judged:  # the corrected profile's answer: split back, or keep what was planned
            split = plan(layout, running, profile, predictor, costs, self.tp_sizes, self.margin,
                         split={g: members for g, (members, *_) in judged.items()})
            lost = split.layout is not None
            for group, (_, line, factor, before) in judged.items():
                self.verdicts.append(Verdict(lost, f"{line.format('lost' if lost else 'held')}; {split.reason}"))
                self._doubt(len(group), factor, before, lost)
            if lost:
                self._in_flight, self._raised, self._base = True, True, None
                self._proposed = (split.cost_seconds, costs.fixed_seconds)
            return split  # one plan() per decide(): planning is CPU the ranks need
        if self._cooldown:
            return Decision(None, 0.0, 0.0, 0.0, f"cooldown: {self._cooldown} more decode step(s) after the "
                                                 f"last regroup")
        if self._trials:
            return Decision(None, 0.0, 0.0, 0.0, "on trial: a regrouped group has not run its first "
                                                 f"{self.GUARD_STEPS} decode steps")
        decision = plan(layout, running, profile, predictor, costs, self.tp_sizes, self.effective_margin)
        self._in_flight = decision.layout is not None
        if decision.layout is not None:
            self._try(layout, decision.layout, {g: len(r) for g, r in running.items()}, profile)
            self._proposed = (decision.cost_seconds, costs.fixed_seconds)
        return decision

    def regrouped(self, seconds: float | None = None) -> None:
        """A regroup was applied, taking `seconds` (its slowest rank's, from when all were at the step boundary;
        None: not measured, or it failed): start the cooldown, and the trials of the groups it formed."""
        if seconds is not None and self._proposed is not None:
            predicted, fixed = self._proposed
            self._fixed.append(max(seconds - (predicted - fixed), 0.0))
        self._proposed = None
        self._in_flight, self._cooldown = False, self.cooldown_steps
        for trial in self._trials.values():
            trial.steps = []

    def start_batch(self, world: int, prompts: Sequence[int], profile: Profile, predictor: LengthPredictor,
                    costs: RegroupCosts, layout: Sequence[int] | None = None) -> Decision:
        """At a batch boundary: the layout the new batch should start in (None: all TP=1), for prompts of these
        lengths spread over the groups as the pod submits them. The margin holds against `layout`: by default the
        layout the last batch started in, unless a verdict of that batch lost, else all TP=1. Not the last batch's
        tail layout: nothing is cached at a boundary, and a tail's merge is no reason to start the bulk merged;
        but a start that held is, and without it a layout that wins every batch by less than the margin would be
        given up at every boundary. Resets the cooldown; the caller applies the layout before submitting, no
        regrouped() needed."""
        self._in_flight, self._cooldown, self._decided_for, self._proposed = False, 0, None, None
        self._trials, self._recheck, self._recent = {}, {}, {}
        costs = self.regroup_costs(costs)
        self._raised = False
        for tp, (row, left) in list(self._doubts.items()):
            if left > 1:
                self._doubts[tp] = (row, left - 1)
            else:  # the lost verdicts' correction taken back: TP=tp gets another trial where it pays
                del self._doubts[tp]
                profile.restore(tp, row)
        layout = tuple(layout) if layout is not None else self._base or uniform(world)
        running = spread([(prompt, 0) for prompt in prompts], groups(layout))
        # Where a request can only move by re-prefilling it (vLLM engines), a start not taken now is taken later at
        # the price of re-prefilling everything running then: the start is the fastest predicted, no margin.
        margin = 0.0 if math.isinf(costs.kv_seconds_per_token) else self.effective_margin
        decision = plan(layout, running, profile, predictor, costs, self.tp_sizes, margin, at_boundary=True)
        if decision.layout is not None:
            self._try(layout, decision.layout, {g: len(r) for g, r in running.items()}, profile)
            self.regrouped()
            self._cooldown = 0
        start = decision.layout or layout
        self._base = start if start != uniform(world) else None
        return decision if decision.layout is not None else replace(decision, layout=self._base)

    def _doubt(self, tp: int, factor: float, before: tuple[float, ...], lost: bool) -> None:
        """A verdict on a group of TP size tp whose profile row the guard corrected by `factor` from `before`."""
        if not lost:
            self._losses.pop(tp, None)
            self._doubts.pop(tp, None)
            return
        self._losses[tp] = self._losses.get(tp, 0) + 1
        if factor > 1 and before:  # only a correction that keeps TP=tp out is taken back
            first, _ = self._doubts.get(tp, (before, 0))  # back to the row before the first loss in a row
            self._doubts[tp] = (first, self.DOUBT_BATCHES * 2 ** (self._losses[tp] - 1))

    def _try(self, old: Layout, new: Layout, batches: Mapping[Group, int], profile: Profile) -> None:
        """Put the groups of `new` that are not in `old` on trial, with what their members ran at before. Only merged
        groups: the guard's question is whether to split one back."""
        if not self.guard:
            return
        kept = set(groups(old))
        for g in groups(new):
            if g in kept:
                continue
            members = [h for h in groups(old) if set(h) <= set(g)]
            if not members or any(len(h) not in profile.tp_sizes for h in members):
                continue  # a group split from a larger one (at a boundary), or nothing to judge it against
            measured = [(len(h), *_median_step(self._recent[h])) for h in members
                        if batches.get(h) and len(self._recent.get(h, ())) == self.GUARD_STEPS]
            self._trials[g] = _Watch(members, measured)


def _median_step(steps: Iterable[tuple[float, float, float | None]]) -> tuple[float, float, float | None]:
    """The step of median seconds (its batch and context with it)."""
    ordered = sorted(steps, key=lambda s: s[1])
    return ordered[len(ordered) // 2]


def _layouts(world: int, tp_sizes: Sequence[int], keep: set[Group]) -> list[Layout]:
    """Every valid layout of `world` ranks with group sizes in tp_sizes, keeping the groups in `keep` whole."""

    def block(start: int, size: int) -> list[Layout]:
        if tuple(range(start, start + size)) in keep:
            return [(size,)]
        half = size // 2
        options = [a + b for a, b in product(block(start, half), block(start + half, half))] if size > 1 else []
        return options + [(size,)] if size in tp_sizes else options

    top = world & -world  # the largest power of two dividing the world: no group spans two such blocks
    return [sum(choice, ()) for choice in product(*(block(s, top) for s in range(0, world, top)))]


def spread(requests: Sequence[Item], to: Sequence[Group]) -> dict[Group, list[Item]]:
    """Requests over groups as the pod submits them: each to the group with the fewest per rank (first on ties)."""
    world = sum(len(g) for g in to)
    # That greedy's i-th pick is the i-th smallest (requests per rank before it, group) slot, and no group
    # gets more than n * size / world + 1 requests: sorting those slots replays it in O(n log n).
    slots = sorted((j / len(g), i) for i, g in enumerate(to) for j in range(len(requests) * len(g) // world + 1))
    placed: dict[Group, list[Item]] = {g: [] for g in to}
    for r, (_, i) in zip(requests, slots):
        placed[to[i]].append(r)
    return placed


def _added(runs: Iterable[Runs]) -> Runs:
    running, held = zip(*runs)
    return tuple(map(sum, zip(*running))), sum(held)


def _changed_ranks(old: Layout, new: Layout) -> int:
    kept = set(groups(old)) & set(groups(new))
    return sum(len(g) for g in groups(new) if g not in kept)
