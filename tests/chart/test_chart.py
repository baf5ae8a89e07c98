"""The Helm chart with a real helm v3 (scripts/helm-fetch.sh): lint and template are clean, bad values are refused
naming the value, the rendered manifests pass the local API server's dry run, and `helm install --wait` runs the
operator as a pod (the process kubelet; in-cluster config with its ServiceAccount's token, the chart's RBAC only)
that reconciles a real RLHFJob while a real Prometheus scrapes it and the workers -- every dashboard panel's query
returns series -- and `helm uninstall` leaves only the CRDs (and the kept peering object)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import kubernetes
import kubernetes_validate
import pytest
import yaml

from pat_operator import metric_names as names
from tests.cluster.dashboards import annotation_queries, panel_queries
from tests.cluster.helm import CHART, ROOT, Helm
from tests.operator.conftest import Jobs, condition, job_doc, phase

RULES = CHART / "files" / "operator-rules.yaml"
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
MONITORS = ["--set", "serviceMonitor.enabled=true", "--set", "podMonitor.enabled=true"]


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm"))


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_lint_is_clean(helm):
    for values in ([], MONITORS + ["--set", "watchNamespaces={a,b}", "--set", "prometheusURL=http://p:9090"]):
        done = helm("lint", "--strict", str(CHART), *values)
        assert "0 chart(s) failed" in done.stdout
        assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout
        assert not done.stderr, done.stderr  # e.g. helm's warnings about symbolic links in the chart


def test_template_renders_a_least_privilege_operator(helm):
    docs = helm.template()
    assert [p.name for p in DASHBOARDS] == ["operator.json", "rlhf-job.json"]
    assert sorted(d["kind"] for d in docs) == sorted(
        ["ServiceAccount", "Secret", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment",
         "ClusterKopfPeering", *["ConfigMap"] * len(DASHBOARDS)])
    [deployment] = by_kind(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["pat-operator"] and container["image"] == "ghcr.io/pat-rlhf/pat-operator:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and "readinessProbe" in container
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    [role] = by_kind(docs, "ClusterRole")
    assert role["rules"] == yaml.safe_load(RULES.read_text())  # what the operator tests run with, exactly
    [binding] = by_kind(docs, "ClusterRoleBinding")
    [account] = by_kind(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "pat-system"}]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    [service] = by_kind(docs, "Service")
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] in [p["name"] for p in container["ports"]]
    for cm in by_kind(docs, "ConfigMap"):  # the dashboards, byte for byte, for the Grafana sidecar
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        [(name, text)] = cm["data"].items()
        assert json.loads(text) == json.loads((ROOT / "dashboards" / name).read_text())
    assert {cm_name for cm in by_kind(docs, "ConfigMap") for cm_name in cm["data"]} == {p.name for p in DASHBOARDS}


def test_watched_namespaces_get_roles_and_nothing_cluster_wide(helm):
    docs = helm.template("--set", "watchNamespaces={team-a,team-b}")
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}, kinds
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "Role")) == ["team-a", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "RoleBinding")) == ["team-a", "team-b"]
    assert sorted(p["metadata"]["namespace"] for p in by_kind(docs, "KopfPeering")) == ["team-a", "team-b"]
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_monitors_select_the_operator_and_the_worker_pods(helm):
    docs = helm.template(*MONITORS)
    [service] = by_kind(docs, "Service")
    [monitor] = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
    [pods] = by_kind(docs, "PodMonitor")
    assert pods["spec"]["selector"]["matchExpressions"] == [{"key": "pat.dev/job", "operator": "Exists"}]
    assert pods["spec"]["namespaceSelector"] == {"any": True}
    # The ports the operator's pod builders name (trainer: metrics, generator: http), with the labels that the
    # dashboards and the operator's queries select on.
    assert [e["port"] for e in pods["spec"]["podMetricsEndpoints"]] == ["metrics", "http"]
    for endpoint in pods["spec"]["podMetricsEndpoints"]:
        assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"pat_job", "pat_role"}


@pytest.mark.parametrize("values, field", [
    (["--set", "image.pullPolicy=Sometimes"], "image.pullPolicy"),
    (["--set", "watchNamespaces=team-a"], "watchNamespaces"),
    (["--set", "imagee.tag=1"], "imagee"),
    (["--set", "metricsPort=0"], "metricsPort"),
    (["--set", "prometheusURL=prometheus:9090"], "prometheusURL"),
])
def test_bad_values_are_refused_naming_the_value(helm, values, field):
    done = helm("template", "rel", str(CHART), *values, check=False)
    assert done.returncode != 0 and field in done.stderr, done.stderr


def test_chart_crds_and_dashboards_are_the_repositorys(helm):
    """The chart holds copies (helm reads no file outside the chart, and warns of symbolic links in it)."""
    for folder in ("crds", "dashboards"):
        ours = {p.name: p.read_bytes() for p in (ROOT / folder).iterdir()}
        assert ours and {p.name: p.read_bytes() for p in (CHART / folder).iterdir()} == ours, (
            f"charts/pat-operator/{folder}/ differs from {folder}/: run `rm -r charts/pat-operator/{folder} && "
            f"cp -r {folder} charts/pat-operator/`")
    # (`helm show crds` joins the files without a document separator; template --include-crds keeps them apart)
    shown = by_kind(helm.template("--include-crds"), "CustomResourceDefinition")
    files = [d for path in sorted((ROOT / "crds").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    assert sorted(d["metadata"]["name"] for d in shown) == [
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev", "rlhfjobs.pat.dev"]
    assert sorted(shown, key=str) == sorted(files, key=str)


# Kinds of CRDs (prometheus-operator's monitors, kopf's peering): no Kubernetes schema has them.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "ClusterKopfPeering", "KopfPeering"}


def test_rendered_chart_validates_strictly_against_kubernetes_schemas(helm):
    """helm template, CRDs and monitors included, against the Kubernetes 1.30 and 1.34 schemas (kubernetes-validate,
    strict: no unknown field); only the custom kinds have none."""
    rendered = [*helm.template("--include-crds", "--set", "podMonitor.enabled=true", "--set",
                               "serviceMonitor.enabled=true"),
                *helm.template("--set", "watchNamespaces={team-a,team-b}")]
    unchecked = set()
    for obj in rendered:
        for version in ("1.30.0", "1.34.0"):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unchecked.add(obj["kind"])
    assert unchecked <= CUSTOM_KINDS, unchecked
    assert {"Deployment", "ClusterRole", "Role", "CustomResourceDefinition"} <= {o["kind"] for o in rendered}


@pytest.mark.cluster
def test_rendered_manifests_pass_the_servers_dry_run(cluster, namespace, tmp_path):
    helm = Helm(tmp_path, cluster.kubeconfig)
    # CRDs first, as helm installs them (which does not validate them client-side: a 1.20 schema has no CEL rules,
    # which kubectl >= 1.25 refuses, and the server drops).
    helm.kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"))
    for values in ([], ["--set", f"watchNamespaces={{{namespace}}}"]):
        rendered = helm("template", "rel", str(CHART), "-n", namespace, *values).stdout
        done = helm.kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)
        assert done.stdout.count("(server dry run)") == len([d for d in yaml.safe_load_all(rendered) if d])


@pytest.mark.cluster
@pytest.mark.timeout(900)  # the job's 100 iterations (below) on a slow host
def test_helm_install_runs_the_operator_and_every_dashboard_panel_has_data(cluster, prometheus, namespace,
                                                                           tmp_path):
    """Cluster-wide with peering priority 100: an operator of the tests' own (priority 0, same peering) pauses."""
    helm = Helm(tmp_path, cluster.kubeconfig)
    system = f"pat-chart-{secrets.token_hex(3)}"
    api = cluster.api_client()
    core, apps = kubernetes.client.CoreV1Api(api), kubernetes.client.AppsV1Api(api)
    jobs = Jobs(api, namespace)
    try:
        helm("install", "rel", str(CHART), "-n", system, "--create-namespace", "--wait", "--timeout", "3m",
             "--set-string", "listenAddress=$(POD_IP)", "--set", "peering.priority=100",
             "--set", f"prometheusURL={prometheus.url}", "--set", "restartBackoffSeconds=1")
        [pod] = core.list_namespaced_pod(system, label_selector="app.kubernetes.io/instance=rel").items
        assert pod.status.container_statuses[0].ready and pod.status.container_statuses[0].restart_count == 0
        [pid] = cluster.kubelet.pids(system, pod.metadata.name)
        assert "Uid:\t1000\t" in Path(f"/proc/{pid}/status").read_text()  # non-root, as the chart says
        operator_log = lambda: cluster.kubelet.log(system, pod.metadata.name, "operator")[-4000:]  # noqa: E731

        doc = job_doc("charted")
        # Long enough (~2 iterations a second here) that the checks below run while it does: a finished pod's
        # series go stale in Prometheus at once, and the panels' instant queries would find nothing.
        doc["spec"]["algorithm"].update(iterations=100, promptsPerIteration=4, samplesPerPrompt=4,
                                        maxResponseTokens=24)
        doc["spec"]["reward"]["overlongBuffer"] = 4
        doc["spec"]["generator"].update(maxBatch=16, maxSeq=64)
        doc["spec"]["generator"]["adaptiveTP"]["controller"] = "operator"  # the operator queries Prometheus
        jobs.create(doc)
        jobs.wait("charted", lambda j: (j.get("status") or {}).get("iteration", 0) >= 2, "iteration 2",
              timeout=240, explain=operator_log)
        # The operator plans from the real Prometheus: its first queries may find no samples yet (NoData).
        jobs.wait("charted", lambda j: condition(j, "MetricsAvailable").get("status") == "True",
                  "MetricsAvailable=True", timeout=60, explain=operator_log)
        explain = lambda: (f"job status: {jobs.get('charted').get('status')}\nevents: {jobs.events('charted')}\n"  # noqa: E731
                           f"operator log:\n{operator_log()}")
        prometheus.wait_for(f'pat_operator_reconciles_total{{namespace="{system}"}}', timeout=30, explain=explain)
        # (a gang restart on the way would reset the new trainer's gauge to 0 until its first iteration)
        prometheus.wait_for(f'pat_trainer_iteration{{namespace="{namespace}", pat_job="charted"}} >= 1', timeout=90,
                            explain=explain)
        # The job runs engine pat: the panels of vLLM's series (engine vllm) have no data here.
        queries = [(title, expr) for title, expr in
                   [*panel_queries(ROOT / "dashboards" / "rlhf-job.json", namespace=namespace, job="charted"),
                    *panel_queries(ROOT / "dashboards" / "operator.json", namespace=system)]
                   if names.VLLM_PREFIX not in expr]
        assert len(queries) >= 15
        empty = [f"{title}: {expr}" for title, expr in queries if not prometheus.query(expr)]
        assert not empty, "panels without data:\n" + "\n".join(empty)
        for title, expr in annotation_queries(ROOT / "dashboards" / "rlhf-job.json", namespace=namespace,
                                              job="charted"):
            prometheus.query(expr)  # valid PromQL (a regroup may or may not have happened)
        assert jobs.get("charted")["status"]["phase"] == "Running", "the job ended before the checks: lengthen it"
        # 4 s an iteration was measured with another suite running beside it: 100 iterations take minutes
        jobs.wait("charted", phase("Succeeded"), "Succeeded", timeout=600, explain=operator_log)
        jobs.delete("charted")  # while the operator runs: it removes its finalizer
        _wait_gone(jobs, "charted")
    finally:
        helm("uninstall", "rel", "-n", system, "--wait", check=False)
    # What is left of the release: the CRDs (helm never deletes those) and the peering object (kept on purpose).
    selector = "app.kubernetes.io/instance=rel"
    deadline = time.monotonic() + 60
    while core.list_namespaced_pod(system, label_selector=selector).items and time.monotonic() < deadline:
        time.sleep(0.5)
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    left = [*core.list_namespaced_pod(system, label_selector=selector).items,
            *core.list_namespaced_service_account(system, label_selector=selector).items,
            *core.list_namespaced_secret(system, label_selector=selector).items,
            *core.list_namespaced_config_map(system, label_selector=selector).items,
            *core.list_namespaced_service(system, label_selector=selector).items,
            *apps.list_namespaced_deployment(system, label_selector=selector).items,
            *rbac.list_cluster_role(label_selector=selector).items,
            *rbac.list_cluster_role_binding(label_selector=selector).items]
    assert not left, [f"{o.kind}/{o.metadata.name}" for o in left]
    ext = kubernetes.client.ApiextensionsV1Api(api)
    assert ext.read_custom_resource_definition("rlhfjobs.pat.dev").metadata.name == "rlhfjobs.pat.dev"
    core.delete_namespace(system, _preload_content=False)
    api.close()


def _wait_gone(jobs: Jobs, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while jobs.exists(name):
        assert time.monotonic() < deadline, f"{name} not deleted in {timeout} s"
        time.sleep(0.25)
