"""What the operator reads from Prometheus about a job's generator pods: one instant query for the planner's
inputs and one for how long ago each pod was last scraped, turned (purely) into a PodMetrics per pod; and, for the
status, the requests running and waiting per pod, from either engine's metrics (queue_queries, queue_depths).

Series are selected by the `namespace` and `pod` target labels, which every Kubernetes scrape setup attaches
(kubernetes_sd relabelling, a PodMonitor). A pod whose last scrape is older than `max_age` is stale: left out,
never planned for. The age is Prometheus' own arithmetic (`time() - timestamp(...)`, both its clock), so a skew
between the operator's clock and Prometheus' does not make pods stale or fresh.

A Prometheus behind authentication (managed Prometheus, Thanos, Mimir) takes a PrometheusAuth: a bearer token file,
a CA file and extra headers, all per request, never on the aiohttp session, which the operator shares with the
job's pods (they must not see Prometheus' credentials).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import re
import ssl
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from . import metric_names as names
from .layout import Group, Layout
from .planner import Profile, RegroupCosts, Request

INPUTS = (names.GENERATOR_TP_SIZE, names.GENERATOR_REQUESTS_RUNNING, names.GENERATOR_REQUESTS_WAITING,
          names.GENERATOR_RUNNING_CONTEXT_TOKENS, names.GENERATOR_RUNNING_GENERATED_TOKENS,
          names.GENERATOR_LAYOUT_EPOCH, names.GENERATOR_BATCH_OPEN, names.GENERATOR_BATCH_MAX_TOKENS,
          names.GENERATOR_RESPONSE_TOKENS + "_bucket", names.GENERATOR_PROFILE_STEP_SECONDS,
          names.GENERATOR_PROFILE_CONTEXT, names.GENERATOR_PROFILE_KV_SECONDS, names.GENERATOR_REGROUP_COST,
          names.GENERATOR_PREFILL_COST)
PRIOR_LENGTHS = 4096  # at most this many earlier response lengths feed the length predictor


class PrometheusError(Exception):
    """Why no metrics could be used; `reason` is a condition reason (CamelCase)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PodMetrics:
    layout: Layout
    epoch: int
    running: dict[Group, list[Request]]  # per group, as planner.plan takes them (means of the group's requests)
    batch_open: bool
    max_tokens: int  # the open batch's response length cap
    lengths: list[int]  # earlier responses' lengths, at the histogram's bucket resolution
    profile: Profile
    costs: RegroupCosts

    @property
    def unfinished(self) -> int:
        return sum(len(r) for r in self.running.values())


def pod_matchers(namespace: str, pods: Sequence[str]) -> str:
    """The label matchers of the pods' series."""
    # Pod names are DNS subdomains: of the regex's metacharacters only "." can occur, escaped as \\. in a PromQL string.
    pods_regex = "|".join(sorted(pod.replace(".", "\\\\.") for pod in pods))
    return f'namespace="{namespace}",pod=~"{pods_regex}"'


def selectors(namespace: str, pods: Sequence[str]) -> tuple[str, str]:
    """The two queries: the planner's inputs, and the seconds since each pod's last scrape."""
    match = pod_matchers(namespace, pods)
    return (f'{{__name__=~"{"|".join(INPUTS)}",{match}}}',
            f'time() - timestamp({names.GENERATOR_LAYOUT_EPOCH}{{{match}}})')


def queue_queries(namespace: str, pods: Sequence[str]) -> tuple[str, str]:
    """The requests running, and those waiting, per pod: engine pat's gauges (per replica group), else vLLM's (per
    data-parallel engine), summed over the pod."""
    match = pod_matchers(namespace, pods)

    def either(pat: str, vllm: str) -> str:
        return f"sum by (pod) ({pat}{{{match}}}) or sum by (pod) ({vllm}{{{match}}})"

    return (either(names.GENERATOR_REQUESTS_RUNNING, names.VLLM_REQUESTS_RUNNING),
            either(names.GENERATOR_REQUESTS_WAITING, names.VLLM_REQUESTS_WAITING))


def queue_depths(running: list[dict], waiting: list[dict]) -> dict[str, tuple[int | None, int | None]]:
    """Per pod, (requests running, waiting) from the results of queue_queries; None where a result has no sample of
    the pod (or not a number)."""
    def per_pod(result: list[dict]) -> dict[str, int]:
        out = {}
        for s in result:
            try:
                value = float(s["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if math.isfinite(value) and (pod := s.get("metric", {}).get("pod")):
                out[pod] = round(value)
        return out

    r, w = per_pod(running), per_pod(waiting)
    return {pod: (r.get(pod), w.get(pod)) for pod in sorted(r.keys() | w.keys())}


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110 token)


@dataclass(frozen=True)
class PrometheusAuth:
    """How the operator authenticates to Prometheus: a bearer token read from `bearer_token_file` on every query
    (projected service account tokens rotate), `ca_file` to verify its TLS certificate (default: the system's CAs),
    and `headers` sent with every query (e.g. X-Scope-OrgID for Mimir)."""
    bearer_token_file: str | None = None
    ca_file: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.headers.items():
            if not _TOKEN.fullmatch(name) or "\n" in value or "\r" in value:
                raise ValueError(f"--prometheus-header {name}=...: give NAME=VALUE, NAME an HTTP header name "
                                 f"(letters, digits, -), VALUE one line")  # the value may be a secret: not shown
        if self.bearer_token_file and any(name.lower() == "authorization" for name in self.headers):
            raise ValueError("--prometheus-header Authorization=... and --prometheus-bearer-token-file both set the "
                             "Authorization header: give one")

    def request_headers(self) -> dict[str, str]:
        """The headers of one query: `headers`, and the token file's current token."""
        if not self.bearer_token_file:
            return dict(self.headers)
        try:
            with open(self.bearer_token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise PrometheusError("PrometheusAuthFailed", f"--prometheus-bearer-token-file {self.bearer_token_file}: "
                                  f"{e.strerror}") from None
        if not token:
            raise PrometheusError("PrometheusAuthFailed", f"--prometheus-bearer-token-file {self.bearer_token_file} "
                                  f"is empty")
        return {**self.headers, "Authorization": f"Bearer {token}"}

    def ssl_context(self) -> ssl.SSLContext | bool:
        """aiohttp's `ssl` argument: a context trusting `ca_file`, else True (the default verification)."""
        if not self.ca_file:
            return True
        try:
            return _ca_context(self.ca_file, os.stat(self.ca_file).st_mtime_ns)
        except (OSError, ssl.SSLError) as e:
            raise PrometheusError("PrometheusAuthFailed", f"--prometheus-ca-file {self.ca_file}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None


@functools.lru_cache(maxsize=8)
def _ca_context(ca_file: str, mtime_ns: int) -> ssl.SSLContext:
    """One context per CA file and version: a rotated CA file (a new mtime) is read again."""
    return ssl.create_default_context(cafile=ca_file)


def header_flag(text: str) -> tuple[str, str]:
    """argparse's `type` for --prometheus-header NAME=VALUE (split on the first '=')."""
    name, equals, value = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE, e.g. X-Scope-OrgID=tenant-1")
    return name, value


async def query(session: aiohttp.ClientSession, url: str, promql: str, timeout: float,
                auth: PrometheusAuth | None = None) -> list[dict]:
    """An instant query; raises PrometheusError (Unreachable | QueryFailed | PrometheusAuthFailed)."""
    headers, ssl_arg = (auth.request_headers(), auth.ssl_context()) if auth else (None, True)
    try:
        async with session.get(url.rstrip("/") + "/api/v1/query", params={"query": promql}, headers=headers,
                               ssl=ssl_arg, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status in (401, 403):
                raise PrometheusError("PrometheusAuthFailed", f"{url}: HTTP {resp.status}: check "
                                      f"--prometheus-bearer-token-file and --prometheus-header")
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise PrometheusError("PrometheusUnreachable", f"{url}: {type(e).__name__}: {e}") from None
    except ValueError:
        raise PrometheusError("QueryFailed", f"{url}: the answer is not JSON (HTTP {resp.status})") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else body
        raise PrometheusError("QueryFailed", f"{url}: HTTP {resp.status}: {error}")
    return body["data"]["result"]


def pod_metrics(series: list[dict], ages: list[dict], max_age: float) -> tuple[dict[str, PodMetrics], dict[str, str]]:
    """Per pod name, its metrics; and per pod left out, why (stale, or missing an input). `ages`: the second query's
    result, seconds since each pod's last scrape."""
    age = {s["metric"].get("pod", ""): float(s["value"][1]) for s in ages}
    by_pod: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for s in series:
        by_pod[s["metric"].get("pod", "")].append((s["metric"], float(s["value"][1])))
    out, skipped = {}, {}
    for pod, samples in by_pod.items():
        if age.get(pod, math.inf) > max_age:
            skipped[pod] = f"stale: no scrape in the last {max_age:g} s"  # no age: the message must stay put
            continue
        try:
            out[pod] = _parse(samples)
        except (KeyError, ValueError) as e:
            skipped[pod] = f"incomplete metrics: {e}"
    return out, skipped


def _parse(samples: list[tuple[dict, float]]) -> PodMetrics:
    per: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for labels, value in samples:
        per[labels["__name__"]].append((labels, value))

    def one(name: str) -> float:
        if not per[name]:
            raise KeyError(f"no {name}")
        return per[name][0][1]

    def by_group(name: str) -> dict[Group, float]:
        return {_group(labels["group"]): value for labels, value in per[name]}

    sizes = by_group(names.GENERATOR_TP_SIZE)
    if not sizes:
        raise KeyError(f"no {names.GENERATOR_TP_SIZE}")
    layout = tuple(len(g) for g in sorted(sizes))
    requests = group_requests(sorted(sizes), by_group(names.GENERATOR_REQUESTS_RUNNING),
                              by_group(names.GENERATOR_REQUESTS_WAITING),
                              by_group(names.GENERATOR_RUNNING_CONTEXT_TOKENS),
                              by_group(names.GENERATOR_RUNNING_GENERATED_TOKENS))
    profile: dict[int, dict[int, float]] = defaultdict(dict)
    for labels, value in per[names.GENERATOR_PROFILE_STEP_SECONDS]:
        profile[int(labels["tp"])][int(labels["batch"])] = value
    cost = {labels["term"]: value for labels, value in per[names.GENERATOR_REGROUP_COST]}
    prefill: dict[int, dict[str, float]] = defaultdict(dict)
    for labels, value in per[names.GENERATOR_PREFILL_COST]:
        prefill[int(labels["tp"])][labels["term"]] = value
    max_tokens = int(one(names.GENERATOR_BATCH_MAX_TOKENS))
    return PodMetrics(
        layout=layout, epoch=int(one(names.GENERATOR_LAYOUT_EPOCH)), running=requests,
        batch_open=one(names.GENERATOR_BATCH_OPEN) > 0, max_tokens=max_tokens,
        lengths=histogram_lengths([(math.inf if labels["le"] == "+Inf" else float(labels["le"]), value)
                                   for labels, value in per[names.GENERATOR_RESPONSE_TOKENS + "_bucket"]], max_tokens),
        profile=Profile(profile, {int(labels["tp"]): value for labels, value in per[names.GENERATOR_PROFILE_KV_SECONDS]},
                        int(one(names.GENERATOR_PROFILE_CONTEXT))),
        costs=RegroupCosts(cost["fixed_seconds"], cost["kv_seconds_per_token"],
                           {tp: (t["seconds"], t["seconds_per_token"]) for tp, t in prefill.items()}))


def _group(label: str) -> Group:
    first, last = (int(x) for x in label.split("-"))
    return tuple(range(first, last + 1))


def group_requests(groups: Sequence[Group], running: Mapping[Group, float], waiting: Mapping[Group, float],
                   context: Mapping[Group, float], generated: Mapping[Group, float]) -> dict[Group, list[Request]]:
    """The planner's requests from a pod's gauges: per group, `running` requests at the group's mean context and
    generated tokens (the sums over its running requests, divided by their count), then `waiting` ones at (0, 0)."""
    requests: dict[Group, list[Request]] = {}
    for g in groups:
        n = int(running.get(g, 0))
        mean = (round(context.get(g, 0) / n), round(generated.get(g, 0) / n)) if n else (0, 0)
        requests[g] = [mean] * n + [(0, 0)] * int(waiting.get(g, 0))
    return requests


def histogram_lengths(buckets: Sequence[tuple[float, float]], cap: int) -> list[int]:
    """Lengths from cumulative histogram buckets (upper bound, count), each at its bucket's upper bound (capped),
    scaled down to at most PRIOR_LENGTHS in all."""
    edges = sorted(buckets)
    total = edges[-1][1] if edges else 0
    scale = min(1.0, PRIOR_LENGTHS / total) if total else 0.0
    out, below = [], 0.0
    for edge, cumulative in edges:
        out += [min(int(edge) if edge != math.inf else cap, cap)] * round((cumulative - below) * scale)
        below = cumulative
    return out
