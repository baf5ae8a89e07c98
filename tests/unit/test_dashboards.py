"""The Grafana dashboards (dashboards/*.json): loadable by the Grafana sidecar, a faithful Grafana model (they
round-trip through grafana-foundation-sdk), valid PromQL (promtool), only metrics the project exports, the RLHF
job dashboard scoped to one job, and every query answered from the first scrape (the metrics' label values are
set up front) -- by a real Prometheus where the binary is installed."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import threading
import time
import typing
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from pat_operator import metric_names as names
from pat_operator.api import PHASES
from pat_operator.operator_metrics import PROMETHEUS_ERROR_REASONS, REGROUP_PLAN_OUTCOMES, OperatorMetrics
from pat_operator.podapi import RegroupAck
from pat_workers.engine.metrics import EngineMetrics
from pat_workers.ports import free_port
from pat_workers.trainer.loop import TrainerMetrics
from tests.cluster.dashboards import (BUILTINS, OPERATOR, RLHF_JOB, annotation_queries, load, panel_queries, panels,
                                      substitute, unfiltered, variable_queries)
from tests.cluster.prometheus import installed

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = [RLHF_JOB, OPERATOR]
DS = {"type": "prometheus", "uid": "${datasource}"}
VARIABLES = {"namespace": "ns", "job": "demo"}
# Labels Prometheus adds to every scraped series (the scrape config's target labels), not the metrics' own.
TARGET_LABELS = {"namespace", "pod", "pat_job", "pat_role", "job", "instance"}
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "inf", "nan", "Inf", "NaN"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACES, _BRACKETS = re.compile(r"\{[^}]*\}"), re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


# -- helpers ---------------------------------------------------------------------------------------------------------
def _blank(m: re.Match) -> str:
    return m.group()[0] + " " * (len(m.group()) - 2) + m.group()[-1]


def selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (operator, value)}) of each series selector in a PromQL expression."""
    masked = _STRING.sub(_blank, expr)
    masked = _BRACES.sub(_blank, masked)
    masked = _BRACKETS.sub(_blank, masked)
    masked = _GROUPING.sub(lambda m: " " * len(m.group()), masked)
    out = []
    for m in _IDENTIFIER.finditer(masked):
        rest = masked[m.end():]
        if m.group() in KEYWORDS or rest.lstrip().startswith("("):  # a keyword, a function or an aggregation
            continue
        start = m.end() + len(rest) - len(rest.lstrip())
        matchers = {}
        if masked[start:start + 1] == "{":
            body = expr[start + 1:masked.index("}", start)]
            matchers = {label: (op, value) for label, op, value in _MATCHER.findall(body)}
        out.append((m.group(), matchers))
    return out


def raw_queries(path: Path) -> list[tuple[str, str]]:
    """(where, expr) of every query the dashboard holds, its variables unsubstituted."""
    d = load(path)
    out = [(f"panel {p.get('title')!r}", t["expr"]) for p in panels(d) for t in p.get("targets", []) if "expr" in t]
    out += [(f"annotation {a['name']!r}", a["target"]["expr"]) for a in d["annotations"]["list"]]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"])
            assert m, var
            out.append((f"variable {var['name']!r}", m.group(1)))
    return out


VLLM_GAUGES = (names.VLLM_REQUESTS_RUNNING, names.VLLM_REQUESTS_WAITING, names.VLLM_KV_CACHE_USAGE)
VLLM_COUNTERS = (names.VLLM_GENERATION_TOKENS, names.VLLM_PROMPT_TOKENS)


def vllm_pod_registry() -> CollectorRegistry:
    """A stand-in for what a generator pod of engine vllm exports once its engines run: vLLM's own series, which
    the pod re-exports as they are, labelled engine (the data-parallel engine's index) and model_name; here two
    engines. (vLLM is not in this venv: its own tests scrape the real pod.)"""
    registry = CollectorRegistry()
    metrics = [Gauge(name, name, ["engine", "model_name"], registry=registry) for name in VLLM_GAUGES]
    metrics += [Counter(name, name, ["engine", "model_name"], registry=registry) for name in VLLM_COUNTERS]
    for metric in metrics:
        for engine in ("0", "1"):
            metric.labels(engine, "/work/model")
    return registry


def fresh_registries() -> dict[str, CollectorRegistry]:
    """The registries as each process has them right after it starts, before any event: the operator, a generator
    pod that has set its first layout (two TP=1 groups), the trainer, and a generator pod of engine vllm."""
    engine = EngineMetrics(max_seq=64)
    engine.set_layout([(0,), (1,)], 0)
    return {"operator": OperatorMetrics().registry, "generator": engine.registry,
            "trainer": TrainerMetrics("127.0.0.1", port=0).registry, "vllm": vllm_pod_registry()}


def exported(registries: dict[str, CollectorRegistry]) -> dict[str, list[dict[str, str]]]:
    """Each sample name the registries expose -> the label sets of its samples."""
    out: dict[str, list[dict[str, str]]] = {}
    for registry in registries.values():
        for family in registry.collect():
            for sample in family.samples:
                out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def contract_names() -> set[str]:
    """The metric names of metric_names: the project's (pat_) and the vLLM series its vLLM pods re-export."""
    prefixes = (names.PREFIX, names.VLLM_PREFIX)
    return {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str) and v.startswith(prefixes)
            and v not in prefixes}


def unknown_metrics(path: Path, samples: dict[str, list[dict[str, str]]]) -> list[str]:
    """What is wrong with the metric names of the dashboard's queries: a query that names none, a name no fresh
    registry exposes, or one whose base name (less _total, _bucket, _sum, _count) is not in metric_names."""
    contract, problems = contract_names(), []
    for where, expr in raw_queries(path):
        found = [name for name, _ in selectors(expr)]
        if not found:
            problems.append(f"{where}: names no metric: {expr}")
        for name in found:
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            if name not in samples or base not in contract:
                problems.append(f"{where}: {name} is not a metric the project exports")
    return problems


def unscoped(path: Path, required: dict[str, str]) -> list[str]:
    """Selectors of the dashboard's panel and annotation queries that lack one of the required label="value"."""
    return [f"{where}: {name} lacks {label}={value!r}: {expr}"
            for where, expr in raw_queries(path) if not where.startswith("variable")
            for name, matchers in selectors(expr)
            for label, value in required.items() if matchers.get(label) != ("=", value)]


def _matches(labels: dict[str, str], matchers: dict[str, tuple[str, str]]) -> bool:
    for label, (op, value) in matchers.items():
        if label in TARGET_LABELS:
            continue
        have = labels.get(label, "")
        ok = {"=": have == value, "!=": have != value, "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


# -- structure -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_dashboard_the_sidecar_can_load(path):
    text = path.read_text()
    d = json.loads(text)
    assert "__inputs" not in d and "__requires" not in d and "${DS_" not in text  # no import-time inputs
    assert d["schemaVersion"] == 39 and d.get("id") is None
    assert re.fullmatch(r"[a-z0-9-]{8,40}", d["uid"]) and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DS, var
    for annotation in d["annotations"]["list"]:
        # Grafana's Prometheus annotation: the query in target (expr, interval: the min step), not the legacy
        # top-level expr/step that Grafana migrates on load; titleFormat, tagKeys, textFormat stay at the top.
        target = annotation["target"]
        assert annotation["datasource"] == target["datasource"] == DS and target["expr"] and target["refId"], annotation
        assert not {"expr", "step"} & annotation.keys(), annotation
    every = panels(d)
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), ids
    titles = [p["title"] for p in every]
    assert len(titles) == len(set(titles)), titles
    cells: set[tuple[int, int]] = set()
    for p in every:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == DS and p["targets"], p["title"]
        for target in p["targets"]:
            assert target["datasource"] == DS and target["expr"] and target["refId"], (p["title"], target)
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    assert [p for p in every if p["type"] == "row"]  # rows are there, so panel_queries must look into them


def test_the_dashboards_are_distinct():
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids)


def test_variables():
    job = {v["name"]: v for v in load(RLHF_JOB)["templating"]["list"]}
    assert job["namespace"]["query"] == f"label_values({names.TRAINER_ITERATION}, namespace)"
    assert job["job"]["query"] == f'label_values({names.TRAINER_ITERATION}{{namespace="$namespace"}}, pat_job)'
    operator = {v["name"]: v for v in load(OPERATOR)["templating"]["list"]}
    assert operator["namespace"]["query"] == f"label_values({names.OPERATOR_RECONCILES}_total, namespace)"
    assert variable_queries(RLHF_JOB, **VARIABLES) == [
        ("namespace", f"group by (namespace) ({names.TRAINER_ITERATION})"),
        ("job", f'group by (pat_job) ({names.TRAINER_ITERATION}{{namespace="ns"}})')]


def test_the_panels_the_issue_asks_for():
    titles = {t for t, _ in panel_queries(RLHF_JOB, **VARIABLES)}
    assert {"Iteration time by phase", "Reward", "Requests running and waiting per replica group", "TP layout",
            "Tokens/s", "Decode step latency by TP", "Regroups by outcome"} <= titles
    exprs = "\n".join(q for _, q in panel_queries(RLHF_JOB, **VARIABLES))
    for name in (names.TRAINER_PHASE_SECONDS, names.TRAINER_REWARD_MEAN, names.TRAINER_REWARD_STD,
                 names.GENERATOR_REQUESTS_RUNNING, names.GENERATOR_REQUESTS_WAITING, names.GENERATOR_TP_SIZE,
                 names.GENERATOR_TOKENS + "_total", names.GENERATOR_STEP_SECONDS + "_bucket",
                 names.GENERATOR_REGROUPS + "_total", names.TRAINER_ROLLOUT_LOGPROB_DIFF_MEAN,
                 names.TRAINER_ROLLOUT_LOGPROB_DIFF_MAX, names.TRAINER_ROLLOUT_KL):
        assert name in exprs, name
    assert annotation_queries(RLHF_JOB, **VARIABLES)
    exprs = "\n".join(q for _, q in panel_queries(OPERATOR, namespace="ns"))
    for name in (names.OPERATOR_RECONCILES + "_total", names.OPERATOR_RECONCILE_SECONDS + "_bucket",
                 names.OPERATOR_PODS_CREATED + "_total", names.OPERATOR_GANG_RESTARTS + "_total", names.OPERATOR_JOBS,
                 names.OPERATOR_API_ERRORS + "_total", names.OPERATOR_REGROUP_PLANS + "_total",
                 names.OPERATOR_REGROUP_ATTEMPTS + "_total", names.OPERATOR_REGROUP_DELAY_SECONDS + "_bucket",
                 names.OPERATOR_PROMETHEUS_ERRORS + "_total"):
        assert name in exprs, name


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_round_trips_through_grafana_foundation_sdk(path):
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models import prometheus
    from grafana_foundation_sdk.models.dashboard import Dashboard, RowPanel

    register_default_plugins()
    original = load(path)
    model = Dashboard.from_json(original)
    assert all(isinstance(t, prometheus.Dataquery)  # decoded as Prometheus queries, not kept as unknown blobs
               for p in model.panels if not isinstance(p, RowPanel) for t in p.targets)
    again = json.loads(json.dumps(model.to_json(), cls=JSONEncoder))

    def summary(d: dict) -> dict:
        return {
            "uid": d["uid"], "title": d["title"], "schemaVersion": d["schemaVersion"],
            "panels": [(p["type"], p["id"], p["title"], p["gridPos"], p.get("datasource"), p.get("targets"))
                       for p in panels(d)],
            "variables": [(v["name"], v["type"], v.get("query"), v.get("datasource")) for v in d["templating"]["list"]],
            # (its AnnotationTarget is the built-in Grafana source's tags query: a Prometheus target's expr is lost;
            # test_grafana_schema types it as the Prometheus plugin's query)
            "annotations": [(a["name"], a["datasource"], a["enable"]) for a in d["annotations"]["list"]],
        }

    assert summary(again) == summary(original)


# -- the queries -----------------------------------------------------------------------------------------------------
def test_the_selector_parser():
    assert selectors('histogram_quantile(0.9, sum by (tp, le) (rate(a_bucket{x="1", y=~"b|c"}[5m]))) / on (le) b') \
        == [("a_bucket", {"x": ("=", "1"), "y": ("=~", "b|c")}), ("b", {})]
    assert selectors("sum(increase(m_total[$__range])) * 60 > 1e-6") == [("m_total", {})]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_queries_name_only_exported_metrics(path):
    assert unknown_metrics(path, exported(fresh_registries())) == []


def test_a_misspelt_metric_is_caught(tmp_path):
    d = load(RLHF_JOB)
    target = next(t for p in panels(d) for t in p.get("targets", []) if "pat_generator_tokens_total" in t["expr"])
    target["expr"] = target["expr"].replace("pat_generator_tokens_total", "pat_generator_token_total")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(d))
    problems = unknown_metrics(broken, exported(fresh_registries()))
    assert len(problems) == 1 and "pat_generator_token_total" in problems[0], problems


def test_a_vllm_name_outside_metric_names_is_caught(tmp_path):
    """vLLM's older name of the KV cache gauge: exported by no process here and not in metric_names."""
    d = load(RLHF_JOB)
    target = next(t for p in panels(d) for t in p.get("targets", []) if names.VLLM_KV_CACHE_USAGE in t["expr"])
    target["expr"] = target["expr"].replace(names.VLLM_KV_CACHE_USAGE, "vllm:gpu_cache_usage_perc")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(d))
    problems = unknown_metrics(broken, exported(fresh_registries()))
    assert len(problems) == 1 and "vllm:gpu_cache_usage_perc" in problems[0], problems


def test_the_job_dashboard_selects_namespace_and_job(tmp_path):
    required = {"namespace": "$namespace", "pat_job": "$job"}
    assert unscoped(RLHF_JOB, required) == []
    assert unscoped(OPERATOR, {"namespace": "$namespace"}) == []
    d = load(RLHF_JOB)  # negative control: a query without the job's selector is caught
    target = next(p for p in panels(d) if p["title"] == "TP layout")["targets"][0]
    target["expr"] = target["expr"].replace(', pat_job="$job"', "")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(d))
    assert [p for p in unscoped(broken, required) if "TP layout" in p and "pat_job" in p]


def test_panel_queries_fill_in_every_variable():
    queries = [q for p in DASHBOARDS for _, q in panel_queries(p, **VARIABLES) + annotation_queries(p, **VARIABLES)]
    assert len(queries) > 30 and not [q for q in queries if "$" in q]
    assert all('namespace="ns", pat_job="demo"' in q for _, q in panel_queries(RLHF_JOB, **VARIABLES))
    assert any(f"[{BUILTINS['__rate_interval']}]" in q for q in queries)
    with pytest.raises(KeyError):
        panel_queries(RLHF_JOB, namespace="ns")  # $job left out
    assert substitute("a{x=\"${job}\"}[$__rate_interval]", job="j", __rate_interval="4s") == 'a{x="j"}[4s]'
    assert unfiltered("sum(x) > 0") == "sum(x)"


def _promtool(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    rules = {"groups": [{"name": "dashboards", "rules": [{"record": f"dashboard:query:{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / f"rules-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([installed("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_promtool_accepts_every_query(tmp_path):
    exprs = [q for p in DASHBOARDS for _, q in panel_queries(p, **VARIABLES) + annotation_queries(p, **VARIABLES)
             + variable_queries(p, **VARIABLES)]
    result = _promtool(exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout, result.stdout
    for broken in ("sum by (phase (pat_trainer_iteration)", "rate(pat_generator_tokens_total)"):  # syntax, type
        result = _promtool(exprs[:1] + [broken], tmp_path)
        assert result.returncode != 0, broken


# -- every query answered from the first scrape ----------------------------------------------------------------------
def _literal_labels(sources: list[Path], attribute: str) -> set[str]:
    """String literals passed to `<...>.<attribute>.labels(...)` in the sources."""
    out = set()
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "labels" \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == attribute:
                out |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def test_every_label_value_the_operator_uses_is_set_up_front():
    operator = sorted((ROOT / "operator" / "pat_operator").glob("*.py"))
    samples = exported({"operator": OperatorMetrics().registry})

    def values(name: str, label: str) -> set[str]:
        return {s[label] for s in samples.get(name, []) if label in s}

    assert _literal_labels(operator, "reconciles") == values(names.OPERATOR_RECONCILES + "_total", "result")
    assert _literal_labels(operator, "api_errors") == values(names.OPERATOR_API_ERRORS + "_total", "verb")
    assert _literal_labels(operator, "regroup_attempts") == values(names.OPERATOR_REGROUP_ATTEMPTS + "_total", "result")
    acknowledged = typing.get_args(RegroupAck.model_fields["outcome"].annotation)  # regroup_plans.labels(ack.outcome)
    outcomes = _literal_labels(operator, "regroup_plans") | set(acknowledged)
    assert outcomes == values(names.OPERATOR_REGROUP_PLANS + "_total", "outcome") == set(REGROUP_PLAN_OUTCOMES)
    assert values(names.OPERATOR_JOBS, "phase") == set(PHASES)
    # The reasons: PrometheusError's (its first argument) and those the autoscaler assigns to `reason` itself.
    reasons = set()
    for source in (ROOT / "operator/pat_operator/prometheus.py", ROOT / "operator/pat_operator/autoscaler.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PrometheusError" and node.args:
                reasons.add(node.args[0].value)
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "reason" for t in node.targets):
                choices = [node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp) else [node.value]
                reasons |= {c.value for c in choices if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    assert reasons == set(PROMETHEUS_ERROR_REASONS) == values(names.OPERATOR_PROMETHEUS_ERRORS + "_total", "reason")


def test_every_label_value_the_workers_use_is_set_up_front():
    samples = exported(fresh_registries())
    assert {s["outcome"] for s in samples[names.GENERATOR_REGROUPS + "_total"]} == {"applied", "fallback"}
    assert {s["mode"] for s in samples[names.GENERATOR_REGROUP_REQUESTS + "_total"]} == set(names.REGROUP_MODES)
    assert {s["mode"] for s in samples[names.GENERATOR_REGROUP_SECONDS + "_count"]} == {*names.REGROUP_MODES, "total"}
    assert {s["tp"] for s in samples[names.GENERATOR_STEP_SECONDS + "_bucket"]} == {"1"}
    assert {s["phase"] for s in samples[names.TRAINER_PHASE_SECONDS]} == set(names.TRAINER_PHASES)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_fresh_metrics_have_a_sample_for_every_selector(path):
    samples = exported(fresh_registries())
    missing = [f"{where}: {name}{matchers}" for where, expr in raw_queries(path) for name, matchers in selectors(expr)
               if not any(_matches(labels, matchers) for labels in samples.get(name, []))]
    assert missing == []


def serve_text(registry: CollectorRegistry) -> ThreadingHTTPServer:
    """The registry's /metrics in the text format only, as the vLLM pod must serve vLLM's series: prometheus_client's
    OpenMetrics writer, which start_http_server picks when Prometheus (2.x) asks for it, turns the colons of sample
    names into underscores (vllm:num_requests_running -> vllm_num_requests_running; prometheus/client_python#1177)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _query(url: str, promql: str) -> list:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}", timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.cluster
def test_a_real_prometheus_answers_every_query_from_the_first_scrapes(tmp_path):
    """The processes right after they start, scraped as the chart's scrape config labels them: every panel and
    variable query returns series, and each annotation query once its `> 0` filter is dropped."""
    servers, scrape = [], []
    target_labels = {"operator": {"namespace": "pat-system", "pod": "pat-operator-0"},
                     "generator": {"namespace": "ns", "pod": "demo-generator-0", "pat_job": "demo",
                                   "pat_role": "generator"},
                     "trainer": {"namespace": "ns", "pod": "demo-trainer-0", "pat_job": "demo", "pat_role": "trainer"},
                     "vllm": {"namespace": "ns", "pod": "demo-generator-1", "pat_job": "demo",
                              "pat_role": "generator"}}
    for role, registry in fresh_registries().items():
        server = serve_text(registry) if role == "vllm" else start_http_server(0, addr="127.0.0.1",
                                                                               registry=registry)[0]
        servers.append(server)
        scrape.append({"job_name": role, "static_configs": [{"targets": [f"127.0.0.1:{server.server_port}"],
                                                             "labels": target_labels[role]}]})
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                                      "scrape_configs": scrape}))
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([installed("prometheus"), f"--config.file={config}",
                                    f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address={url.removeprefix('http://')}"],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        queries = [(f"{p.name}: {t}", q) for p in DASHBOARDS for t, q in
                   panel_queries(p, namespace="ns" if p == RLHF_JOB else "pat-system", job="demo")
                   + [(f"annotation {n}", unfiltered(q)) for n, q in
                      annotation_queries(p, namespace="ns" if p == RLHF_JOB else "pat-system", job="demo")]
                   + [(f"variable {n}", q) for n, q in variable_queries(p, namespace="ns")]]
        deadline, empty = time.monotonic() + 60, queries
        while empty and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                empty = [(w, q) for w, q in empty if not _query(url, q)]
            except OSError:  # not listening yet
                continue
            assert process.poll() is None, log.read_text()
        assert empty == [], log.read_text()[-3000:]
    finally:
        process.terminate()
        process.wait(10)
        for server in servers:
            server.shutdown()
            server.server_close()
