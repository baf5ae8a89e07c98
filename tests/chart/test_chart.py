"""The Helm chart with a real helm v3 (scripts/helm-fetch.sh): lint and template are clean and render the same bytes
every time, bad values are refused naming the value, the rendered manifests (NetworkPolicy, PodDisruptionBudget,
RBAC included) validate strictly and pass the local API server's dry run, an upgrade from chart 0.1.0 keeps its
token key, and `helm install --wait` runs two operator replicas as pods from the pat-operator image (built by
scripts/images.sh; the process kubelet runs it chrooted; in-cluster config with their ServiceAccount's token, the
chart's RBAC only), one of them the leader, that reconcile a real RLHFJob whose trainer and generator pods run from
the pat-worker image (CPU torch) while a real Prometheus scrapes it and the workers -- every dashboard panel's query
returns series -- and `helm uninstall` leaves only the CRDs, the operator's token key and its Lease."""

from __future__ import annotations

import json
import secrets
import shutil
import time
from pathlib import Path

import kubernetes
import kubernetes_validate
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from pat_operator import metric_names as names
from tests.cluster.dashboards import annotation_queries, panel_queries
from tests.cluster.helm import CHART, ROOT, Helm
from tests.cluster.images import built
from tests.operator.conftest import Jobs, condition, job_doc, phase
from tests.operator.harness import alone

RULES = CHART / "files" / "operator-rules.yaml"
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
MONITORS = ["--set", "serviceMonitor.enabled=true", "--set", "podMonitor.enabled=true"]
# kube-prometheus-stack's Prometheus in the namespace monitoring, as values.yaml documents it.
PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
EVERY_OPTION = ["--set", "prometheus.url=https://thanos-query.monitoring:9090",
                "--set", "prometheus.bearerTokenFile=/var/run/secrets/kubernetes.io/serviceaccount/token",
                "--set", "prometheus.caFile=/etc/prometheus-ca/ca.crt",
                "--set", "prometheus.headers.X-Scope-OrgID=team-a",
                "--set-json", f"networkPolicy.workerIngressFrom={json.dumps([PROMETHEUS_PEER])}",
                "--set-json", f"networkPolicy.metricsFrom={json.dumps([PROMETHEUS_PEER])}",
                "--set", "jobPods.allowPrivileged=true"]
# Chart 0.1.0's templates/secret.yaml, verbatim: it made the token key in the template (lookup, else random).
OLD_SECRET_TEMPLATE = """\
{{- if not .Values.tokenKey.existingSecret }}
{{- /* Made once: an upgrade keeps the key (a new one would make every running job's token invalid). */}}
{{- $name := include "pat.tokenKeySecret" . }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $name }}
  namespace: {{ .Release.Namespace }}
  labels: {{- include "pat.labels" . | nindent 4 }}
type: Opaque
data:
  token-key: {{ if $existing }}{{ index $existing.data "token-key" }}{{ else }}{{ randAlphaNum 64 | b64enc }}{{ end }}
{{- end }}
"""
STATUS_WRITES = {"create", "update", "patch", "delete", "deletecollection", "*"}


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm"))


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def release(docs: list[dict]) -> list[dict]:
    """What the release holds: the rendered objects but helm's hooks (run around an install or uninstall)."""
    return [d for d in docs if "helm.sh/hook" not in (d["metadata"].get("annotations") or {})]


def named(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def operator_container(docs: list[dict]) -> dict:
    [deployment] = by_kind(docs, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def peers_passed(args: list[str]) -> list[dict]:
    """The NetworkPolicyPeers the chart passes to the operator's --network-policy-from, parsed."""
    return [json.loads(a.split("=", 1)[1]) for a in args if a.startswith("--network-policy-from=")]


def verbs_on(role: dict, resource: str) -> set[str]:
    return {v for rule in role["rules"] if "pat.dev" in rule["apiGroups"] and resource in rule["resources"]
            for v in rule["verbs"]}


def old_chart(folder: Path) -> Path:
    """Chart 0.1.0 reduced to its token-key Secret: the same name and helpers as this chart, so the same Secret."""
    (folder / "templates").mkdir(parents=True)
    shutil.copy(CHART / "Chart.yaml", folder)
    shutil.copy(CHART / "templates" / "_helpers.tpl", folder / "templates")
    (folder / "templates" / "secret.yaml").write_text(OLD_SECRET_TEMPLATE)
    (folder / "values.yaml").write_text("tokenKey: {existingSecret: ''}\n")
    return folder


def test_lint_is_clean(helm):
    for values in ([], [*MONITORS, *EVERY_OPTION, "--set", "watchNamespaces={a,b}"],
                   ["--set", "replicaCount=1", "--set", "leaderElection.enabled=false", "--set",
                    "tokenKey.existingSecret=key", "--set", "networkPolicy.enabled=false"]):
        done = helm("lint", "--strict", str(CHART), *values)
        assert "0 chart(s) failed" in done.stdout
        assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout
        assert not done.stderr, done.stderr  # e.g. helm's warnings about symbolic links in the chart


def test_template_renders_a_least_privilege_operator(helm):
    docs = release(helm.template())
    assert [p.name for p in DASHBOARDS] == ["operator.json", "rlhf-job.json"]
    # No Secret: the operator makes its token key (helm template looks nothing up, and makes no key either).
    assert sorted(d["kind"] for d in docs) == sorted(
        ["ServiceAccount", *["ClusterRole"] * 3, "ClusterRoleBinding", "Role", "RoleBinding", "Service", "Deployment",
         "NetworkPolicy", "PodDisruptionBudget", *["ConfigMap"] * len(DASHBOARDS)])
    [deployment] = by_kind(docs, "Deployment")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    container = operator_container(docs)
    assert container["command"] == ["pat-operator"] and container["image"] == "ghcr.io/pat-rlhf/pat-operator:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" and "readinessProbe" in container
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    # The token key: the operator's own Secret, in its namespace (the downward API's), no key file mounted.
    args = container["args"]
    assert "--token-key-secret=rel-pat-operator-token-key" in args and "--operator-namespace=$(POD_NAMESPACE)" in args
    assert not [a for a in args if a.startswith("--token-key-file")]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert "--allow-privileged-pods" not in args  # jobPods.allowPrivileged: false

    operator_role = named(docs, "ClusterRole", "rel-pat-operator")
    assert operator_role["rules"] == yaml.safe_load(RULES.read_text())  # what the operator tests run with, exactly
    assert not [r for role in [*by_kind(docs, "ClusterRole"), *by_kind(docs, "Role")] for r in role["rules"]
                if "kopf.dev" in r["apiGroups"]]
    # The Lease and the token-key Secret: only in the release namespace, read and updated by name only.
    [own] = by_kind(docs, "Role")
    assert own["metadata"]["namespace"] == "pat-system"
    assert own["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["rel-pat-operator"],
         "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["rel-pat-operator-token-key"],
         "verbs": ["get"]}]
    assert "--leader-election-lease=rel-pat-operator" in args
    [account] = by_kind(docs, "ServiceAccount")
    subject = [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "pat-system"}]
    [binding] = by_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"] == subject and binding["roleRef"]["name"] == "rel-pat-operator"
    [own_binding] = by_kind(docs, "RoleBinding")
    assert own_binding["subjects"] == subject and own_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": own["metadata"]["name"]}
    assert own_binding["metadata"]["namespace"] == "pat-system"
    assert pod["serviceAccountName"] == account["metadata"]["name"]

    [service] = by_kind(docs, "Service")
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] in [p["name"] for p in container["ports"]]
    for cm in by_kind(docs, "ConfigMap"):  # the dashboards, byte for byte, for the Grafana sidecar
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        [(name, text)] = cm["data"].items()
        assert json.loads(text) == json.loads((ROOT / "dashboards" / name).read_text())
    assert {cm_name for cm in by_kind(docs, "ConfigMap") for cm_name in cm["data"]} == {p.name for p in DASHBOARDS}


def test_two_replicas_elect_a_leader_and_a_drain_keeps_one(helm):
    docs = helm.template()
    [deployment] = by_kind(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    container = operator_container(docs)
    assert {"--leader-election-lease=rel-pat-operator", "--lease-duration-seconds=15", "--renew-deadline-seconds=10",
            "--retry-period-seconds=2"} <= set(container["args"])
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e} == {
        "POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace", "POD_IP": "status.podIP"}
    [budget] = by_kind(docs, "PodDisruptionBudget")
    assert budget["apiVersion"] == "policy/v1" and budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"] == spec["selector"]
    [term] = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == spec["selector"]
    # Given affinity replaces the default. (Before Kubernetes 1.21 the budget is policy/v1beta1: the dry run below.)
    zone = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}]}}}
    docs = helm.template("--set-json", f"affinity={json.dumps(zone)}")
    assert by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["affinity"] == zone
    # One replica: no budget (minAvailable 1 would block every drain).
    assert not by_kind(helm.template("--set", "replicaCount=1"), "PodDisruptionBudget")
    # Without leader election: one replica, replaced with Recreate, no Lease (nor its rules).
    docs = release(helm.template("--set", "replicaCount=1", "--set", "leaderElection.enabled=false"))
    [deployment] = by_kind(docs, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-election-lease=" in operator_container(docs)["args"]
    assert [r["resources"] for r in by_kind(docs, "Role")[0]["rules"]] == [["secrets"], ["secrets"]]


def test_existing_token_key_secret_is_mounted(helm):
    docs = release(helm.template("--set", "tokenKey.existingSecret=my-key", "--set", "leaderElection.enabled=false",
                                 "--set", "replicaCount=1"))
    container = operator_container(docs)
    assert "--token-key-file=/etc/pat-operator/token-key" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--token-key-secret")]
    pod = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "token-key"]
    assert volume["secret"]["secretName"] == "my-key"
    assert {"name": "token-key", "mountPath": "/etc/pat-operator", "readOnly": True} in container["volumeMounts"]
    # No Lease and no Secret of its own to reach: no Role in the release namespace at all.
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding") and not by_kind(docs, "Secret")


def test_two_renders_are_the_same_bytes(helm, tmp_path):
    """What `helm template` and ArgoCD see: no render makes a new token key (or anything else)."""
    for values in ([], [*MONITORS, *EVERY_OPTION]):
        render = lambda: helm("template", "rel", str(CHART), "-n", "pat-system", *values).stdout  # noqa: E731
        assert render() == render()
    # Negative control: chart 0.1.0's Secret template, without a cluster to look the key up in, differs each time.
    old = old_chart(tmp_path / "old")
    render = lambda: helm("template", "rel", str(old), "-n", "pat-system").stdout  # noqa: E731
    first = render()
    assert "token-key:" in first and render() != first


def test_aggregated_roles_let_namespace_editors_and_viewers_use_rlhfjobs(helm):
    docs = helm.template()
    edit = named(docs, "ClusterRole", "rel-pat-operator-edit")
    view = named(docs, "ClusterRole", "rel-pat-operator-view")
    assert {k: v for k, v in edit["metadata"]["labels"].items() if k.startswith("rbac.")} == {
        "rbac.authorization.k8s.io/aggregate-to-admin": "true", "rbac.authorization.k8s.io/aggregate-to-edit": "true"}
    assert {k: v for k, v in view["metadata"]["labels"].items() if k.startswith("rbac.")} == {
        "rbac.authorization.k8s.io/aggregate-to-view": "true"}
    assert verbs_on(edit, "rlhfjobs") == {"create", "delete", "deletecollection", "patch", "update", "get", "list",
                                          "watch"}
    assert verbs_on(view, "rlhfjobs") == verbs_on(view, "rlhfjobs/status") == {"get", "list", "watch"}
    # The status is the operator's: people read it only.
    assert verbs_on(edit, "rlhfjobs/status") == {"get", "list", "watch"}
    assert not verbs_on(edit, "rlhfjobs/status") & STATUS_WRITES
    # Negative control: the same check finds the operator's own status write.
    assert verbs_on(named(docs, "ClusterRole", "rel-pat-operator"), "rlhfjobs/status") & STATUS_WRITES == {"patch"}
    # No binding gives them to anyone: the cluster's admin / edit / view roles take them in.
    assert [b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")] == ["rel-pat-operator"]
    off = helm.template("--set", "aggregatedRoles.enabled=false")
    assert [r["metadata"]["name"] for r in by_kind(off, "ClusterRole")] == ["rel-pat-operator"]


def test_network_policies_open_only_the_operators_ports_and_pass_the_job_peers(helm):
    docs = helm.template()
    [deployment] = by_kind(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = operator_container(docs)
    [policy] = by_kind(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress: the API server, Prometheus, the workers
    # Only the named container ports; from anyone (the kubelet's probes come from the node).
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "liveness", "protocol": "TCP"}]},
                                         {"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    assert {p["name"] for p in container["ports"]} == {"liveness", "metrics"}
    # The jobs' NetworkPolicies (the operator's): its own pods, by namespace name and the chart's selector labels.
    operator_pods = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pat-system"}},
                     "podSelector": deployment["spec"]["selector"]}
    assert "--network-policy" in container["args"] and peers_passed(container["args"]) == [operator_pods]

    docs = helm.template(*EVERY_OPTION)
    [policy] = by_kind(docs, "NetworkPolicy")
    assert policy["spec"]["ingress"][1] == {"ports": [{"port": "metrics", "protocol": "TCP"}],
                                            "from": [PROMETHEUS_PEER]}
    assert peers_passed(operator_container(docs)["args"]) == [operator_pods, PROMETHEUS_PEER]

    off = helm.template("--set", "networkPolicy.enabled=false")
    assert not by_kind(off, "NetworkPolicy")
    assert not [a for a in operator_container(off)["args"] if a.startswith("--network-policy")]


def test_values_become_the_operators_flags(helm):
    args = operator_container(helm.template(*EVERY_OPTION))["args"]
    assert {"--prometheus-url=https://thanos-query.monitoring:9090",
            "--prometheus-bearer-token-file=/var/run/secrets/kubernetes.io/serviceaccount/token",
            "--prometheus-ca-file=/etc/prometheus-ca/ca.crt", "--prometheus-header=X-Scope-OrgID=team-a",
            "--allow-privileged-pods"} <= set(args)
    # prometheusURL, the earlier name, still works.
    args = operator_container(helm.template("--set", "prometheusURL=http://p:9090"))["args"]
    assert "--prometheus-url=http://p:9090" in args
    assert not [a for a in args if a.startswith(("--prometheus-header", "--prometheus-ca", "--prometheus-bearer"))]
    args = operator_container(helm.template("--set", "jobPods.allowedHostPaths={/mnt/data,/scratch}"))["args"]
    assert [a for a in args if a.startswith("--allow-")] == ["--allow-host-path=/mnt/data", "--allow-host-path=/scratch"]


def test_watched_namespaces_get_roles_and_nothing_cluster_wide(helm):
    docs = release(helm.template("--set", "watchNamespaces={team-a,team-b}"))
    kinds = {d["kind"] for d in docs}
    assert "ClusterRoleBinding" not in kinds, kinds
    # Cluster-wide only the aggregated roles for people, bound to no one by the chart.
    assert sorted(r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")) == [
        "rel-pat-operator-edit", "rel-pat-operator-view"]
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "Role")) == ["pat-system", "team-a", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "RoleBinding")) == [
        "pat-system", "team-a", "team-b"]
    for role in by_kind(docs, "Role"):
        if role["metadata"]["namespace"] != "pat-system":
            assert role["rules"] == yaml.safe_load(RULES.read_text())
    args = operator_container(docs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    # The release namespace watched too: its two Roles (the rules, the Lease's) are two objects, named apart.
    docs = release(helm.template("--set", "watchNamespaces={pat-system}"))
    assert len({r["metadata"]["name"] for r in by_kind(docs, "Role")}) == 2


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
    (["--set", "prometheus.url=prometheus:9090"], "prometheus.url"),
    (["--set", "prometheusURL=http://a:9090", "--set", "prometheus.url=http://b:9090"], "prometheusURL"),
    (["--set", "prometheus.headers.X Scope=a"], "prometheus.headers"),
    (["--set", "prometheus.caFile=ca.crt"], "prometheus.caFile"),
    (["--set", "replicaCount=0"], "replicaCount"),
    (["--set", "leaderElection.enabled=false"], "replicaCount"),  # 2 replicas, each would act
    (["--set", "leaderElection.renewDeadlineSeconds=20"], "leaderElection"),
    (["--set", "leaderElection.retryPeriodSeconds=9"], "leaderElection"),  # 1.2 x 9 s of jitter > 10 s deadline
    (["--set", "leaderElection.leaseName=Pat_Lease"], "leaderElection.leaseName"),
    (["--set", "peering.priority=100"], "peering"),  # chart 0.1.0's values, e.g. under --reuse-values
    (["--set-json", 'networkPolicy.workerIngressFrom=[{"podSelector": {"app": "prometheus"}}]'],
     "networkPolicy.workerIngressFrom"),
    (["--set-json", "networkPolicy.metricsFrom=[{}]"], "networkPolicy.metricsFrom"),
    (["--set", "jobPods.allowPrivileged=yes"], "jobPods.allowPrivileged"),
    (["--set", "jobPods.allowedHostPaths={data}"], "jobPods.allowedHostPaths"),  # not absolute
    (["--set", "aggregatedRoles.enable=false"], "aggregatedRoles"),
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
    assert [d["metadata"]["name"] for d in shown] == ["rlhfjobs.pat.dev"]  # no kopf peering CRDs: no peering
    assert sorted(shown, key=str) == sorted(files, key=str)


# Kinds of CRDs (prometheus-operator's monitors): no Kubernetes schema has them.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor"}


def test_rendered_chart_validates_strictly_against_kubernetes_schemas(helm):
    """helm template, CRDs, monitors and every option included, against the Kubernetes 1.30 and 1.34 schemas
    (kubernetes-validate, strict: no unknown field); only the custom kinds have none."""
    rendered = [*helm.template("--include-crds", *MONITORS, *EVERY_OPTION),
                *helm.template("--set", "watchNamespaces={team-a,team-b}"),
                *helm.template("--set", "tokenKey.existingSecret=key")]
    unchecked = set()
    for obj in rendered:
        for version in ("1.30.0", "1.34.0"):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unchecked.add(obj["kind"])
    assert unchecked <= CUSTOM_KINDS, unchecked
    assert {"Deployment", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "NetworkPolicy",
            "PodDisruptionBudget", "CustomResourceDefinition"} <= {o["kind"] for o in rendered}
    # Negative control: strict validation refuses a NetworkPolicy with a field Kubernetes does not have.
    policy = by_kind(rendered, "NetworkPolicy")[0]
    typo = {**policy, "spec": {**policy["spec"], "ingres": policy["spec"]["ingress"]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, "1.34.0", strict=True)


@pytest.mark.cluster
def test_rendered_manifests_pass_the_servers_dry_run(cluster, namespace, tmp_path):
    helm = Helm(tmp_path, cluster.kubeconfig)
    # CRDs first, as helm installs them (which does not validate them client-side: a 1.20 schema has no CEL rules,
    # which kubectl >= 1.25 refuses, and the server drops).
    helm.kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"))
    # --validate: rendered for this server's API versions (its PodDisruptionBudget is policy/v1beta1), as install does
    for values in ([], ["--set", f"watchNamespaces={{{namespace}}}"]):
        rendered = helm("template", "rel", str(CHART), "-n", namespace, "--validate", *EVERY_OPTION, *values).stdout
        done = helm.kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)
        assert done.stdout.count("(server dry run)") == len([d for d in yaml.safe_load_all(rendered) if d])


@pytest.mark.cluster
def test_upgrade_from_the_chart_that_rendered_the_token_key_keeps_the_key(cluster, namespace, tmp_path):
    """Chart 0.1.0 rendered the token-key Secret itself, without helm.sh/resource-policy: keep; this chart renders
    it again (looked up, unchanged) so helm does not delete it. Negative control: a chart without that template."""
    helm = Helm(tmp_path, cluster.kubeconfig)
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    old = old_chart(tmp_path / "old")
    unscheduled = ["--set", "nodeSelector.pat\\.dev/no-such-node=here"]  # no operator runs: only the Secret matters
    no_hooks = ["--no-hooks"]  # the pre-delete hook's pod would wait for that node too
    key = lambda release: core.read_namespaced_secret(f"{release}-pat-operator-token-key", namespace).data  # noqa: E731
    try:
        helm("install", "upg", str(old), "-n", namespace)
        before = key("upg")
        assert len(before["token-key"]) > 64
        for _ in range(2):  # 0.1.0 -> this chart, then this chart -> itself
            helm("upgrade", "upg", str(CHART), "-n", namespace, *unscheduled)
            assert key("upg") == before
        secret = core.read_namespaced_secret("upg-pat-operator-token-key", namespace)
        assert secret.metadata.annotations["helm.sh/resource-policy"] == "keep"
        helm("uninstall", "upg", "-n", namespace, "--wait", *no_hooks)
        assert key("upg") == before  # kept, like the Secret the operator makes

        without = shutil.copytree(CHART, tmp_path / "without-secret")
        (without / "templates" / "secret.yaml").unlink()
        helm("install", "ctl", str(old), "-n", namespace)
        assert key("ctl")
        helm("upgrade", "ctl", str(without), "-n", namespace, *unscheduled)
        with pytest.raises(ApiException) as gone:
            key("ctl")
        assert gone.value.status == 404
    finally:
        for release in ("upg", "ctl"):
            helm("uninstall", release, "-n", namespace, "--wait", *no_hooks, check=False)


@pytest.mark.cluster
def test_helm_install_runs_the_operator_and_every_dashboard_panel_has_data(cluster, prometheus, namespace,
                                                                           tmp_path):
    """Cluster-wide, two replicas. No other operator may run meanwhile (the Lease is per release namespace): the
    tests' own operator (tests/operator, session-scoped), if this worker has started it, is stopped meanwhile."""
    with alone():
        _install_and_run_a_job(cluster, prometheus, namespace, tmp_path)


def _install_and_run_a_job(cluster, prometheus, namespace, tmp_path) -> None:
    helm = Helm(tmp_path, cluster.kubeconfig)
    system = f"pat-chart-{secrets.token_hex(3)}"
    api = cluster.api_client()
    core, apps = kubernetes.client.CoreV1Api(api), kubernetes.client.AppsV1Api(api)
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    jobs = Jobs(api, namespace)
    images = built()
    repository, tag = images["pat-operator"].rsplit(":", 1)
    try:
        helm("install", "rel", str(CHART), "-n", system, "--create-namespace", "--wait", "--timeout", "3m",
             "--set-string", "listenAddress=$(POD_IP)", "--set", f"image.repository={repository}",
             "--set-string", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
             "--set", f"prometheus.url={prometheus.url}", "--set", "restartBackoffSeconds=1")
        pods = core.list_namespaced_pod(system, label_selector="app.kubernetes.io/instance=rel").items
        assert len(pods) == 2
        for pod in pods:
            assert pod.status.container_statuses[0].ready and pod.status.container_statuses[0].restart_count == 0
            [pid] = cluster.kubelet.pids(system, pod.metadata.name)
            assert "Uid:\t1000\t" in Path(f"/proc/{pid}/status").read_text()  # non-root, as the chart says
            # From the image: chrooted into its root filesystem, the image's interpreter, no torch beside it.
            assert Path(f"/proc/{pid}/root/opt/venv/bin/pat-operator").exists()
            assert not list(Path(f"/proc/{pid}/root/opt/venv/lib").glob("python3*/site-packages/torch"))
        lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease("rel-pat-operator", system)
        [leader] = [p.metadata.name for p in pods if p.metadata.name in (lease.spec.holder_identity or "")]
        operator_log = lambda: cluster.kubelet.log(system, leader, "operator")[-4000:]  # noqa: E731
        # The operator made its token key (the chart made none).
        key = core.read_namespaced_secret("rel-pat-operator-token-key", system)
        assert len(key.data["token-key"]) >= 24  # base64 of at least 16 bytes
        assert "meta.helm.sh/release-name" not in (key.metadata.annotations or {})
        # The cluster's aggregation controller gave the built-in roles the chart's RLHFJob rules.
        for role, verb in (("admin", "create"), ("edit", "create"), ("view", "list")):
            deadline = time.monotonic() + 30
            while not any("rlhfjobs" in (r.resources or []) and verb in r.verbs
                          for r in rbac.read_cluster_role(role).rules or []):
                assert time.monotonic() < deadline, f"ClusterRole {role} has no {verb} on rlhfjobs"
                time.sleep(0.5)

        # Two jobs of the pat-worker image at once: "charted" runs far longer than the checks below take (a finished
        # pod's series go stale in Prometheus at once, and the panels' instant queries would find nothing) and is
        # deleted after them; "short" (2 iterations) meanwhile runs to Succeeded.
        for name, iterations in (("charted", 10_000), ("short", 2)):
            doc = job_doc(name)
            doc["spec"]["model"]["tiny"]["preset"] = "test"
            doc["spec"]["algorithm"].update(iterations=iterations, promptsPerIteration=4, samplesPerPrompt=4,
                                            maxResponseTokens=24)
            doc["spec"]["reward"]["overlongBuffer"] = 4
            doc["spec"]["generator"].update(maxBatch=16, maxSeq=64)
            doc["spec"]["generator"]["adaptiveTP"]["controller"] = "operator"  # the operator queries Prometheus
            doc["spec"]["trainer"]["image"] = doc["spec"]["generator"]["image"] = images["pat-worker"]
            jobs.create(doc)
        jobs.wait("charted", lambda j: (j.get("status") or {}).get("iteration", 0) >= 2, "iteration 2",
                  timeout=240, explain=operator_log)
        for role in ("trainer", "generator"):  # the job's pods run from pat-worker
            pids = cluster.kubelet.pids(namespace, jobs.pod("charted", role))
            assert pids and all(Path(f"/proc/{pid}/root/opt/venv/bin/pat").exists() for pid in pids), (role, pids)
        # The job's NetworkPolicy lets the operator's pods in, as the chart told it (--network-policy-from).
        operator_pods = {"namespace_selector": {"match_expressions": None,
                                                "match_labels": {"kubernetes.io/metadata.name": system}},
                         "pod_selector": {"match_expressions": None, "match_labels": {
                             "app.kubernetes.io/name": "pat-operator", "app.kubernetes.io/instance": "rel"}},
                         "ip_block": None}
        policies = kubernetes.client.NetworkingV1Api(api).list_namespaced_network_policy(namespace).items
        assert any(operator_pods in [peer.to_dict() for rule in p.spec.ingress or [] for peer in rule._from or []]
                   for p in policies), [p.to_dict() for p in policies]
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
        assert jobs.get("charted")["status"]["phase"] == "Running"
        jobs.wait("short", phase("Succeeded"), "Succeeded", timeout=300, explain=operator_log)
        for name in ("charted", "short"):
            jobs.delete(name)  # while the operator runs: it removes its finalizer
            _wait_gone(jobs, name)
    finally:
        helm("uninstall", "rel", "-n", system, "--wait", check=False)
    # What is left of the release: the CRDs (helm never deletes those), and the operator's token key and Lease
    # (its own objects, not helm's: they go with the namespace).
    selector = "app.kubernetes.io/instance=rel"
    deadline = time.monotonic() + 60
    while core.list_namespaced_pod(system, label_selector=selector).items and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [*core.list_namespaced_pod(system, label_selector=selector).items,
            *core.list_namespaced_service_account(system, label_selector=selector).items,
            *core.list_namespaced_secret(system, label_selector=selector).items,
            *core.list_namespaced_config_map(system, label_selector=selector).items,
            *core.list_namespaced_service(system, label_selector=selector).items,
            *apps.list_namespaced_deployment(system, label_selector=selector).items,
            *rbac.list_namespaced_role(system, label_selector=selector).items,
            *rbac.list_namespaced_role_binding(system, label_selector=selector).items,
            *rbac.list_cluster_role(label_selector=selector).items,
            *rbac.list_cluster_role_binding(label_selector=selector).items]
    assert not left, [f"{o.kind}/{o.metadata.name}" for o in left]
    # (this client has no policy/v1beta1, the 1.20 server's PodDisruptionBudget)
    assert not helm.kubectl("get", "networkpolicies,poddisruptionbudgets", "-n", system, "-l", selector,
                            "-o", "name").stdout
    ext = kubernetes.client.ApiextensionsV1Api(api)
    assert ext.read_custom_resource_definition("rlhfjobs.pat.dev").metadata.name == "rlhfjobs.pat.dev"
    core.delete_namespace(system, _preload_content=False)
    api.close()


def _wait_gone(jobs: Jobs, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while jobs.exists(name):
        assert time.monotonic() < deadline, f"{name} not deleted in {timeout} s"
        time.sleep(0.25)
