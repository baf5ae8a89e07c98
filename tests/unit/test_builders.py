"""Pure pod / service / secret builders: owners, labels, env, resources, security, gang metadata."""

import re
from pathlib import Path

import pytest
import yaml

from pat_operator import builders, commands
from pat_operator.api import parse_job

EXAMPLE = Path(__file__).parents[2] / "examples" / "local.yaml"


def job(**spec_edits):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["placement"] = "separate"  # trainer and generator pods; colocated_* tests set colocated
    doc["metadata"]["namespace"] = "team"
    for key, value in spec_edits.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return parse_job(doc)


def env_of(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_trainer_pod_is_owned_non_root_and_finds_its_generators():
    j = job(trainer={"gpusPerPod": 2, "resources": {"requests": {"cpu": "4"}}, "nodeSelector": {"gpu": "h200"},
                     "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
            checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}})
    pod = builders.pod(j, "uid-1", "trainer", 0, attempt=3)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == builders.pod_name(j, "uid-1", "trainer", 0, 3) and meta["namespace"] == "team"
    assert meta["name"].startswith("arithmetic-grpo-trainer-0-") and meta["name"] != builders.pod_name(
        j, "uid-1", "trainer", 0, 4) != builders.pod_name(j, "uid-2", "trainer", 0, 3)  # unique per attempt and uid
    assert meta["ownerReferences"] == [{"apiVersion": "pat.dev/v1alpha1", "kind": "RLHFJob", "name": "arithmetic-grpo",
                                        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert meta["labels"][builders.LABEL_ATTEMPT] == "3" and meta["labels"][builders.LABEL_ROLE] == "trainer"
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 1000
    service = builders.names(j, "uid-1")["service"]
    assert (spec["hostname"], spec["subdomain"], spec["nodeSelector"]) == ("arithmetic-grpo-trainer-0", service,
                                                                           {"gpu": "h200"})
    assert service == f"arithmetic-grpo-{builders.uid_suffix('uid-1')}"
    (c,) = spec["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"] == {"requests": {"cpu": "4", "nvidia.com/gpu": 2, "ephemeral-storage": "4217Mi"},
                              "limits": {"nvidia.com/gpu": 2}}  # scratch: /tmp and the tiny model's work dir
    env = env_of(c)
    secret = builders.names(j, "uid-1")["token"]
    assert env["PAT_JOB_TOKEN"] == {"secretKeyRef": {"name": secret, "key": "token"}}
    assert env["PAT_INFERENCE_TOKEN"] == {"secretKeyRef": {"name": secret, "key": "inference-token"}}
    assert env["NCCL_DEBUG"] == "INFO" and env["OMP_NUM_THREADS"] == "2"  # 4 CPUs for its 2 ranks
    assert env["PAT_ATTEMPT"] == "3" and env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    args = c["args"]
    assert args[0] == "trainer" and args[args.index("--host") + 1] == "$(POD_IP)"
    assert args[args.index("--generators") + 1] == f"http://arithmetic-grpo-generator-0.{service}.team.svc:8000"
    assert {"name": "run", "persistentVolumeClaim": {"claimName": "ckpt"}} in spec["volumes"]
    assert spec["initContainers"][0]["args"][:1] == ["prepare"]  # the tiny model is built in the pod


def launch_options(args: list[str]) -> dict[str, str]:
    """A trainer pod's torch.distributed.run options: `trainer OPTIONS -- RANK_OPTIONS`."""
    launch = args[1:args.index("--")]
    return dict(zip(launch[::2], launch[1::2], strict=True))


def test_trainer_pods_run_one_rank_per_gpu_through_torch_distributed_run():
    j = job(trainer={"replicas": 2, "gpusPerPod": 4})
    host0 = f"arithmetic-grpo-trainer-0.{builders.names(j, 'u')['service']}.team.svc"
    for i in range(2):
        (c,) = builders.pod(j, "u", "trainer", i, 0)["spec"]["containers"]
        assert c["command"] == ["pat"] and c["args"][0] == "trainer"
        assert launch_options(c["args"]) == {"--nnodes": "2", "--nproc-per-node": "4", "--node-rank": str(i),
                                             "--master-addr": host0, "--master-port": "29500", "--max-restarts": "0"}
        rank = c["args"][c["args"].index("--") + 1:]
        assert rank[rank.index("--host") + 1] == "$(POD_IP)"  # where the generators reach rank 0's weights
        assert rank[rank.index("--bind") + 1] == "0.0.0.0"  # its metrics listen on every address, as a pod's do
        assert rank[rank.index("--metrics-port") + 1] == ("9100" if i == 0 else "0")
        # torchrun sets the rank variables per process; no CPUs asked for: torchrun's thread default stays
        assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS"} & env_of(c).keys()
    cpu = job(trainer={"gpusPerPod": 0, "ranksPerPod": 3, "resources": {"requests": {"cpu": "7500m"}}})
    (c,) = builders.pod(cpu, "u", "trainer", 0, 0)["spec"]["containers"]
    assert launch_options(c["args"])["--nproc-per-node"] == "3" and launch_options(c["args"])["--nnodes"] == "1"
    assert env_of(c)["OMP_NUM_THREADS"] == "2"  # 7.5 CPUs for 3 ranks
    (c,) = builders.pod(job(), "u", "trainer", 0, 0)["spec"]["containers"]
    assert launch_options(c["args"])["--nproc-per-node"] == "1"  # CPU without ranksPerPod: one rank


def test_pat_trainer_hands_the_pod_command_to_torch_distributed_run(monkeypatch):
    """What torch's own launcher makes of a trainer pod's command: 4 rank processes of the rank module on node 1
    of 2, static rendezvous at trainer pod 0, no restarts."""
    import sys

    from torch.distributed import run

    from pat_workers.cli import main as pat

    j = job(trainer={"replicas": 2, "gpusPerPod": 4})
    (c,) = builders.pod(j, "u", "trainer", 1, 0)["spec"]["containers"]
    launched = []
    monkeypatch.setattr(run, "main", launched.append)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else config_from_args sets it in this process
    assert pat(c["args"]) == 0
    config, command, command_args = run.config_from_args(run.parse_args(launched[0]))
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (2, 2, 4, 0)
    assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == 1
    assert config.rdzv_endpoint == f"arithmetic-grpo-trainer-0.{builders.names(j, 'u')['service']}.team.svc:29500"
    rank_args = c["args"][c["args"].index("--") + 1:]
    assert command == sys.executable and command_args == ["-u", "-m", "pat_workers.trainer", *rank_args]
    assert pat(c["args"][:c["args"].index("--")]) == 2 and len(launched) == 1  # no `--`: nothing is started

def test_generator_pod_has_probe_shm_and_the_adaptive_tp_settings():
    j = job(generator={"adaptiveTP": {"tpSizes": [1, 2], "minGain": 0.3, "controller": "operator"},
                       "memoryUtilization": 0.85})
    (c,) = builders.pod(j, "u", "generator", 0, 0)["spec"]["containers"]
    assert "--compile-step" not in c["args"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    a = c["args"]
    flags = ("--ranks", "--controller", "--margin", "--tp-sizes", "--host", "--memory-utilization", "--device")
    assert [a[a.index(f) + 1] for f in flags] == ["2", "operator", "0.3", "1,2", "0.0.0.0", "0.85", "cpu"]
    gpus = job(generator={"gpusPerPod": 2, "ranksPerPod": None, "compileStep": True})
    (c,) = builders.pod(gpus, "u", "generator", 0, 0)["spec"]["containers"]
    assert c["args"][c["args"].index("--device") + 1] == "cuda" and "--compile-step" in c["args"]


@pytest.mark.parametrize("flag, value, error", [
    ("--memory-utilization", "0", "engine option memory_utilization=0.0 is invalid: use a fraction in (0, 1]"),
    ("--kv-cache-bytes", "-1", ("engine option kv_cache_bytes=-1 is invalid: use 0 (from memory_utilization) or a "
                                "byte count")),
], ids=["memory-utilization", "kv-cache-bytes"])
def test_the_generator_takes_the_pods_flags_and_exits_2_on_a_bad_engine_option(monkeypatch, capsys, flag, value,
                                                                                 error):
    """Every flag of the pod's command line parses (argparse would name an unknown one); the engine's options
    are checked before any rank starts."""
    from pat_workers.generator.__main__ import main as generator

    monkeypatch.setenv("PAT_JOB_TOKEN", "token")
    args = commands.generator_args(job().spec, "/no/model", "127.0.0.1")
    assert args[0] == "generator" and generator([*args[1:], flag, value]) == 2
    assert capsys.readouterr().err == f"pat generator: {error}\n"

def test_the_generator_takes_a_vllm_pods_flags_and_exits_2_on_a_tp_not_dividing_its_ranks(monkeypatch, capsys):
    """The vLLM pod's command line parses whole (extra vLLM flags included) and is checked before vLLM starts."""
    from pat_workers.generator.__main__ import main as generator

    monkeypatch.setenv("PAT_JOB_TOKEN", "token")
    spec = job(generator={"engine": "vllm", "vllm": {"extraArgs": ["--max-num-seqs=8"]},
                          "adaptiveTP": {"enabled": False}}).spec
    args = commands.generator_args(spec, "/no/model", "127.0.0.1")
    assert args[:3] == ["generator", "--engine", "vllm"] and "--vllm-arg=--max-num-seqs=8" in args
    assert generator([*args[1:], "--tensor-parallel-size", "3"]) == 2
    assert "TP size 3 (--tensor-parallel-size or --tp-sizes) must be a power of two dividing --ranks=2" in capsys.readouterr().err
    assert generator(args[1:]) == 2  # the flags parse; the model directory is checked next
    assert capsys.readouterr().err == "pat generator: --model /no/model: no config.json there (a Hugging Face " \
                                      "model directory)\n"


def test_custom_command_replaces_the_worker_and_its_init_container():
    j = job(generator={"command": ["sleep", "infinity"]})
    spec = builders.pod(j, "u", "generator", 0, 0)["spec"]
    assert spec["containers"][0]["command"] == ["sleep", "infinity"] and "args" not in spec["containers"][0]
    assert "initContainers" not in spec


def test_gang_metadata_for_kueue_and_volcano():
    kueue = builders.pod(job(scheduling={"queueName": "team-a"}), "u", "generator", 1, 2)["metadata"]
    assert kueue["labels"][builders.KUEUE_QUEUE] == "team-a"
    assert kueue["labels"][builders.KUEUE_GROUP] == f"arithmetic-grpo-{builders.uid_suffix('u')}-2"
    assert kueue["annotations"][builders.KUEUE_TOTAL] == "2"
    v = job(scheduling={"schedulerName": "volcano", "priorityClassName": "high"})
    pod = builders.pod(v, "u", "trainer", 0, 0)
    assert pod["spec"]["schedulerName"] == "volcano" and pod["spec"]["priorityClassName"] == "high"
    assert pod["metadata"]["annotations"][builders.VOLCANO_GROUP] == builders.names(v, "u")["podgroup"]
    group = builders.volcano_podgroup(v, "u")
    assert group["spec"] == {"minMember": 2, "priorityClassName": "high"} and group["kind"] == "PodGroup"
    assert builders.volcano_podgroup(job(), "u") is None
    plain = builders.pod(job(scheduling={"queueName": "team-a", "gang": False}), "u", "trainer", 0, 0)["metadata"]
    assert builders.KUEUE_GROUP not in plain["labels"] and "annotations" not in plain


def test_configmap_holds_the_validated_spec_with_defaults_and_the_token_is_derived():
    j = job()
    doc = yaml.safe_load(builders.spec_configmap(j, "u")["data"]["job.yaml"])
    assert parse_job(doc) == j.model_copy(update={"metadata": j.metadata})
    assert doc["spec"]["generator"]["adaptiveTP"]["cooldownSteps"] == 4  # defaults are written out
    a, b = builders.job_token(b"k" * 32, "uid-1"), builders.job_token(b"k" * 32, "uid-2")
    assert a != b and a == builders.job_token(b"k" * 32, "uid-1") and len(a) == 64
    inference = builders.job_token(b"k" * 32, "u", "inference")
    assert builders.token_secret(j, "u", b"k" * 32)["stringData"] == {"token": builders.job_token(b"k" * 32, "u"),
                                                                      "inference-token": inference}
    assert inference != builders.job_token(b"k" * 32, "u")  # an inference token cannot regroup or send weights
    svc = builders.headless_service(j, "u")["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"]


def test_every_generated_hostname_and_label_value_is_valid_for_the_longest_job_name():
    name = "a" * 40 + "-" + "b" * 22  # 63 characters: the longest valid job name
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["placement"] = "separate"  # its longest pod name: <job>-generator-1
    doc["spec"]["generator"]["replicas"] = 2
    doc["spec"]["scheduling"] = {"queueName": "team-a"}
    j = parse_job(doc).model_copy(update={"metadata": parse_job(doc).metadata.model_copy(update={"namespace": "ns"})})
    pods = [builders.pod(j, "u", role, i, 12) for role, i in builders.expected_pods(j)]
    label = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    hostnames = [p["spec"]["hostname"] for p in pods]
    assert all(len(h) <= 63 and label.match(h) for h in hostnames), hostnames
    assert len(set(hostnames)) == len(pods)  # the hash is of the whole name: generator-0 and -1 stay apart
    assert [p["metadata"]["name"].rsplit("-", 1)[0] for p in pods] == [
        f"{name}-trainer-0", f"{name}-generator-0", f"{name}-generator-1"]
    for p in pods:
        values = p["metadata"]["labels"].values()
        assert all(len(v) <= 63 and label.match(v) for v in values), p["metadata"]["labels"]
    service = builders.names(j, "u")["service"]
    assert len(service) <= 63 and label.match(service) and service == pods[0]["spec"]["subdomain"]
    assert builders.pod_host(j, "u", "trainer", 0) == f"{hostnames[0]}.{service}.ns.svc"
    assert builders.fit_label("short-name") == "short-name"  # names that fit are kept as they are


def test_a_colocated_job_runs_one_gang_of_pods_each_with_both_roles():
    j = job(placement="colocated", generator={"replicas": 2},
            trainer={"replicas": 2, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                     "volumes": [{"name": "data", "emptyDir": {}}],
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}]})
    assert builders.expected_pods(j) == [("worker", 0), ("worker", 1)]
    pod = builders.pod(j, "uid-1", "worker", 1, 0)
    assert pod["metadata"]["name"].startswith(f"{j.metadata.name}-worker-1-")
    (c,) = pod["spec"]["containers"]
    args = c["args"]
    assert args[0] == "colocated" and args[args.index("--pod-index") + 1] == "1"
    generators = args[args.index("--generators") + 1].split(",")
    assert [g.split(".")[0] for g in generators] == [f"http://{j.metadata.name}-worker-{i}" for i in range(2)]
    assert args[args.index("--master-addr") + 1].startswith(f"{j.metadata.name}-worker-0.")
    assert {p["name"] for p in c["ports"]} == {"metrics", "http"} and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {m["name"] for m in c["volumeMounts"]} >= {"run", "dshm", "data"} and env_of(c)["NCCL_DEBUG"] == "INFO"
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"run", "dshm", "data"}
    separate = job(generator={"replicas": 2})  # negative control: trainer and generator pods
    assert builders.expected_pods(separate) == [("trainer", 0), ("generator", 0), ("generator", 1)]
