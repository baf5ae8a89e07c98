"""The test cluster itself: a real v1.20.2 control plane, pods run by the process kubelet, and the fixtures."""

from __future__ import annotations

import ipaddress
import json
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import kubernetes
import pytest
from kubernetes.client import ApiException

from tests.cluster.controlplane import ControlPlane
from tests.cluster.fixtures import Cluster  # the fixtures themselves come from tests/conftest.py
from tests.cluster.kubelet import HOST_ADDRESS, NETNS_DIR, POD_NETWORK, UNREACHABLE_TAINT

GROUP, VERSION, PLURAL = "pat-test.example.com", "v1", "widgets"
PYTHON = "python"  # resolves to the project's venv through the kubelet's PATH


@pytest.fixture(scope="module")
def widgets(cluster: Cluster):
    """A CRD with a structural schema and a status subresource; yields a CustomObjectsApi."""
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": "widget", "kind": "Widget"},
            "versions": [{
                "name": VERSION, "served": True, "storage": True, "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {"size": {"type": "integer", "minimum": 1}}},
                    "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
                }}},
            }],
        },
    }
    with cluster.api_client() as api:
        extensions = kubernetes.client.ApiextensionsV1Api(api)
        try:
            extensions.create_custom_resource_definition(crd, _preload_content=False)
        except ApiException as e:
            if e.status != 409:  # left by an interrupted session on a reused cluster
                raise
        wait_for(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in json.loads(
            extensions.read_custom_resource_definition(crd["metadata"]["name"], _preload_content=False).data
        ).get("status", {}).get("conditions") or []), 30, "the CRD to be established")  # null at first
        yield kubernetes.client.CustomObjectsApi(api)
        extensions.delete_custom_resource_definition(crd["metadata"]["name"], _preload_content=False)


def wait_for(condition: Callable[[], object], timeout: float, what: str, describe: Callable[[], str] = str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{describe()}")
        time.sleep(0.05)
    return result


def pod_manifest(name: str, command: list[str], **spec: object) -> dict:
    container = {"name": "main", "image": "ignored", "command": command}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "containers": [container], **spec}}


def create_pods(core, namespace: str, *pods: dict) -> None:
    for pod in pods:
        core.create_namespaced_pod(namespace, pod, _preload_content=False)


def read_pod(core, namespace: str, name: str) -> dict | None:
    try:
        return json.loads(core.read_namespaced_pod(name, namespace, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def logs_of(cluster: Cluster, namespace: str, *pods: str) -> str:
    return "\n".join(f"--- log of {p}/{c}:\n{cluster.kubelet.log(namespace, p, c)}"
                     for p in pods for c in ("main", "side", "init"))


def wait_pod(cluster: Cluster, core, namespace: str, name: str, predicate: Callable[[dict], bool],
             what: str, timeout: float = 20) -> dict:
    return wait_for(lambda: (p := read_pod(core, namespace, name)) and predicate(p) and p, timeout,
                    f"pod {name}: {what}",
                    lambda: json.dumps(read_pod(core, namespace, name), indent=1) + logs_of(cluster, namespace, name))


def wait_ended(cluster: Cluster, core, namespace: str, name: str, timeout: float = 20) -> dict:
    return wait_pod(cluster, core, namespace, name, lambda p: p["status"].get("phase") in ("Succeeded", "Failed"),
                    "to end", timeout)


def terminated(pod: dict, container: str = "main", init: bool = False) -> dict:
    statuses = pod["status"]["initContainerStatuses" if init else "containerStatuses"]
    return next(s for s in statuses if s["name"] == container)["state"]["terminated"]


def condition(pod: dict, kind: str) -> str:
    return next(c["status"] for c in pod["status"].get("conditions", []) if c["type"] == kind)


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


# ---- control plane ---------------------------------------------------------------------------------------------

def test_control_plane_version_and_custom_objects(cluster: Cluster, widgets, namespace: str):
    with cluster.api_client() as api:
        version = kubernetes.client.VersionApi(api).get_code()
    if isinstance(cluster.plane, ControlPlane):
        assert version.git_version == "v1.20.2"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 2}}
    # The first custom-object create is what crashes an apiserver built with the unpatched reflect2.
    widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    widgets.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w", {"spec": {"size": 3}})
    widgets.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "w",
                                                  {"status": {"phase": "Ready"}})
    got = widgets.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w")
    assert got["spec"] == {"size": 3} and got["status"] == {"phase": "Ready"}
    with pytest.raises(ApiException) as invalid:  # the structural schema is enforced
        widgets.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w", {"spec": {"size": 0}})
    assert invalid.value.status == 422


def test_service_account_token_has_only_its_rbac(cluster: Cluster, core, namespace: str):
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}}, _preload_content=False)
    with cluster.api_client() as api:
        rbac = kubernetes.client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(namespace, {"metadata": {"name": "pods"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}, _preload_content=False)
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": "reader"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                        "name": "pods"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]},
            _preload_content=False)
    kubeconfig = cluster.kubeconfig_for_token(cluster.token_for(namespace, "reader"))
    with kubernetes.config.new_client_from_config(kubeconfig) as api:
        reader = kubernetes.client.CoreV1Api(api)
        reader.list_namespaced_pod(namespace)
        with pytest.raises(ApiException) as forbidden:
            reader.list_namespaced_secret(namespace)
        assert forbidden.value.status == 403


# ---- pods ------------------------------------------------------------------------------------------------------

ENV_SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in
      ["POD", "NS", "UID", "IP", "NODE", "APP", "SA", "SECRET", "COMBO", "MISSING"]}}))
"""


def test_pod_env_expansion_logs_and_exit_codes(cluster: Cluster, core, namespace: str):
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"}, "stringData": {"token": "hunter2"}},
                                  _preload_content=False)
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    env = [{"name": "POD", **field("metadata.name")}, {"name": "NS", **field("metadata.namespace")},
           {"name": "UID", **field("metadata.uid")}, {"name": "IP", **field("status.podIP")},
           {"name": "NODE", **field("spec.nodeName")}, {"name": "APP", **field("metadata.labels['app']")},
           {"name": "SA", **field("spec.serviceAccountName")},
           {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
           {"name": "MISSING", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
           {"name": "COMBO", "value": "$(POD)/$(NS)"}]
    ok = pod_manifest("env", [PYTHON, "-c", ENV_SCRIPT, "$(POD)-x", "$$(POD)", "$(UNDEFINED)"],
                      container={"env": env, "workingDir": "/tmp"})
    bad = pod_manifest("exit3", [PYTHON, "-c", "import sys; print('bye'); sys.exit(3)"])
    create_pods(core, namespace, ok, bad)

    pod = wait_ended(cluster, core, namespace, "env")
    assert pod["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, "env")
    assert terminated(pod)["exitCode"] == 0 and terminated(pod)["reason"] == "Completed"
    out = json.loads(cluster.kubelet.log(namespace, "env", "main"))
    meta = pod["metadata"]
    assert out["env"] == {"POD": "env", "NS": namespace, "UID": meta["uid"], "IP": pod["status"]["podIP"],
                          "NODE": pod["spec"]["nodeName"], "APP": "env", "SA": "default", "SECRET": "hunter2",
                          "COMBO": f"env/{namespace}", "MISSING": None}
    assert out["argv"] == ["env-x", "$(POD)", "$(UNDEFINED)"] and out["cwd"] == "/tmp"
    assert ipaddress.ip_address(pod["status"]["podIP"]) in cluster.kubelet.network.block
    assert pod["status"]["hostIP"] == cluster.kubelet.network.node_ip != pod["status"]["podIP"]

    pod = wait_ended(cluster, core, namespace, "exit3")
    assert pod["status"]["phase"] == "Failed"
    assert terminated(pod)["exitCode"] == 3 and terminated(pod)["reason"] == "Error"
    assert cluster.kubelet.log(namespace, "exit3", "main") == "bye\n"


def test_containers_that_cannot_start(cluster: Cluster, core, namespace: str):
    missing = pod_manifest("missing", ["no-such-command-here"])
    root = pod_manifest("root", ["true"], securityContext={"runAsNonRoot": True})
    create_pods(core, namespace, missing, root)
    pod = wait_ended(cluster, core, namespace, "missing")
    state = terminated(pod)
    assert pod["status"]["phase"] == "Failed" and state["exitCode"] == 128 and state["reason"] == "StartError"
    assert "no-such-command-here" in state["message"]
    pod = wait_pod(cluster, core, namespace, "root", lambda p: "containerStatuses" in p["status"], "a status")
    waiting = pod["status"]["containerStatuses"][0]["state"]["waiting"]
    assert pod["status"]["phase"] == "Pending" and waiting["reason"] == "CreateContainerConfigError"
    assert "runAsNonRoot" in waiting["message"]


def test_restart_policy_on_failure_restarts_after_the_back_off(cluster: Cluster, core, namespace: str):
    """Exits 3 the first time, 0 the second: one restart (after the kubelet's 10 s back-off), then Succeeded."""
    once = "test -e /w/ran && exit 0; touch /w/ran; echo failing; exit 3"
    pod = pod_manifest("flaky", ["sh", "-c", once], restartPolicy="OnFailure", volumes=[{"name": "w", "emptyDir": {}}],
                       container={"volumeMounts": [{"name": "w", "mountPath": "/w"}]})
    create_pods(core, namespace, pod)
    waiting = wait_pod(cluster, core, namespace, "flaky", lambda p: p["status"].get("containerStatuses", [{}])[0]
                       .get("restartCount") == 1, "a restart pending")["status"]
    status = waiting["containerStatuses"][0]
    assert waiting["phase"] == "Running" and status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert status["lastState"]["terminated"]["exitCode"] == 3
    pod = wait_ended(cluster, core, namespace, "flaky", timeout=30)
    status = pod["status"]["containerStatuses"][0]
    assert pod["status"]["phase"] == "Succeeded" and status["restartCount"] == 1
    assert terminated(pod)["exitCode"] == 0 and status["lastState"]["terminated"]["exitCode"] == 3
    assert cluster.kubelet.log(namespace, "flaky", "main") == "failing\n"  # the first run's output is kept


IN_CLUSTER = """
import kubernetes, os, sys
kubernetes.config.load_incluster_config()  # the token, CA and KUBERNETES_SERVICE_HOST/PORT the kubelet gave
core = kubernetes.client.CoreV1Api()
try:
    core.list_namespaced_pod(open(os.path.join(sys.argv[1], "namespace")).read())
    print("listed")
except kubernetes.client.ApiException as e:
    print(e.status, e.body)
"""


def test_pods_get_their_service_account_token_unless_they_opt_out(cluster: Cluster, core, namespace: str):
    directory = "/var/run/secrets/kubernetes.io/serviceaccount"
    mounted = pod_manifest("mounted", [PYTHON, "-c", IN_CLUSTER, directory])
    opted_out = pod_manifest("opted-out", ["sh", "-c", f"ls {directory}/token || true"],
                             automountServiceAccountToken=False)
    create_pods(core, namespace, mounted, opted_out)
    assert wait_ended(cluster, core, namespace, "mounted")["status"]["phase"] == "Succeeded"
    out = cluster.kubelet.log(namespace, "mounted", "main")
    # Authenticated as the pod's ServiceAccount, which may do nothing: the API server says who asked.
    assert out.startswith("403") and f"system:serviceaccount:{namespace}:default" in out, out
    wait_ended(cluster, core, namespace, "opted-out")
    assert "No such file" in cluster.kubelet.log(namespace, "opted-out", "main")


def test_init_containers_run_first_and_a_failing_one_fails_the_pod(cluster: Cluster, core, namespace: str):
    volume = {"volumes": [{"name": "w", "emptyDir": {}}]}
    mount = {"volumeMounts": [{"name": "w", "mountPath": "/w"}]}
    good = pod_manifest("good", ["cat", "/w/first"], container=mount, **volume,
                        initContainers=[{"name": "init", "image": "x", "command": ["sh", "-c", "echo init > /w/first"],
                                         **mount}])
    bad = pod_manifest("bad", ["true"], initContainers=[{"name": "init", "image": "x", "command": ["false"]}])
    create_pods(core, namespace, good, bad)
    pod = wait_ended(cluster, core, namespace, "good")
    assert pod["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, "good")
    assert terminated(pod, "init", init=True)["exitCode"] == 0
    assert cluster.kubelet.log(namespace, "good", "main") == "init\n"
    pod = wait_ended(cluster, core, namespace, "bad")
    assert pod["status"]["phase"] == "Failed" and terminated(pod, "init", init=True)["exitCode"] == 1
    assert pod["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    assert condition(pod, "Initialized") == "False"


SERVE_LATER = """
import http.server, time
time.sleep(2)
server = http.server.HTTPServer(("0.0.0.0", 8080), http.server.SimpleHTTPRequestHandler)
print("serving", flush=True)
server.serve_forever()
"""


def test_readiness_probe_gates_ready(cluster: Cluster, core, namespace: str):
    pod = pod_manifest("web", [PYTHON, "-c", SERVE_LATER], container={
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1}})
    create_pods(core, namespace, pod)
    running = wait_pod(cluster, core, namespace, "web", lambda p: p["status"].get("phase") == "Running", "to run")
    assert condition(running, "Ready") == "False" and not running["status"]["containerStatuses"][0]["ready"]
    ready = wait_pod(cluster, core, namespace, "web", lambda p: condition(p, "Ready") == "True", "to be ready", 10)
    assert ready["status"]["containerStatuses"][0]["ready"]
    assert "serving" in cluster.kubelet.log(namespace, "web", "main")  # not ready before the server answered


GANG_MEMBER = """
import os, socket, sys, time
me, peer = os.environ["ME"], os.environ["PEER"]
server = socket.create_server(("0.0.0.0", 7000))
deadline = time.monotonic() + 15
while True:
    try:
        peer_ip = socket.gethostbyname(peer + ".gang")
        with socket.create_connection((peer_ip, 7000), timeout=1) as s:
            s.sendall(me.encode())
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
connection, _ = server.accept()
print(socket.gethostname(), peer_ip, connection.recv(100).decode(), socket.gethostbyname(socket.gethostname()))
"""


def gang(core, namespace: str, nodes: tuple[str | None, str | None] = (None, None)) -> None:
    """Pods a and b of a headless Service `gang` (on those nodes), each serving on 0.0.0.0:7000 and greeting the other
    by its DNS name."""
    core.create_namespaced_service(namespace, {"metadata": {"name": "gang"}, "spec": {
        "clusterIP": "None", "selector": {"gang": "g"}, "ports": [{"port": 7000}]}}, _preload_content=False)
    pods = []
    for (me, peer), node in zip((("a", "b"), ("b", "a")), nodes):
        pod = pod_manifest(me, [PYTHON, "-c", GANG_MEMBER], hostname=me, subdomain="gang", container={"env": [
            {"name": "ME", "value": me}, {"name": "PEER", "value": peer}]}, **({"nodeName": node} if node else {}))
        pod["metadata"]["labels"]["gang"] = "g"
        pods.append(pod)
    create_pods(core, namespace, *pods)


def test_gang_pods_resolve_each_other_and_share_a_port_number(cluster: Cluster, core, namespace: str):
    gang(core, namespace)
    a, b = (wait_ended(cluster, core, namespace, name) for name in ("a", "b"))
    assert a["status"]["phase"] == b["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, "a", "b")
    a_ip, b_ip = a["status"]["podIP"], b["status"]["podIP"]
    assert a_ip != b_ip
    assert cluster.kubelet.log(namespace, "a", "main").split() == ["a", b_ip, "b", a_ip]
    assert cluster.kubelet.log(namespace, "b", "main").split() == ["b", a_ip, "a", b_ip]


HELLO = """
import http.server, socket
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{socket.gethostname()} {self.client_address[0]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", 8080), Hello).serve_forever()
"""

GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def test_pods_bind_one_port_on_all_addresses_and_are_reached_by_pod_ip(cluster: Cluster, core, namespace: str):
    """Each pod has a network namespace of its own: two servers on 0.0.0.0:8080 both run; the host reaches each at its
    pod IP (from HOST_ADDRESS, through the node), a pod reaches the other, and exec joins the pod's network."""
    probe = {"httpGet": {"port": 8080, "path": "/"}, "periodSeconds": 1}
    create_pods(core, namespace, *(pod_manifest(name, [PYTHON, "-c", HELLO], container={"readinessProbe": probe})
                                   for name in ("one", "two")))
    pods = {name: wait_pod(cluster, core, namespace, name, ready, "to be ready") for name in ("one", "two")}
    ips = {name: pod["status"]["podIP"] for name, pod in pods.items()}
    assert ips["one"] != ips["two"] and all(ipaddress.ip_address(ip) in POD_NETWORK for ip in ips.values())
    for name, ip in ips.items():
        with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as response:
            assert response.read().decode().split() == [name, HOST_ADDRESS]  # the machine, as pods see it
    across = cluster.kubelet.exec(namespace, "one", "main", [PYTHON, "-c", GET, f"http://{ips['two']}:8080/"])
    assert across.stdout.decode().split() == ["two", ips["one"]], across.stderr.decode()
    inside = cluster.kubelet.exec(namespace, "two", "main", [PYTHON, "-c", GET, "http://127.0.0.1:8080/"])
    assert inside.stdout.decode().split() == ["two", "127.0.0.1"], inside.stderr.decode()
    for name in ips:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=1, _preload_content=False)
    for name, ip in ips.items():
        wait_for(lambda: read_pod(core, namespace, name) is None, 15, f"pod {name} to be gone")
        wait_for(lambda: not (NETNS_DIR / f"pat-pod-{ip}").exists(), 5, f"the network namespace of {name} to go")
        with pytest.raises(OSError):  # no pod has the address now: refused at once, not a timeout
            urllib.request.urlopen(f"http://{ip}:8080/", timeout=5)


def test_a_host_network_pod_has_the_nodes_network(cluster: Cluster, core, namespace: str):
    probe = {"httpGet": {"port": 8081, "path": "/"}, "periodSeconds": 1}
    create_pods(core, namespace, pod_manifest("hostnet", [PYTHON, "-c", HELLO.replace("8080", "8081")],
                                              hostNetwork=True, container={"readinessProbe": probe}))
    pod = wait_pod(cluster, core, namespace, "hostnet", ready, "to be ready")
    assert pod["status"]["podIP"] == pod["status"]["hostIP"] == cluster.kubelet.network.node_ip
    with urllib.request.urlopen(f"http://{cluster.kubelet.network.node_ip}:8081/", timeout=5) as response:
        assert response.read().decode().split()[0] == cluster.kubelet.node_name  # the node's hostname too


API_CLIENT = """
import kubernetes, os, socket, sys
kubernetes.config.load_incluster_config()  # KUBERNETES_SERVICE_HOST/PORT, the token and the CA
namespace = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
pods = kubernetes.client.CoreV1Api().list_namespaced_pod(namespace).items
print(os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"], *[p.metadata.name for p in pods])
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
    print("loopback: the API server")
except OSError:
    print("loopback: the pod's own")
"""


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(cluster: Cluster, core, namespace: str):
    """In-cluster config, as on a real cluster: the `kubernetes` Service's cluster IP (relayed by the node, as
    kube-proxy would), the pod's ServiceAccount token and RBAC. The API server's own address (127.0.0.1 on the host)
    is not the pod's to reach."""
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "lister"}}, _preload_content=False)
    with cluster.api_client() as api:
        rbac = kubernetes.client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(namespace, {"metadata": {"name": "pods"}, "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}, _preload_content=False)
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": "lister"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                        "name": "pods"},
            "subjects": [{"kind": "ServiceAccount", "name": "lister", "namespace": namespace}]},
            _preload_content=False)
    service = json.loads(core.read_namespaced_service("kubernetes", "default", _preload_content=False).data)["spec"]
    port = urllib.parse.urlsplit(cluster.server).port
    create_pods(core, namespace, pod_manifest("api", [PYTHON, "-c", API_CLIENT, str(port)],
                                              serviceAccountName="lister"))
    pod = wait_ended(cluster, core, namespace, "api")
    assert pod["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, "api")
    assert cluster.kubelet.log(namespace, "api", "main").splitlines() == [
        f"{service['clusterIP']} {service['ports'][0]['port']} api", "loopback: the pod's own"]


# ---- volumes and security context ------------------------------------------------------------------------------

VOLUME_SCRIPT = """
import os, sys, time
while not os.path.exists("/shared/msg"):
    time.sleep(0.05)
shm = os.statvfs("/dev/shm")
open("/dev/shm/pat-test-" + os.environ["HOSTNAME"], "w").close()
print(open("/shared/msg").read().strip())
print(shm.f_blocks * shm.f_frsize)
print(open("/etc/cfg/conf/app.yaml").read(), oct(os.stat("/etc/cfg/conf/app.yaml").st_mode & 0o777))
print(open("/etc/sec/password").read())
try:
    open("/etc/cfg/new", "w")
except OSError as e:
    print("errno", e.errno)
"""


def test_emptydir_memory_configmap_and_secret_volumes(cluster: Cluster, core, namespace: str):
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {"app": "x: 1", "other": "-"}},
                                      _preload_content=False)
    core.create_namespaced_secret(namespace, {"metadata": {"name": "sec"}, "stringData": {"password": "pw"}},
                                  _preload_content=False)
    shared = {"name": "shared", "mountPath": "/shared"}
    pod = pod_manifest("vols", [PYTHON, "-c", VOLUME_SCRIPT], container={"volumeMounts": [
        # /tmp covers the kubelet's own directory there, which holds the sources of the mounts after it.
        {"name": "tmp", "mountPath": "/tmp"},
        shared, {"name": "shm", "mountPath": "/dev/shm"}, {"name": "cfg", "mountPath": "/etc/cfg"},
        {"name": "sec", "mountPath": "/etc/sec"}]}, volumes=[{"name": "tmp", "emptyDir": {}},
        {"name": "shared", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        {"name": "cfg", "configMap": {"name": "cfg",
                                      "items": [{"key": "app", "path": "conf/app.yaml", "mode": 0o600}]}},
        {"name": "sec", "secret": {"secretName": "sec"}}])
    pod["spec"]["containers"].append({"name": "side", "image": "x", "volumeMounts": [shared],
                                      "command": ["sh", "-c", "echo hello > /shared/msg"]})
    create_pods(core, namespace, pod)
    ended = wait_ended(cluster, core, namespace, "vols")
    assert ended["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, "vols")
    assert cluster.kubelet.log(namespace, "vols", "main").split("\n") == [
        "hello", str(64 * 2**20), "x: 1 0o600", "pw", "errno 30", ""]
    assert not os.path.exists("/dev/shm/pat-test-vols")  # the pod's /dev/shm is a tmpfs of its own


def test_persistent_volume_claim_outlives_its_pods(cluster: Cluster, core, namespace: str):
    core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}, _preload_content=False)
    # The kubelet provisions it; the scheduler would place a pod of an unbound claim only after a backoff.
    wait_for(lambda: json.loads(core.read_namespaced_persistent_volume_claim("data", namespace, _preload_content=False)
                                .data).get("status", {}).get("phase") == "Bound", 10, "the claim to be bound")
    volume = {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]}
    mount = {"volumeMounts": [{"name": "d", "mountPath": "/data"}]}
    create_pods(core, namespace, pod_manifest("writer", ["sh", "-c", "echo kept > /data/f"], container=mount, **volume))
    assert wait_ended(cluster, core, namespace, "writer")["status"]["phase"] == "Succeeded"
    core.delete_namespaced_pod("writer", namespace, _preload_content=False)
    wait_for(lambda: read_pod(core, namespace, "writer") is None, 15, "the writer pod to be gone")
    create_pods(core, namespace, pod_manifest("reader", ["cat", "/data/f"], container=mount, **volume))
    assert wait_ended(cluster, core, namespace, "reader")["status"]["phase"] == "Succeeded"
    assert cluster.kubelet.log(namespace, "reader", "main") == "kept\n"


USER_SCRIPT = """
import os
open("/data/f", "w").write("x")
st = os.stat("/data/f")
print(os.getuid(), os.getgid(), 2000 in os.getgroups(), st.st_uid, st.st_gid)
try:
    open("/pat-test-readonly-root", "w")
except OSError as e:
    print("errno", e.errno)
open("/tmp/ok", "w").write("y")
print("tmp ok")
"""


def test_run_as_user_fs_group_and_read_only_root(cluster: Cluster, core, namespace: str):
    pod = pod_manifest("user", [PYTHON, "-c", USER_SCRIPT],
                       securityContext={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000},
                       volumes=[{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
                       container={"securityContext": {"readOnlyRootFilesystem": True, "runAsNonRoot": True},
                                  "volumeMounts": [{"name": "work", "mountPath": "/data"},
                                                   {"name": "tmp", "mountPath": "/tmp"}]})
    create_pods(core, namespace, pod)
    ended = wait_ended(cluster, core, namespace, "user")
    assert ended["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, "user")
    # fsGroup: the volume's setgid group 2000 is inherited by new files; / is read-only (EROFS) but volumes are not.
    assert cluster.kubelet.log(namespace, "user", "main").split("\n") == [
        "1000 1000 True 1000 2000", "errno 30", "tmp ok", ""]
    assert not os.path.exists("/pat-test-readonly-root")


def test_a_volume_over_the_checkout_leaves_the_project_runnable(cluster: Cluster, core, namespace: str):
    """Pods mount an emptyDir at /tmp: with the checkout (and its venv) in /tmp, that volume would hide them from
    the pods' commands, which run from the host's venv here (an image holds them on a real node)."""
    repo = Path(__file__).resolve().parents[2]
    over = repo.parent if repo.parent != Path("/") else repo  # never a volume over /
    script = f"import os, pat_operator; print(pat_operator.__file__); s = os.stat({str(over)!r}); print(s.st_ino)"
    pod = pod_manifest("covered", ["python", "-c", script], securityContext={"runAsUser": 1000},
                       volumes=[{"name": "cover", "emptyDir": {}}],
                       container={"volumeMounts": [{"name": "cover", "mountPath": str(over)}]})
    create_pods(core, namespace, pod)
    ended = wait_ended(cluster, core, namespace, "covered")
    assert ended["status"]["phase"] == "Succeeded", logs_of(cluster, namespace, "covered")
    module, inode = cluster.kubelet.log(namespace, "covered", "main").splitlines()
    assert module.startswith(str(repo / "operator"))
    if over != repo:  # the pod saw the volume there, not the host's folder: the checkout was brought back into it
        assert int(inode) != os.stat(over).st_ino


# ---- process lifecycle -----------------------------------------------------------------------------------------

def test_kill_9_fails_the_pod_with_137(cluster: Cluster, core, namespace: str):
    create_pods(core, namespace, pod_manifest("victim", ["sleep", "1000"]))
    wait_pod(cluster, core, namespace, "victim", lambda p: p["status"].get("phase") == "Running", "to run")
    [pid] = cluster.kubelet.pids(namespace, "victim")
    os.kill(pid, 9)
    pod = wait_ended(cluster, core, namespace, "victim")
    assert pod["status"]["phase"] == "Failed"
    assert terminated(pod)["exitCode"] == 137 and terminated(pod)["reason"] == "Error"


GRACEFUL = """
import signal, sys, time
def stop(*_):
    print("SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("up", flush=True)
time.sleep(1000)
"""


def test_deleting_running_pods_ends_their_processes(cluster: Cluster, core, namespace: str):
    stubborn = pod_manifest("stubborn", ["sh", "-c", "trap '' TERM; echo up; sleep 1000"],
                            terminationGracePeriodSeconds=1)
    create_pods(core, namespace, pod_manifest("graceful", [PYTHON, "-c", GRACEFUL]), stubborn)
    for name in ("graceful", "stubborn"):
        wait_for(lambda: "up" in cluster.kubelet.log(namespace, name, "main"), 10, f"{name} to start")
    pids = {name: cluster.kubelet.pids(namespace, name)[0] for name in ("graceful", "stubborn")}
    started = time.monotonic()
    for name in pids:
        core.delete_namespaced_pod(name, namespace, _preload_content=False)
    for name, pid in pids.items():
        wait_for(lambda: read_pod(core, namespace, name) is None, 15, f"pod {name} to be gone")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "SIGTERM" in cluster.kubelet.log(namespace, "graceful", "main")
    assert time.monotonic() - started >= 1  # the stubborn one ignored SIGTERM and got SIGKILL after its grace


# ---- controllers -----------------------------------------------------------------------------------------------

def test_owner_reference_garbage_collection(cluster: Cluster, core, widgets, namespace: str):
    cluster.wait_for_garbage_collector(f"{GROUP}/{VERSION}", "Widget", namespace)
    owner = widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Widget", "metadata": {"name": "owner"}, "spec": {"size": 1}})
    reference = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Widget", "name": "owner",
                 "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "owned", "ownerReferences": [reference]}},
                                      _preload_content=False)
    widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "owner")
    wait_for(lambda: not _exists(lambda: core.read_namespaced_config_map("owned", namespace, _preload_content=False)),
             10, "the garbage collector to delete the owned ConfigMap")


def _exists(read: Callable[[], object]) -> bool:
    try:
        read()
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


# ---- nodes -----------------------------------------------------------------------------------------------------

def test_pods_on_two_nodes_reach_each_other_by_name(cluster: Cluster, core, namespace: str, extra_node):
    other = extra_node()
    gang(core, namespace, nodes=(cluster.kubelet.node_name, other.node_name))
    a, b = (wait_ended(cluster, core, namespace, name) for name in ("a", "b"))
    logs = logs_of(cluster, namespace, "a") + other.log(namespace, "b", "main")
    assert a["status"]["phase"] == b["status"]["phase"] == "Succeeded", logs
    a_ip, b_ip = a["status"]["podIP"], b["status"]["podIP"]
    assert ipaddress.ip_address(a_ip) in cluster.kubelet.network.block
    assert ipaddress.ip_address(b_ip) in other.network.block
    assert b["status"]["hostIP"] == other.network.node_ip != a["status"]["hostIP"]
    assert cluster.kubelet.log(namespace, "a", "main").split() == ["a", b_ip, "b", a_ip]
    assert other.log(namespace, "b", "main").split() == ["b", a_ip, "a", b_ip]


def test_a_lost_node_keeps_its_pods_terminating_until_they_are_force_deleted(cluster: Cluster, core, namespace: str,
                                                                            extra_node):
    lost = extra_node()
    create_pods(core, namespace, pod_manifest("stranded", ["sleep", "1000"], nodeName=lost.node_name))
    wait_pod(cluster, core, namespace, "stranded", lambda p: p["status"].get("phase") == "Running", "to run")
    [pid] = lost.pids(namespace, "stranded")
    lost.lose()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    node = json.loads(core.read_node(lost.node_name, _preload_content=False).data)
    assert {"key": UNREACHABLE_TAINT, "effect": "NoSchedule"} in node["spec"]["taints"]
    assert next(c for c in node["status"]["conditions"] if c["type"] == "Ready")["status"] == "Unknown"

    core.delete_namespaced_pod("stranded", namespace, _preload_content=False)  # graceful: the node must confirm it
    time.sleep(4)
    pod = read_pod(core, namespace, "stranded")
    assert pod is not None and pod["metadata"]["deletionTimestamp"], "a dead node cannot confirm a deletion"
    assert pod["status"]["phase"] == "Running" and condition(pod, "Ready") == "False"
    core.delete_namespaced_pod("stranded", namespace, grace_period_seconds=0, _preload_content=False)
    wait_for(lambda: read_pod(core, namespace, "stranded") is None, 10, "the force-deleted pod to be gone")

    create_pods(core, namespace, pod_manifest("rescheduled", ["sleep", "1000"]))
    pod = wait_pod(cluster, core, namespace, "rescheduled", lambda p: p["status"].get("phase") == "Running", "to run")
    assert pod["spec"]["nodeName"] == cluster.kubelet.node_name  # the tainted node takes no new pods


def test_node_stays_ready(cluster: Cluster, core):
    """Last in the file, so the node has been up for a while: the node-lifecycle controller saw its heartbeats."""
    node = json.loads(core.read_node(cluster.kubelet.node_name, _preload_content=False).data)
    assert next(c for c in node["status"]["conditions"] if c["type"] == "Ready")["status"] == "True"
    assert not node["spec"].get("taints")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "16"
    with cluster.api_client() as api:
        lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(cluster.kubelet.node_name,
                                                                                "kube-node-lease")
    assert time.time() - lease.spec.renew_time.timestamp() < 15
