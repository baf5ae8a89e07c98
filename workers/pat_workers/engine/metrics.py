"""The generator's Prometheus metrics (names from the operator's contract), fed from the ranks' events."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pat_operator import metric_names as names

from .regroup import RegroupReport

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REGROUP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The label values set up front (at 0), so that the series exist from the first scrape, before any regroup: a
# labelled counter or histogram has no series until .labels() is called, and a dashboard panel on it would show
# "no data" instead of 0. Decode steps by TP size start with each layout (set_layout).
REGROUP_OUTCOMES = ("applied", "fallback")
REGROUP_SECONDS_MODES = (*names.REGROUP_MODES, "total")


def group_label(group: tuple[int, ...]) -> str:
    return f"{group[0]}-{group[-1]}"


class EngineMetrics:
    def __init__(self, max_seq: int = 2048, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.running = Gauge(names.GENERATOR_REQUESTS_RUNNING, "Requests decoding, per replica group", ["group"], registry=r)
        self.waiting = Gauge(names.GENERATOR_REQUESTS_WAITING, "Requests queued, per replica group", ["group"], registry=r)
        self.tp_size = Gauge(names.GENERATOR_TP_SIZE, "TP size of each replica group", ["group"], registry=r)
        self.tokens = Counter(names.GENERATOR_TOKENS, "Tokens generated", registry=r)
        self.preemptions = Counter(names.GENERATOR_PREEMPTIONS, "Requests preempted back to the queue (the KV cache "
                                   "was full), to be recomputed", registry=r)
        self.kv_usage = Gauge(names.GENERATOR_KV_CACHE_USAGE, "Fraction of the KV cache's blocks in use, per replica "
                              "group", ["group"], registry=r)
        self.step_seconds = Histogram(names.GENERATOR_STEP_SECONDS, "Decode step latency by TP size", ["tp"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.regroups = Counter(names.GENERATOR_REGROUPS, "Regroups by outcome (applied | fallback)", ["outcome"],
                                registry=r)
        self.guard_verdicts = Counter(names.GENERATOR_GUARD_VERDICTS, "Regroups the pod's guard judged by their "
                                      "first decode steps: held, or lost (split back)", ["verdict"], registry=r)
        self.regroup_requests = Counter(names.GENERATOR_REGROUP_REQUESTS, "Requests carried through a regroup, by "
                                        "migration mode (kv | recompute)", ["mode"], registry=r)
        self.regroup_seconds = Histogram(names.GENERATOR_REGROUP_SECONDS, "Seconds a regroup spent moving KV, "
                                         "recomputing, and in total", ["mode"], buckets=REGROUP_BUCKETS, registry=r)
        for outcome in REGROUP_OUTCOMES:
            self.regroups.labels(outcome)
        for mode in names.REGROUP_MODES:
            self.regroup_requests.labels(mode)
        for mode in REGROUP_SECONDS_MODES:
            self.regroup_seconds.labels(mode)
        self.epoch = Gauge(names.GENERATOR_LAYOUT_EPOCH, "Epoch of the applied TP layout", registry=r)
        self.policy_version = Gauge(names.GENERATOR_POLICY_VERSION, "Policy version of the weights the ranks hold",
                                    registry=r)
        self.batches = Counter(names.GENERATOR_BATCHES, "Rollout batches completed (the batch boundaries)",
                               registry=r)
        self.context_tokens = Gauge(names.GENERATOR_RUNNING_CONTEXT_TOKENS, "KV tokens of the decoding requests, "
                                    "summed per replica group", ["group"], registry=r)
        self.generated_tokens = Gauge(names.GENERATOR_RUNNING_GENERATED_TOKENS, "Tokens generated so far by the "
                                      "decoding requests, summed per replica group", ["group"], registry=r)
        self.batch_open = Gauge(names.GENERATOR_BATCH_OPEN, "1 while a rollout batch is generating", registry=r)
        self.batch_max_tokens = Gauge(names.GENERATOR_BATCH_MAX_TOKENS, "Response length cap of the open batch",
                                      registry=r)
        self.response_tokens = Histogram(names.GENERATOR_RESPONSE_TOKENS, "Lengths of finished responses",
                                         buckets=names.response_token_buckets(max_seq), registry=r)
        self.profile = Gauge(names.GENERATOR_PROFILE_STEP_SECONDS, "Decode step seconds by TP size and batch, "
                             "measured at start and refined online", ["tp", "batch"], registry=r)
        self.profile_context = Gauge(names.GENERATOR_PROFILE_CONTEXT, "KV tokens per sequence of the profiled decode "
                                     "steps", registry=r)
        self.profile_kv = Gauge(names.GENERATOR_PROFILE_KV_SECONDS, "Decode step seconds per KV token held beyond "
                                "the profiled context, by TP size", ["tp"], registry=r)
        self.regroup_cost = Gauge(names.GENERATOR_REGROUP_COST, "Regroup cost model: fixed seconds, and seconds to "
                                  "move one token's KV", ["term"], registry=r)
        self.prefill_cost = Gauge(names.GENERATOR_PREFILL_COST, "Prefill cost by TP size: seconds at 0 tokens, "
                                  "seconds per token", ["tp", "term"], registry=r)

    def set_costs(self, profile: dict, fixed_seconds: float, kv_seconds_per_token: float,
                  prefill: dict[int, tuple[float, float]]) -> None:
        """The planner's inputs (profile as Profile.to_json writes it), so that the operator plans with them."""
        for tp, row in profile["decode"].items():
            for batch, seconds in row.items():
                self.profile.labels(tp, batch).set(seconds)
        self.profile_context.set(profile["decode_context"])
        for tp, seconds in profile["kv_seconds"].items():
            self.profile_kv.labels(tp).set(seconds)
        self.regroup_cost.labels("fixed_seconds").set(fixed_seconds)
        self.regroup_cost.labels("kv_seconds_per_token").set(kv_seconds_per_token)
        for tp, (seconds, per_token) in prefill.items():
            self.prefill_cost.labels(str(tp), "seconds").set(seconds)
            self.prefill_cost.labels(str(tp), "seconds_per_token").set(per_token)

    def set_layout(self, groups: list[tuple[int, ...]], epoch: int) -> None:
        per_group = (self.running, self.waiting, self.context_tokens, self.generated_tokens)
        for gauge in (self.tp_size, *per_group):
            gauge.clear()
        for g in groups:
            self.tp_size.labels(group_label(g)).set(len(g))
            self.step_seconds.labels(str(len(g)))  # kept across layouts: a histogram is cumulative
            for gauge in per_group:
                gauge.labels(group_label(g)).set(0)
        self.epoch.set(epoch)

    def on_step(self, group: tuple[int, ...], batch: int, running: int, waiting: int, seconds: float,
                tokens: int, context_tokens: int = 0, generated_tokens: int = 0, preempted: int = 0,
                kv_usage: float = 0.0) -> None:
        """batch: sequences the step decoded; running: those still decoding after it, which hold context_tokens
        of KV and have generated generated_tokens so far; preempted: requests it sent back to the queue; kv_usage:
        the fraction of the KV blocks in use after it."""
        label = group_label(group)
        self.preemptions.inc(preempted)
        self.kv_usage.labels(label).set(kv_usage)
        self.running.labels(label).set(running)
        self.waiting.labels(label).set(waiting)
        self.context_tokens.labels(label).set(context_tokens)
        self.generated_tokens.labels(label).set(generated_tokens)
        self.tokens.inc(tokens)
        if batch:
            self.step_seconds.labels(str(len(group))).observe(seconds)

    def on_regroup(self, reports: list[RegroupReport]) -> None:
        """One observation per changed group (the report of its leader), not per rank."""
        changed = [r for r in reports if r.outcome in REGROUP_OUTCOMES]
        for outcome in {r.outcome for r in changed}:
            self.regroups.labels(outcome).inc()
        for r in changed:
            for mode, count in r.modes.items():
                self.regroup_requests.labels(mode).inc(count)
            for mode in REGROUP_SECONDS_MODES:
                if mode in r.seconds:
                    self.regroup_seconds.labels(mode).observe(r.seconds[mode])
