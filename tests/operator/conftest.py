"""The operator, unmodified, against the real control plane and the process kubelet (tests/cluster)."""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from .harness import SERVICE_ACCOUNT, SYSTEM_NAMESPACE, OperatorProcess, install

EXAMPLE = Path(__file__).parents[2] / "examples" / "local.yaml"


@pytest.fixture(scope="session")
def operator(cluster, tmp_path_factory) -> OperatorProcess:
    install(cluster.api_client())
    token = cluster.token_for(SYSTEM_NAMESPACE, SERVICE_ACCOUNT)
    op = OperatorProcess(str(cluster.kubeconfig_for_token(token)), tmp_path_factory.mktemp("operator"),
                         "--restart-backoff-seconds", "1", "--restart-backoff-max-seconds", "4",
                         "--regroup-timeout-seconds", "2", "--allow-host-path", "/tmp",  # the tests' data
                         supervised=True)
    op.start()
    yield op
    op.stop()


class Jobs:
    """RLHFJobs in one test namespace, through the admin client."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str):
        self.namespace = namespace
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.core = kubernetes.client.CoreV1Api(api)

    def create(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object("pat.dev", "v1alpha1", self.namespace, "rlhfjobs", doc)

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object("pat.dev", "v1alpha1", self.namespace, "rlhfjobs", name)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object("pat.dev", "v1alpha1", self.namespace, "rlhfjobs", name,
                                                   {"spec": spec})

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object("pat.dev", "v1alpha1", self.namespace, "rlhfjobs", name)

    def exists(self, name: str) -> bool:
        try:
            self.get(name)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def pods(self, name: str) -> list:
        return self.core.list_namespaced_pod(self.namespace, label_selector=f"pat.dev/job={name}").items

    def pod(self, name: str, role: str, index: int = 0) -> str:
        """The name of the job's current pod of `role` and `index` (pod names carry a per-attempt suffix)."""
        live = [p for p in self.pods(name) if p.metadata.labels.get("pat.dev/role") == role
                and p.metadata.labels.get("pat.dev/index") == str(index) and p.metadata.deletion_timestamp is None]
        assert len(live) == 1, f"{name}: {role}-{index}: {[p.metadata.name for p in live]}"
        return live[0].metadata.name

    def events(self, name: str) -> list[str]:
        items = self.core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={name}").items
        return [f"{e.reason}: {e.message}" for e in items]

    def wait(self, name: str, ok: Callable[[dict], bool], what: str, timeout: float = 60.0,
             explain: Callable[[], str] = lambda: "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(name)
            if ok(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not reached in {timeout:.0f} s; status: "
                                     f"{yaml.safe_dump(job.get('status'))}\nevents: {self.events(name)}\n{explain()}")
            time.sleep(0.25)


@pytest.fixture
def tail_data():
    """The long-tailed dataset (tailjob.py) with TAIL-token long responses, readable by the pods' non-root user
    (pytest's tmp_path is private to root)."""
    from .tailjob import TAIL, write_dataset  # tailjob builds on this module's job_doc

    path = Path(tempfile.mkdtemp(prefix="pat-tail-"))
    path.chmod(0o755)
    write_dataset(path, TAIL)
    (path / "tail.jsonl").chmod(0o644)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def jobs(cluster, namespace, operator) -> Jobs:
    return Jobs(cluster.api_client(), namespace)


def phase(p: str) -> Callable[[dict], bool]:
    return lambda job: (job.get("status") or {}).get("phase") == p


def condition(job: dict, kind: str) -> dict:
    """The job's status condition of this type; {} while it has none."""
    return next((c for c in (job.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


def job_doc(name: str, trainer_command: list[str] | None = None, generator_command: list[str] | None = None,
            placement: str = "separate", **run_policy: Any) -> dict[str, Any]:
    """The example job, with trivial commands when given (the gang logic does not need real workers); separate
    trainer and generator pods unless `placement` says colocated."""
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    spec["placement"] = placement
    spec["runPolicy"].update(run_policy)
    if trainer_command:
        spec["trainer"]["command"] = trainer_command
    if generator_command:
        spec["generator"]["command"] = generator_command
    return doc


SLEEP = ["sleep", "3600"]
# A generator stand-in that answers the readiness probe (GET /readyz -> 200) on the pod's IP.
SERVE = ["python", "-c", "import http.server as h, os; h.HTTPServer((os.environ['POD_IP'], 8000), type('H', "
         "(h.BaseHTTPRequestHandler,), {'do_GET': lambda s: (s.send_response(200), s.end_headers()), "
         "'log_message': lambda *a: None})).serve_forever()"]
