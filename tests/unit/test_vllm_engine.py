"""generator.engine: vllm on the operator's side: the spec (each error names the field and the fix; a valid vLLM job
is the negative control; the CRD's CEL rules for them run in tests/cel), the generator pod's command line, the
fit check of what still applies, and the requests running / waiting that the operator reads from Prometheus into
each generator pod's status, with a GeneratorQueue event when a pod gets busy."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import yaml
from aiohttp import web

from pat_operator import builders, commands, fit
from pat_operator import metric_names as names
from pat_operator.api import VLLM_MANAGED_FLAGS, VLLM_WORKER_IMAGE, GeneratorPodStatus, JobSpecError, parse_job
from pat_operator.autoscaler import AutoscaleSettings
from pat_operator.handlers import _Observer
from pat_operator.operator_metrics import OperatorMetrics
from pat_operator.prometheus import queue_depths, queue_queries
from pat_operator.reconcile import Observed, decide, pod_view, queue_event

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "vllm.yaml"
LLAMA = fit.SHAPES["llama-3.1-8b"]
GIB, KIB = 1 << 30, 1 << 10
H100, A100_40 = fit.GPUS["H100-SXM"].memory_bytes, fit.GPUS["A100-40GB"].memory_bytes


def example(**generator) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for key, value in generator.items():
        if value is None:
            doc["spec"]["generator"].pop(key, None)
        else:
            doc["spec"]["generator"][key] = value
    return doc


def with_vllm(**settings) -> dict:
    doc = example()
    doc["spec"]["generator"]["vllm"].update(settings)
    return doc


def with_vllm_adaptive(**settings) -> dict:
    doc = with_vllm(**settings)
    doc["spec"]["generator"]["adaptiveTP"] = {"enabled": True}
    return doc


def refused(doc: dict) -> str:
    with pytest.raises(JobSpecError) as e:
        parse_job(doc)
    return str(e.value)


# --- the spec ----------------------------------------------------------------------------------------------------

def test_the_vllm_example_is_valid_for_the_models():  # and for the CRD: tests/cel (a real 1.36 API server)
    job = parse_job(example())
    g = job.spec.generator
    assert (g.engine, g.adaptive, g.ranks, g.vllm.tensor_parallel_size) == ("vllm", False, 2, 1)
    assert g.image == VLLM_WORKER_IMAGE and g.vllm.max_model_len is None and g.vllm.enforce_eager


@pytest.mark.parametrize("engine, enabled, adaptive", [
    ("pat", None, True), ("pat", False, False), ("pat", True, True), ("vllm", None, False), ("vllm", False, False)])
def test_adaptive_tp_defaults_to_on_with_engine_pat_only(engine, enabled, adaptive):
    doc = example(engine=engine)
    doc["spec"]["generator"]["adaptiveTP"] = {} if enabled is None else {"enabled": enabled}
    assert parse_job(doc).spec.generator.adaptive is adaptive


# The CRD's CEL rules for these (same wording) run on a real API server in tests/cel/test_cel.py.
@pytest.mark.parametrize("doc, model_error", [
    (with_vllm(tensorParallelSize=3),
     "spec.generator: generator.vllm.tensorParallelSize=3 does not divide the 2 ranks per pod; use one of [1, 2]"),
    (example(adaptiveTP={"enabled": True}, gpusPerPod=2, ranksPerPod=None),
     "spec.generator: generator.adaptiveTP.enabled with engine vllm runs on CPU only (gpusPerPod: 0): on GPUs the "
     "engines of every layout share a GPU, and handing the weights on between them (CUDA IPC) is not built"),
    (with_vllm_adaptive(tensorParallelSize=2),
     "spec.generator: generator.vllm.tensorParallelSize=2 with adaptive TP: the pod's base layout is all TP=1 "
     "engines (adaptiveTP.tpSizes sets the sizes its planner may use); leave tensorParallelSize at 1, or set "
     "adaptiveTP.enabled: false"),
    (with_vllm(maxModelLen=100),
     "spec.generator: generator.vllm.maxModelLen=100 is below generator.maxSeq=128: vLLM would refuse the longest "
     "sequences; raise it to at least 128 or leave it out (default: maxSeq)"),
], ids=["tp-does-not-divide-ranks", "adaptive-tp-on-gpus",
         "adaptive-tp-from-tp-2", "max-model-len-below-max-seq"])
def test_cross_field_errors_name_the_field_and_the_fix(doc, model_error):
    assert model_error in refused(doc)


@pytest.mark.parametrize("generator, tp, ok", [
    ({"gpusPerPod": 0, "ranksPerPod": 2}, 2, True),
    ({"gpusPerPod": 0, "ranksPerPod": 2}, 4, False),
    ({"gpusPerPod": 4, "ranksPerPod": None}, 4, True),  # one rank per GPU
    ({"gpusPerPod": 4, "ranksPerPod": None}, 8, False),
    ({"gpusPerPod": None, "ranksPerPod": None}, 1, True),  # gpusPerPod's default: 1 GPU, 1 rank
    ({"gpusPerPod": None, "ranksPerPod": None}, 2, False),
])
def test_the_tp_rule_counts_ranks_as_the_models_do(generator, tp, ok):
    doc = example(**generator)
    doc["spec"]["generator"]["vllm"]["tensorParallelSize"] = tp
    if ok:
        assert parse_job(doc).spec.generator.vllm.tensor_parallel_size == tp
    else:
        assert "generator.vllm.tensorParallelSize" in refused(doc)


def test_extra_args_that_the_pod_does_not_manage_pass():
    doc = with_vllm(extraArgs=["--max-num-seqs=128", "--enable-prefix-caching", "--kv-cache-dtype=fp8",
                               "--chat-template=a b c"])
    assert parse_job(doc).spec.generator.vllm.extra_args[0] == "--max-num-seqs=128"


@pytest.mark.parametrize("flag", sorted(VLLM_MANAGED_FLAGS))
@pytest.mark.parametrize("form", ["{}", "{}=1"], ids=["flag", "flag=value"])
def test_a_flag_the_pod_manages_is_refused_naming_what_to_set_instead(flag, form):
    arg = form.format(flag)
    error = refused(with_vllm(extraArgs=["--max-num-seqs=8", arg]))
    assert (f"spec.generator.vllm: generator.vllm.extraArgs: {arg!r} sets {flag}, which the generator pod "
            f"manages; {VLLM_MANAGED_FLAGS[flag]}") in error


@pytest.mark.parametrize("arg, flag, instead", [
    ("--max_model_len=64", "--max-model-len", "set generator.vllm.maxModelLen"),  # vLLM reads _ as -
    ("--no-enforce-eager", "--enforce-eager", "set generator.vllm.enforceEager"),
    ("--gpu_memory_utilization", "--gpu-memory-utilization", "set generator.vllm.gpuMemoryUtilization"),
    ("-tp=2", "-tp", "set generator.vllm.tensorParallelSize"),
])
def test_other_spellings_of_a_managed_flag_are_refused_too(arg, flag, instead):
    assert f"{arg!r} sets {flag}, which the generator pod manages; {instead}" in refused(with_vllm(extraArgs=[arg]))


@pytest.mark.parametrize("arg", ["128", "-q", "max-num-seqs=8", "--max-num-seqs 128", ""])
def test_an_entry_that_is_not_one_whole_flag_is_refused(arg):
    error = refused(with_vllm(extraArgs=[arg]))
    assert f"generator.vllm.extraArgs: {arg!r}: each entry must start with -- and be one whole flag" in error


@pytest.mark.parametrize("settings, field", [
    ({"tensorParallelSize": 0}, "spec.generator.vllm.tensorParallelSize: Input should be greater than or equal to 1"),
    ({"gpuMemoryUtilization": 1.5}, "spec.generator.vllm.gpuMemoryUtilization: Input should be less than or equal"),
    ({"maxModelLen": 1}, "spec.generator.vllm.maxModelLen: Input should be greater than or equal to 2"),
    ({"tensorParalelSize": 2}, "spec.generator.vllm.tensorParalelSize: unknown field; did you mean "
                               "tensorParallelSize?"),
])
def test_bad_vllm_settings_are_named(settings, field):
    assert field in refused(with_vllm(**settings))


# --- the generator pod's command line ----------------------------------------------------------------------------

def test_generator_args_for_engine_vllm():
    spec = parse_job(example()).spec
    assert commands.generator_args(spec, "/work/model", "$(POD_IP)", "/etc/token") == [
        "generator", "--engine", "vllm", "--model", "/work/model", "--ranks", "2", "--host", "$(POD_IP)",
        "--port", "8000", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9", "--max-model-len", "128",
        "--dtype", "float32", "--device", "cpu", "--enforce-eager", "--token-file", "/etc/token"]
    doc = example(gpusPerPod=4, ranksPerPod=None, port=9000)
    doc["spec"]["model"]["dtype"] = "bfloat16"
    doc["spec"]["tokenizer"] = {"path": "/models/tok"}
    doc["spec"]["generator"]["vllm"] = {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.8, "maxModelLen": 4096,
                                        "extraArgs": ["--max-num-seqs=128", "--enable-prefix-caching"]}
    assert commands.generator_args(parse_job(doc).spec, "/m", "0.0.0.0") == [
        "generator", "--engine", "vllm", "--model", "/m", "--ranks", "4", "--host", "0.0.0.0", "--port", "9000",
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8", "--max-model-len", "4096",
        "--dtype", "bfloat16", "--device", "cuda", "--tokenizer", "/models/tok",
        "--vllm-arg=--max-num-seqs=128", "--vllm-arg=--enable-prefix-caching"]
    # adaptive TP: one engine per group of every layout of these sizes, planned by the pod
    args = commands.generator_args(parse_job(with_vllm_adaptive()).spec, "/m", "h")
    assert args[args.index("--tp-sizes"):args.index("--tp-sizes") + 6] == ["--tp-sizes", "1,2", "--controller", "pod",
                                                                           "--margin", "0.1"]


def test_engine_pat_keeps_its_command_line_and_the_pods_run_the_right_one():
    pat = example(engine="pat", adaptiveTP={"controller": "pod"})
    args = commands.generator_args(parse_job(pat).spec, "/m", "h")
    assert "--engine" not in args and args[args.index("--controller") + 1] == "pod"  # adaptive: on by default
    job = parse_job({**example(), "metadata": {"name": "v", "namespace": "ns"}})
    (container,) = builders.pod(job, "uid", "generator", 0, 0)["spec"]["containers"]
    assert container["image"] == VLLM_WORKER_IMAGE and container["args"][:3] == ["generator", "--engine", "vllm"]
    (trainer,) = builders.pod(job, "uid", "trainer", 0, 0)["spec"]["containers"]
    assert trainer["image"] != VLLM_WORKER_IMAGE


# --- will it fit? ------------------------------------------------------------------------------------------------

def llama_vllm(tp: int = 1, dtype: str = "bfloat16", **settings):
    doc = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b.yaml").read_text())
    doc["spec"]["placement"] = "separate"  # the generator pods' own GPUs
    doc["spec"]["model"]["dtype"] = dtype
    doc["spec"]["generator"].update(engine="vllm", adaptiveTP={})
    doc["spec"]["generator"]["vllm"] = {"tensorParallelSize": tp, **settings}
    return parse_job(doc).spec


def test_the_vllm_estimate_counts_the_weights_shard_and_one_sequence_of_kv():
    """Llama-3.1-8B in bf16 at TP=2: half the weights per GPU, and half the KV heads (4 of 8) of one sequence of
    maxSeq=9216 tokens, 64 KiB a token; within vllm.gpuMemoryUtilization, not generator.memoryUtilization."""
    s = llama_vllm(2, gpuMemoryUtilization=0.5)
    weights, kv = 8_030_261_248 * 2 / 2, 9216 * 64 * KIB
    assert fit.need(s, LLAMA, "generator") == weights + kv
    assert fit.allowance(s, "generator", H100) == 0.5 * H100
    m = fit.generator_memory(s, LLAMA, H100)
    assert m.terms[0] == ("weights (bfloat16, 1/2 of the model)", weights)
    blocks = int((0.5 * H100 - weights) / (16 * 64 * KIB))
    assert fit.kv_blocks(s, LLAMA, H100) == (blocks, blocks)  # no maxBatch cap: vLLM's KV cache takes the rest
    assert m.terms[1] == (f"KV cache ({blocks // 576} x 9216 tokens)", blocks * 16 * 64 * KIB)
    assert fit.generator_memory(s, LLAMA).terms[1] == ("KV cache (at least 1 x 9216 tokens)", kv)
    # maxModelLen, when set, is the sequence counted
    assert fit.need(llama_vllm(2, maxModelLen=16384), LLAMA, "generator") == weights + 16384 * 64 * KIB
    assert fit.problems(s, LLAMA, {"generator": fit.GPUS["H100-SXM"]}) == []


def test_a_vllm_generator_that_does_not_fit_names_the_vllm_fields():
    s = llama_vllm(1, "float32", gpuMemoryUtilization=0.5)
    (message,) = fit.problems(s, LLAMA, {"generator": fit.GPUS["A100-40GB"]})
    assert message == (
        "spec.generator.vllm.gpuMemoryUtilization: a vLLM engine of llama-3.1-8b needs 32.2 GiB per GPU (its 1/1 of "
        "the weights and of the KV cache of one sequence of maxModelLen=9216 tokens; vLLM's own working memory is not "
        "counted) with gpuMemoryUtilization=0.5, more than the 20.0 GiB it may use of an A100-40GB's 40.0 GiB; with "
        "gpuMemoryUtilization=0.81: 32.2 GiB of 32.4 GiB; also fits: model.dtype=bfloat16 (16.1 GiB), "
        "generator.vllm.tensorParallelSize=2 (16.1 GiB)")


def test_vllm_limits_from_the_models_shape():
    long = llama_vllm(1, maxModelLen=200_000)
    assert fit.problems(long, LLAMA, {}) == [
        "spec.generator.vllm.maxModelLen: generator.vllm.maxModelLen=200000 is beyond the model's "
        "max_position_embeddings=131072; lower generator.vllm.maxModelLen to 131072 or less"]
    twelve_heads = dataclasses.replace(LLAMA, heads=12, name="twelve")
    assert fit.problems(llama_vllm(8), twelve_heads, {}) == [
        "spec.generator.vllm.tensorParallelSize: vLLM splits the model's 12 attention heads over the 8 GPUs of an "
        "engine; use one of [1, 2, 4]"]
    assert fit.problems(llama_vllm(4), twelve_heads, {}) == []  # the negative control
    # engine pat: its own engine's rules, as before
    pat = parse_job(yaml.safe_load((ROOT / "examples" / "llama-3.1-8b.yaml").read_text())).spec
    assert fit.allowance(pat, "generator", H100) == pat.generator.memory_utilization * H100


# --- requests running / waiting from Prometheus -------------------------------------------------------------------

def test_the_queue_queries_take_either_engines_gauges():
    running, waiting = queue_queries("team", ["job-generator-0", "job.generator-1"])
    match = 'namespace="team",pod=~"job-generator-0|job\\\\.generator-1"'
    assert running == (f"sum by (pod) ({names.GENERATOR_REQUESTS_RUNNING}{{{match}}}) or "
                       f"sum by (pod) (vllm:num_requests_running{{{match}}})")
    assert waiting == (f"sum by (pod) (pat_generator_requests_waiting{{{match}}}) or "
                       f"sum by (pod) ({names.VLLM_REQUESTS_WAITING}{{{match}}})")


def sample(pod: str | None, value) -> dict:
    return {"metric": {} if pod is None else {"pod": pod}, "value": [1700000000.0, value]}


def test_queue_depths_per_pod():
    running = [sample("g-0", "12"), sample("g-1", "0"), sample("g-2", "NaN"), sample(None, "3"), {"metric": {}}]
    waiting = [sample("g-0", "52"), sample("g-3", "4.0"), sample("g-1", "bad")]
    assert queue_depths(running, waiting) == {"g-0": (12, 52), "g-1": (0, None), "g-3": (None, 4)}
    assert queue_depths([], []) == {}


def status(pod: str = "g-0", running: int | None = None, waiting: int | None = None) -> GeneratorPodStatus:
    return GeneratorPodStatus(pod=pod, running=running, waiting=waiting)


@pytest.mark.parametrize("old, new, message", [
    (status(), status(running=12, waiting=52), "pod g-0: 12 running, 52 waiting (vllm:num_requests_*)"),
    (status(running=0, waiting=0), status(running=1, waiting=0), "pod g-0: 1 running, 0 waiting "
                                                                 "(vllm:num_requests_*)"),
    (status(running=0), status(waiting=3), "pod g-0: ? running, 3 waiting (vllm:num_requests_*)"),
    (status(running=3, waiting=0), status(running=12, waiting=52), None),  # busy already: no event per poll
    (status(running=3), status(running=0, waiting=0), None),  # busy -> idle
    (status(), status(running=0, waiting=0), None),
    (status(), status(), None),
])
def test_a_queue_event_when_a_pod_goes_from_idle_to_busy(old, new, message):
    event = queue_event(old, new, "vllm")
    assert (event and (event.type, event.reason, event.message)) == (message and ("Normal", "GeneratorQueue",
                                                                                  message))


def test_the_event_names_engine_pats_metrics_for_engine_pat():
    event = queue_event(status(), status(running=2, waiting=0), "pat")
    assert event.message == "pod g-0: 2 running, 0 waiting (pat_generator_requests_*)"


T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_decide_keeps_queue_depths_out_of_the_status_and_posts_the_observations_queue_events():
    """A busy job's queues change every few seconds: in the status they would be a write each time. They stay in
    Prometheus; the GeneratorQueue event the observer made of them is posted once."""
    doc = example()
    doc["metadata"].update(namespace="ns", uid="uid-1", generation=1)
    first = decide(Observed(doc, [], T0, b"k" * 16))
    pods = [pod_view({**p, "status": {"phase": "Running", "podIP": "10.0.0.9",
                                      "conditions": [{"type": "Ready", "status": "True"}],
                                      "containerStatuses": [{"name": "x", "state": {"running": {}}}]}})
            for p in first.create_pods]
    doc["status"] = first.status
    pod = next(p.name for p in pods if p.role == "generator")
    busy = queue_event(GeneratorPodStatus(pod=pod), GeneratorPodStatus(pod=pod, running=12, waiting=52), "vllm")
    observed = {pod: GeneratorPodStatus(pod=pod, layout=[1], running=12, waiting=52)}
    d = decide(Observed(copy.deepcopy(doc), pods, T0 + timedelta(seconds=1), b"k" * 16, generators=observed,
                        queue_events=(busy,)))
    (g,) = d.status["generators"]
    assert g["layout"] == [1] and "running" not in g and "waiting" not in g
    assert [e.message for e in d.events if e.reason == "GeneratorQueue"] == [
        f"pod {pod}: 12 running, 52 waiting (vllm:num_requests_*)"]
    doc["status"] = d.status
    again = decide(Observed(copy.deepcopy(doc), pods, T0 + timedelta(seconds=2), b"k" * 16, generators=observed))
    assert again.status == d.status and again.events == []  # a new depth alone writes nothing, posts nothing


class FakePrometheus:
    """/api/v1/query answering the queue queries from `running` / `waiting` ({pod: value}), or failing."""

    def __init__(self):
        self.running: dict[str, str] = {}
        self.waiting: dict[str, str] = {}
        self.fail = False
        self.queries: list[str] = []

    async def query(self, request: web.Request) -> web.Response:
        promql = request.query["query"]
        self.queries.append(promql)
        if self.fail:
            return web.json_response({"status": "error", "error": "boom"}, status=500)
        values = self.running if "running" in promql else self.waiting
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": [
            sample(pod, v) for pod, v in values.items()]}})


async def _observe_queues() -> tuple[list, OperatorMetrics, FakePrometheus]:
    prometheus = FakePrometheus()
    app = web.Application()
    app.add_routes([web.get("/api/v1/query", prometheus.query)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    metrics = OperatorMetrics()
    seen = []
    try:
        async with aiohttp.ClientSession() as session:
            memo = SimpleNamespace(session=session, metrics=metrics, autoscale=AutoscaleSettings(), prometheus_auth=None)
            status = {"generators": [{"pod": "g-0", "layout": [1, 1], "regroups": 2}]}
            observer = _Observer(memo, "token", status, f"http://127.0.0.1:{port}")
            body = {"metadata": {"namespace": "ns"}, "spec": {"generator": {"port": 1}}}  # /v1/state: refused
            pods = [SimpleNamespace(name=n, role="generator", index=i, phase="Running", ip="127.0.0.1",
                                    deleting=False, ready=True) for i, n in enumerate(("g-0", "g-1"))]

            async def observe() -> None:
                observer.last = 0.0
                _, generators, events = await observer.observe(body, pods)
                seen.append({n: (g.running, g.waiting, g.regroups) for n, g in sorted(generators.items())})
                seen.append([e.message for e in events])

            prometheus.running, prometheus.waiting = {"g-0": "12", "g-1": "0"}, {"g-0": "52"}
            await observe()
            prometheus.fail = True  # an error: counted, the last values stay
            await observe()
            prometheus.fail, prometheus.running, prometheus.waiting = False, {"g-1": "3"}, {"g-1": "1"}
            await observe()  # g-0 has no sample now: its last values stay too
            await runner.cleanup()
            await observe()  # Prometheus is gone
    finally:
        if runner.server is not None:
            await runner.cleanup()
    return seen, metrics, prometheus


def test_the_observer_reads_the_queues_from_prometheus_and_keeps_the_last_on_errors():
    seen, metrics, prometheus = asyncio.run(_observe_queues())
    busy = "running, {} waiting (pat_generator_requests_*)"
    assert seen == [{"g-0": (12, 52, 2), "g-1": (0, None, 0)}, ["pod g-0: 12 " + busy.format(52)],
                    {"g-0": (12, 52, 2), "g-1": (0, None, 0)}, [],
                    {"g-0": (12, 52, 2), "g-1": (3, 1, 0)}, ["pod g-1: 3 " + busy.format(1)],
                    {"g-0": (12, 52, 2), "g-1": (3, 1, 0)}, []]  # each busy spell's event once
    errors = {r: metrics.prometheus_errors.labels(r)._value.get() for r in ("QueryFailed", "PrometheusUnreachable")}
    assert errors == {"QueryFailed": 1, "PrometheusUnreachable": 1}
    assert len(prometheus.queries) == 6 and all('pod=~"g-0|g-1"' in q for q in prometheus.queries)


def test_without_a_prometheus_url_the_observer_queries_nothing():
    async def run() -> dict:
        async with aiohttp.ClientSession() as session:
            observer = _Observer(SimpleNamespace(session=session), "token", None)  # no metrics, no autoscale: unused
            pods = [SimpleNamespace(name="g-0", role="generator", index=0, phase="Running", ip="127.0.0.1",
                                    deleting=False, ready=True)]
            _, generators, _ = await observer.observe({"metadata": {"namespace": "ns"},
                                                    "spec": {"generator": {"port": 1}}}, pods)
            return generators
    assert asyncio.run(run()) == {}


def test_a_cpu_vllm_job_whose_heads_vllms_cpu_kernels_do_not_take_is_refused_by_the_fit_check():
    job = parse_job(example())
    assert fit.known_problems(job.spec) == []  # demo-vllm: 32-wide heads
    narrow = example()
    narrow["spec"]["model"]["tiny"]["preset"] = "demo"  # 16-wide heads: vLLM fails at its first request
    [problem] = fit.known_problems(parse_job(narrow).spec)
    assert problem.startswith("spec.generator.engine: vLLM's CPU attention kernels take heads") and "are 16" in problem
    assert "model.tiny.preset: demo-vllm" in problem
    on_gpus = example(gpusPerPod=2, ranksPerPod=None)
    on_gpus["spec"]["model"]["tiny"]["preset"] = "demo"
    assert not any("CPU attention" in p for p in fit.known_problems(parse_job(on_gpus).spec))  # GPU kernels take 16
