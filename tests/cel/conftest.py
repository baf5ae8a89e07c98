"""One real Kubernetes 1.36 CRD server per session (tests/cluster/crdserver.py: etcd + k8s.io/apiextensions-apiserver)
with crds/rlhfjobs.pat.dev.yaml installed and Established, and a small client for RLHFJobs on it.

Never skipped: when the binaries are missing, the fixture runs scripts/crd-server-build.sh (minutes, once; it
caches them under ~/.cache/pat-rlhf/) and fails with the script's message if they cannot be had.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from pat_operator import api, crd
from tests.cluster.crdserver import CRD_FILE, CrdServer
from tests.tiers import starts

NAMESPACE = "cel"  # the server has no Namespace objects (no core API); custom objects still live in one


class Invalid(Exception):
    """The server's 422: `message` is the Status message (every cause, as kubectl prints it), `causes` the
    messages of details.causes."""

    def __init__(self, body: dict[str, Any]):
        self.message: str = body.get("message", "")
        self.causes: list[str] = [c.get("message", "") for c in (body.get("details") or {}).get("causes", [])]
        super().__init__(self.message)


class Jobs:
    """RLHFJobs on the CRD server through the Python client (/apis/pat.dev/v1alpha1/namespaces/cel/rlhfjobs)."""

    def __init__(self, server: CrdServer):
        from kubernetes import client

        self.client = client
        self.custom = client.CustomObjectsApi(server.api_client())
        self.created: list[str] = []

    def _call(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return getattr(self.custom, method)(api.GROUP, api.VERSION, NAMESPACE, crd.PLURAL, *args, **kwargs)
        except self.client.ApiException as e:
            if e.status == 422:
                raise Invalid(json.loads(e.body)) from None
            raise

    def create(self, doc: dict[str, Any], dry_run: bool = True) -> dict[str, Any]:
        """The object as the server would store it (pruned); dry_run=False stores it (deleted after the test)."""
        out = self._call("create_namespaced_custom_object", doc, **({"dry_run": "All"} if dry_run else {}))
        if not dry_run:
            self.created.append(out["metadata"]["name"])
        return out

    def refusal(self, doc: dict[str, Any]) -> str | None:
        """None if a (dry-run) create is accepted, else the 422's message."""
        try:
            self.create(doc)
        except Invalid as e:
            return e.message
        return None

    def replace(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self._call("replace_namespaced_custom_object", doc["metadata"]["name"], doc)

    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (the client sends a dict body as application/merge-patch+json)."""
        return self._call("patch_namespaced_custom_object", name, patch)

    def replace_status(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self._call("replace_namespaced_custom_object_status", doc["metadata"]["name"], doc)

    def unique_name(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:8]}"

    def cleanup(self) -> None:
        for name in self.created:
            try:
                self._call("delete_namespaced_custom_object", name)
            except self.client.ApiException as e:
                if e.status != 404:
                    raise
        self.created.clear()


@pytest.fixture(scope="session")
@starts("cluster")
def crd_server() -> Iterator[CrdServer]:
    """The server, with the CRD of crds/ installed and Established (its `crds` holds the stored CRD)."""
    server = CrdServer().start()
    try:
        server.install_crd(yaml.safe_load(CRD_FILE.read_text()))
    except BaseException:
        import sys

        sys.stderr.write(server.describe_logs())
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture
def jobs(crd_server: CrdServer) -> Iterator[Jobs]:
    j = Jobs(crd_server)
    yield j
    j.cleanup()
