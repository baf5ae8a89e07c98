"""kube.call (timeouts, retries with backoff and Retry-After, errors naming the call) against a scripted local server
(tests/stubserver.py) and the real API server; and the EventRecorder's aggregated Events on the real API server."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import kubernetes
import pytest
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from pat_operator import kube
from tests.stubserver import CUT, DROP, HANG, Answer, StubServer

CONFIG_MAP = Answer(200, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": "ns"}})


def status(code: int, reason: str, message: str) -> dict:
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason,
            "message": message}


def client_for(server: StubServer, tmp_path) -> kubernetes.client.ApiClient:
    """kube.api_client on a kubeconfig that names the stub server."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": server.url}}],
        "users": [{"name": "stub", "user": {"token": "t"}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}]}))
    return kube.api_client(str(path))


def read_config_map(api: kubernetes.client.ApiClient, **kwargs):
    core = kubernetes.client.CoreV1Api(api)
    return asyncio.run(kube.call(core.read_namespaced_config_map, "cm", "ns", what="reading configmap ns/cm",
                                 **kwargs))


def gaps(server: StubServer) -> list[float]:
    return [b.at - a.at for a, b in zip(server.requests, server.requests[1:])]


def test_retry_after_is_waited(tmp_path):
    with StubServer(Answer(429, status(429, "TooManyRequests", "slow down"), {"Retry-After": "1"}), CONFIG_MAP) as s:
        assert read_config_map(client_for(s, tmp_path)).metadata.name == "cm"
    assert len(s.requests) == 2
    assert 1.0 <= gaps(s)[0] < 1.5, gaps(s)


def test_5xx_is_retried_with_jittered_backoff(tmp_path):
    with StubServer(Answer(500, status(500, "InternalError", "etcd")), Answer(502, b"bad gateway"), CONFIG_MAP) as s:
        assert read_config_map(client_for(s, tmp_path)).metadata.name == "cm"
    assert len(s.requests) == 3
    first, most = kube.BACKOFF_SECONDS
    assert all(gap < min(most, first * 2 ** i) + 0.2 for i, gap in enumerate(gaps(s))), gaps(s)


@pytest.mark.parametrize("failure", [DROP, CUT])
def test_a_dropped_connection_is_retried(tmp_path, failure):
    """DROP: closed before the answer (urllib3's ProtocolError on the request); CUT: closed mid-body (its
    ProtocolError while the client reads the body, after urllib3 is done)."""
    with StubServer(failure, failure, CONFIG_MAP) as s:
        assert read_config_map(client_for(s, tmp_path)).metadata.name == "cm"
    assert len(s.requests) == 3


def test_bounded_retries_raise_a_kube_error_naming_the_call(tmp_path):
    with StubServer(Answer(503, status(503, "ServiceUnavailable", "etcdserver: leader changed"),
                           {"Retry-After": "1"})) as s:
        core = kubernetes.client.CoreV1Api(client_for(s, tmp_path))
        started = time.monotonic()
        with pytest.raises(kube.KubeError) as e:
            asyncio.run(kube.call(core.delete_namespaced_pod, "p", "ns", what="deleting pod ns/p", within=2.5))
        elapsed = time.monotonic() - started
    # Attempts at 0, 1 and 2 s; a fourth after the next Retry-After would start past 2.5 s.
    assert [r.method for r in s.requests] == ["DELETE"] * 3
    assert 2.0 <= elapsed < 2.5, elapsed
    assert str(e.value) == "deleting pod ns/p: HTTP 503: etcdserver: leader changed (3 attempts in 2.0 s)"
    assert e.value.status == 503


def test_other_4xx_are_raised_unchanged_at_once(tmp_path):
    """The negative control of the retries: a 404 (or 409, 422...) is the caller's to act on."""
    with StubServer(Answer(404, status(404, "NotFound", 'configmaps "cm" not found')), CONFIG_MAP) as s:
        with pytest.raises(ApiException) as e:
            read_config_map(client_for(s, tmp_path))
    assert e.value.status == 404
    assert len(s.requests) == 1


def test_api_client_leaves_the_retries_to_call(tmp_path):
    """kube.api_client turns urllib3's own retries off: one request per attempt. The negative control, a client of
    the default Configuration: urllib3 retries a GET 3 more times inside each attempt."""
    with StubServer(DROP) as s:
        with pytest.raises(kube.KubeError) as e:
            read_config_map(client_for(s, tmp_path), within=0)
    assert len(s.requests) == 1
    assert isinstance(e.value.cause, urllib3.exceptions.ProtocolError)
    assert str(e.value).startswith("reading configmap ns/cm: ProtocolError: ('Connection aborted.'")

    with StubServer(DROP) as s:
        with pytest.raises(kube.KubeError) as e:
            read_config_map(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=s.url)), within=0)
    assert len(s.requests) == 4
    assert isinstance(e.value.cause, urllib3.exceptions.MaxRetryError)


def test_every_call_has_a_request_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT", (1, 0.5))
    with StubServer(HANG) as s:
        api = client_for(s, tmp_path)
        started = time.monotonic()
        with pytest.raises(kube.KubeError) as e:
            read_config_map(api, within=0)
        assert isinstance(e.value.cause, urllib3.exceptions.ReadTimeoutError)
        assert 0.5 <= time.monotonic() - started < 1.5
        # The negative control: the same call without call() waits for as long as the server does.
        released = []

        def plain():
            try:
                kubernetes.client.CoreV1Api(api).read_namespaced_config_map("cm", "ns")
            except urllib3.exceptions.ProtocolError as e:
                released.append(e)

        waiting = threading.Thread(target=plain, daemon=True)
        waiting.start()
        waiting.join(2)
        assert waiting.is_alive()
    waiting.join(5)
    assert released  # by the server's stop


@pytest.mark.cluster
def test_calls_against_the_api_server(cluster, namespace):
    core = kubernetes.client.CoreV1Api(kube.api_client(cluster.kubeconfig))

    async def calls():
        await kube.call(core.create_namespaced_config_map, namespace, {"metadata": {"name": "cm"}, "data": {"a": "1"}},
                        what=f"creating configmap {namespace}/cm")
        found = await kube.call(core.read_namespaced_config_map, "cm", namespace, what=f"reading {namespace}/cm")
        started = time.monotonic()
        with pytest.raises(ApiException) as e:
            await kube.call(core.read_namespaced_config_map, "none", namespace, what=f"reading {namespace}/none")
        return found, e.value, time.monotonic() - started

    found, missing, seconds = asyncio.run(calls())
    assert found.data == {"a": "1"}
    assert missing.status == 404 and seconds < 0.5


# --- Events -----------------------------------------------------------------------------------------------------

@pytest.fixture
def subject(cluster, namespace):
    """A real object for the Events to be about (a ConfigMap: any object with a uid will do), and an admin client."""
    api = kube.api_client(cluster.kubeconfig)
    core = kubernetes.client.CoreV1Api(api)
    response = core.create_namespaced_config_map(namespace, {"metadata": {"name": "subject"}}, _preload_content=False)
    return api, {"apiVersion": "v1", "kind": "ConfigMap", **json.loads(response.data)}


def events_of(api, obj) -> list:
    core = kubernetes.client.CoreV1Api(api)
    return sorted(core.list_namespaced_event(obj["metadata"]["namespace"],
                                             field_selector=f"involvedObject.uid={obj['metadata']['uid']}").items,
                  key=lambda e: e.message)


def post(recorder: kube.EventRecorder, obj, *events: tuple[str, str, str]) -> None:
    async def each():
        for type_, reason, message in events:
            assert await recorder.post(obj, type_, reason, message) is not None

    asyncio.run(each())


@pytest.mark.cluster
def test_repeats_are_one_event_with_a_count(subject):
    api, obj = subject
    post(kube.EventRecorder(api), obj, *[("Warning", "PodForceDeleted", "pod p-0: gone")] * 5)
    [event] = events_of(api, obj)
    assert (event.type, event.reason, event.message, event.count) == ("Warning", "PodForceDeleted", "pod p-0: gone", 5)
    assert event.first_timestamp <= event.last_timestamp
    assert (event.source.component, event.reporting_component) == ("pat-operator", "pat-operator")
    assert (event.involved_object.kind, event.involved_object.name, event.involved_object.uid) == \
        ("ConfigMap", "subject", obj["metadata"]["uid"])

    # The negative control: posting as kopf.event does (a new Event per call) leaves 5 more.
    core = kubernetes.client.CoreV1Api(api)
    for _ in range(5):
        core.create_namespaced_event(obj["metadata"]["namespace"], {
            "metadata": {"generateName": "plain-"}, "involvedObject": kube.involved_object(obj), "type": "Warning",
            "reason": "PodForceDeleted", "message": "pod p-0: gone", "source": {"component": "plain"}})
    assert sorted(e.count or 1 for e in events_of(api, obj)) == [1, 1, 1, 1, 1, 5]


@pytest.mark.cluster
def test_different_messages_are_different_events(subject):
    api, obj = subject
    post(kube.EventRecorder(api), obj, ("Warning", "PodForceDeleted", "pod a: gone"),
         ("Warning", "PodForceDeleted", "pod b: gone"), ("Warning", "PodForceDeleted", "pod a: gone"))
    assert [(e.message, e.count) for e in events_of(api, obj)] == [("pod a: gone", 2), ("pod b: gone", 1)]


@pytest.mark.cluster
def test_high_rate_reasons_are_one_event_with_the_latest_message(subject):
    api, obj = subject
    post(kube.EventRecorder(api), obj, *[("Normal", "Regrouped", f"pod g-0: epoch {i}") for i in range(1, 5)],
         ("Warning", "Regrouped", "pod g-0: fell back"))  # another type: an Event of its own
    assert [(e.type, e.message, e.count) for e in events_of(api, obj)] == [
        ("Normal", "pod g-0: epoch 4", 4), ("Warning", "pod g-0: fell back", 1)]


@pytest.mark.cluster
def test_a_restarted_operator_counts_on(subject):
    api, obj = subject
    post(kube.EventRecorder(api), obj, *[("Normal", "GangRestart", "restart 1")] * 3)
    post(kube.EventRecorder(api), obj, *[("Normal", "GangRestart", "restart 1")] * 2)  # a fresh process's recorder
    assert [e.count for e in events_of(api, obj)] == [5]


@pytest.mark.cluster
def test_two_writers_at_once_lose_no_repeat(subject):
    """Two recorders (two replicas, or one's concurrent posts) racing on one Event: creates and patches that lose
    (409) read it again and count on."""
    api, obj = subject
    a, b = kube.EventRecorder(api), kube.EventRecorder(api)

    async def race():
        posts = [r.post(obj, "Normal", "Regrouped", f"{i}") for i in range(5) for r in (a, b)]
        return await asyncio.gather(*posts)

    assert None not in asyncio.run(race())
    assert [e.count for e in events_of(api, obj)] == [10]


@pytest.mark.cluster
def test_a_repeat_after_the_window_starts_a_new_series(subject):
    api, obj = subject
    post(kube.EventRecorder(api, window=0), obj, *[("Warning", "PodForceDeleted", "pod p-0: gone")] * 3)
    [event] = events_of(api, obj)
    assert event.count == 1
