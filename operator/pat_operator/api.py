"""The RLHFJob API: pydantic models, the one source of truth for the spec (the CRD is generated from them).

Field names are camelCase on the wire (Kubernetes style) and snake_case in Python. Unknown fields are errors, so
that a typo is reported instead of silently ignored. `load_job` turns every validation error into one message
per field, with the field's path (`spec.algorithm.clipRatio`) and what to use instead.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from difflib import get_close_matches
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, get_args

import yaml
from kubernetes.utils import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel

GROUP = "pat.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"


class JobSpecError(ValueError):
    """An invalid RLHFJob: the message names each bad field and the fix."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


# Kubernetes objects passed through to the pods as they are (the API server validates them there).
KubeObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
# Kubernetes' own quantity syntax (resource.Quantity): 2, 500m, 1.5, 8Gi, 1e3.
QUANTITY = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
            r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
Quantity = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY,
                                                "anyOf": [{"type": "integer"}, {"type": "string"}]})]
GPU_RESOURCE = "nvidia.com/gpu"
# The worker images (Dockerfile targets named like them): pat-worker for the trainer and engine pat's generator pods;
# pat-worker-vllm, with vLLM (which pins its own torch), for the generator pods of engine vllm.
WORKER_IMAGE = "ghcr.io/pat-rlhf/pat-worker:0.1.0"
VLLM_WORKER_IMAGE = "ghcr.io/pat-rlhf/pat-worker-vllm:0.1.0"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A job's name: its Service and its pods' subdomain are named after it, and a Service's name is a DNS-1035 label
# (a DNS label that starts with a letter: `3d-grpo` or `grpo.v2` would be refused there, after the job was accepted).
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = ("use a DNS label that starts with a letter (lowercase letters, digits and '-', at most 63 characters): "
             "the job's Service is named after it")


class TinyModel(_Model):
    """A random-weight model built locally from a seed (no model hub is needed)."""
    family: Literal["llama", "qwen2", "qwen3"] = Field("llama", description="the architecture")
    preset: str = Field("demo", description="a preset of pat_workers.engine.tiny: test, demo, demo-vllm (heads "
                        "vLLM's CPU kernels take), demo-wide (memory-bound decode steps), bench, llama-8b")
    seed: int = Field(0, description="the random seed of the weights (every pod builds the same model)")
    tokenizer: Literal["dataset", "bytes"] = Field(
        "dataset", description="dataset: a BPE tokenizer trained on the dataset's text; bytes: byte-level")


class ModelSource(_Model):
    """The policy model: a Hugging Face model directory (path) or a random-weight tiny model (tiny)."""
    path: str | None = Field(None, description="directory with config.json, *.safetensors and tokenizer.json "
                                               "(in the pods: on the volume, if one is given)")
    tiny: TinyModel | None = None
    volume: KubeObject | None = Field(None, description="a Kubernetes volume source mounted read-only at "
                                      "mountPath in every pod, e.g. {persistentVolumeClaim: {claimName: llama}}")
    mount_path: str = Field("/models", pattern=r"^/", description="where the volume is mounted (an absolute path)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the generators' weights")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path (a Hugging Face model directory) or model.tiny")
        return self


class SyntheticDataset(_Model):
    """A generated task: arithmetic problems (3+4=) and their answers."""
    kind: Literal["arithmetic"] = Field("arithmetic", description="the task")
    size: int = Field(512, ge=1, description="problems in the dataset")
    seed: int = Field(0, description="the random seed of the problems")
    max_operand: int = Field(9, ge=1, description="operands are drawn from 0..maxOperand")
    long_tail: float | None = Field(None, ge=0, le=1, description="set: every response is a drawn number of "
                                    "tokens (EOS ignored): maxResponseTokens with probability longTail, else at "
                                    "least 2 and more than x with probability 2 / x: most short, a few at the cap, "
                                    "as in reasoning RL, which a tiny model does not produce by itself; unset: a "
                                    "response ends at EOS")


class Dataset(_Model):
    """The prompts: a file of problems (path) or a generated task (synthetic)."""
    path: str | None = Field(None, description="a .jsonl or .parquet file of problems")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="auto: from the suffix of path")
    prompt_field: str = Field("problem", description="the field of a record that holds the problem: text, or a list "
                              "of chat messages {role, content} (verl: prompt); a.b is the field b of the object "
                              "or struct column a")
    answer_field: str = Field("answer", description="the field of a record that holds the reference answer; a.b as "
                              "in promptField (verl: reward_model.ground_truth)")
    prompt_template: str = Field("{prompt}", description="how a text problem becomes a prompt; {prompt} is replaced "
                                 "(before the chat template)")
    chat_template: bool | None = Field(None, description="render each prompt with the tokenizer's chat template (a "
                                       "text prompt as one user message), ready for the assistant's reply; false: "
                                       "the raw text; unset: on when the tokenizer has a chat template")
    length_field: str | None = Field(None, description="a field of a record giving the response length to generate "
                                     "for it, exactly (EOS ignored, at most maxResponseTokens), or a list of them, "
                                     "one per sample: replays recorded lengths, for benchmarks of long tails")
    synthetic: SyntheticDataset | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Dataset:
        if (self.path is None) == (self.synthetic is None):
            raise ValueError("set exactly one of dataset.path (a .jsonl/.parquet file) or dataset.synthetic")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("dataset.promptTemplate must contain {prompt}")
        suffix = PurePosixPath(self.path or "").suffix
        if self.path is not None and self.format == "auto" and suffix not in (".jsonl", ".parquet"):
            raise ValueError(f"dataset.path={self.path!r}: name it *.jsonl or *.parquet, or set dataset.format")
        return self


class Reward(_Model):
    """How a response is scored."""
    function: str = Field("math", description="math (built in) or a plugin as module:function")
    format_score: float = Field(0.0, ge=0, le=1, description="math: reward of a well-formed but wrong answer")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's soft overlong punishment: a response longer than "
                                 "maxResponseTokens - overlongBuffer loses up to overlongPenalty, linearly; 0: off")
    overlong_penalty: float = Field(1.0, ge=0, description="the most an overlong response loses (overlongBuffer)")
    timeout_seconds: float = Field(5.0, gt=0, description="the longest that scoring one response may take; past "
                                   "it (or when the function raises) the response scores 0, a counted failure")

    @model_validator(mode="after")
    def _known(self) -> Reward:
        if self.function != "math" and ":" not in self.function:
            raise ValueError(f"reward.function={self.function!r}: use math or a plugin as module:function")
        return self


class Algorithm(_Model):
    """The RL algorithm and its hyperparameters."""
    name: Literal["grpo"] = Field("grpo", description="GRPO: advantages relative to the other responses to a prompt")
    iterations: int = Field(20, ge=1, description="iterations of generate, score, train, sync the weights")
    prompts_per_iteration: int = Field(16, ge=1, description="prompts per iteration, each answered samplesPerPrompt "
                                                              "times")
    samples_per_prompt: int = Field(8, ge=2, description="G: responses per prompt (advantages are per group)")
    max_response_tokens: int = Field(64, ge=1, description="the longest response, in tokens")
    temperature: float = Field(1.0, ge=0, description="0 is greedy (every sample of a prompt is the same)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the probability mass sampled from; 1: off")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW's learning rate")
    clip_ratio: float = Field(0.2, gt=0, description="PPO's clip: the probability ratio is kept within 1 +- clipRatio")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the frozen reference policy; 0 turns it off")
    scale_advantages_by_std: bool = Field(True, description="false for Dr. GRPO")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="seq-mean-token-sum-norm for Dr. GRPO")
    mini_batches: int = Field(2, ge=1, description="optimizer steps per iteration (the clip ratio acts from the 2nd)")
    grad_clip: float = Field(1.0, gt=0, description="the gradients' global norm is clipped to this")
    max_tokens_per_micro_batch: int = Field(16384, ge=2, description="a mini-batch is split across the ranks and "
                                            "into micro-batches of at most this many tokens, balanced by tokens, "
                                            "each packed into one row without padding, accumulating gradients: one "
                                            "optimizer step either way; bounds activation memory. At least "
                                            "generator.maxSeq (one whole sequence)")
    old_logprobs: Literal["trainer", "engine"] = Field(
        "trainer", description="pi_old of the PPO ratio: trainer recomputes it with the policy's own forward before "
        "the iteration's first update (as verl does); engine takes the generators' sampled-token log-probabilities")
    rollout_correction: Literal["none", "tis"] = Field(
        "none", description="tis: truncated importance sampling for the gap between the engine and the trainer, "
        "each token's loss times min(pi_old / pi_engine, tisCap) (needs oldLogprobs: trainer)")
    tis_cap: float = Field(2.0, ge=1, description="tis: the largest importance weight")
    seed: int = Field(0, description="the random seed of sampling and shuffling")

    @model_validator(mode="after")
    def _correction(self) -> Algorithm:
        if self.rollout_correction == "tis" and self.old_logprobs == "engine":
            raise ValueError("algorithm.rolloutCorrection: tis weighs the trainer's pi_old against the engine's; "
                             "set algorithm.oldLogprobs: trainer (the default)")
        return self


class EnvVar(_Model):
    """An environment variable of the worker container."""
    name: str = Field(min_length=1, description="the variable")
    value: str | None = Field(None, description="its value")
    value_from: KubeObject | None = Field(None, description="a Kubernetes EnvVarSource (secretKeyRef, fieldRef, ...)")

    @model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self


class VolumeMount(_Model):
    """Where one of volumes is mounted in the worker container."""
    name: str = Field(min_length=1, description="the name of one of volumes")
    mount_path: str = Field(pattern=r"^/", description="absolute path in the container")
    read_only: bool = Field(False, description="mount it read-only")
    sub_path: str | None = Field(None, description="a path in the volume to mount instead of its root")


class Toleration(_Model):
    """A Kubernetes toleration of the pods."""
    key: str | None = Field(None, description="the taint's key; unset with operator Exists: every taint")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="unset: Equal")
    value: str | None = Field(None, description="the taint's value (operator Equal)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="the taint effect tolerated; unset: all")
    toleration_seconds: int | None = Field(None, description="NoExecute: how long the pod stays once tainted")

    @model_validator(mode="after")
    def _kubernetes_rules(self) -> Toleration:
        if not self.key and self.operator != "Exists":
            raise ValueError("tolerations: a toleration without a key matches every taint: set a key, or operator: "
                             "Exists")
        if self.operator == "Exists" and self.value:
            raise ValueError("tolerations: operator Exists takes no value; remove value or use operator: Equal")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerations: tolerationSeconds needs effect: NoExecute")
        return self


class Resources(_Model):
    """Resources of the worker container as Kubernetes quantities; GPUs are gpusPerPod."""
    requests: dict[str, Quantity] = Field({}, description="what the scheduler reserves, e.g. {cpu: 2, memory: 8Gi}")
    limits: dict[str, Quantity] = Field({}, description="the most the container may use, e.g. {memory: 8Gi}")

    @model_validator(mode="after")
    def _no_gpus(self) -> Resources:
        for kind in ("requests", "limits"):
            if GPU_RESOURCE in getattr(self, kind):
                raise ValueError(f"resources.{kind}: do not set {GPU_RESOURCE} here; use gpusPerPod")
            for name, value in getattr(self, kind).items():
                if isinstance(value, str) and not re.match(QUANTITY, value):
                    raise ValueError(f"resources.{kind}.{name}={value!r} is not a Kubernetes quantity; use e.g. 2, "
                                     f"500m, 8Gi")
        return self


class LocalObjectReference(_Model):
    """An object in the job's namespace."""
    name: str = Field(min_length=1, description="its name")


class PodTemplate(_Model):
    """What a user sets for one kind of pod (trainer or generator); the operator adds the rest."""
    replicas: int = Field(1, ge=1)
    gpus_per_pod: int = Field(1, ge=0, description=f"{GPU_RESOURCE} per pod (0: CPU only)")
    image: str = Field(WORKER_IMAGE, min_length=1, description="the worker image")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent",
                                                                          description="when the image is pulled")
    image_pull_secrets: list[LocalObjectReference] = Field([], description="Secrets for a private registry")
    command: list[str] | None = Field(None, min_length=1, description="replaces the pat worker command (custom "
                                                                      "images, debugging)")
    resources: Resources = Field(Resources(), description="CPU and memory of the worker container (GPUs: "
                                                          "gpusPerPod)")
    env: list[EnvVar] = Field([], description="environment variables of the worker container")
    volumes: list[KubeObject] = Field([], description="Kubernetes volumes (each with a name) for volumeMounts")
    volume_mounts: list[VolumeMount] = Field([], description="volumes mounted in the worker container")
    node_selector: dict[str, str] = Field({}, description="node labels the pods need")
    tolerations: list[Toleration] = Field([], description="taints the pods tolerate")
    affinity: KubeObject | None = Field(None, description="a Kubernetes Affinity of the pods")
    shm_size: Quantity = Field("1Gi", description="the size of /dev/shm, a memory-backed emptyDir (sizeLimit), "
                               "which the default 64 MiB would starve: NCCL's intra-node buffers and the ranks' "
                               "shared tensors (trainer), the engine ranks' shared-memory communicators on CPU "
                               "(generator: 16 MiB a rank for each TP size above 1, 384 MiB at 8 ranks). Its pages "
                               "count against the container's memory (resources.limits.memory, which also caps it), "
                               "not against ephemeral storage")
    tmp_size: Quantity = Field("4Gi", description="the sizeLimit of the pod's /tmp emptyDir (HOME: the caches of "
                               "torch.compile, Triton and vLLM), counted in the ephemeral-storage request the "
                               "operator adds with the other scratch folders' (the tiny model, the run folder "
                               "without checkpoint.volume); a resources entry ephemeral-storage replaces that "
                               "request and the scratch folders' sizeLimits")

    @model_validator(mode="after")
    def _sizes(self) -> PodTemplate:
        for name in ("shm_size", "tmp_size"):
            value = getattr(self, name)
            if isinstance(value, str) and not re.match(QUANTITY, value) or parse_quantity(value) <= 0:
                raise ValueError(f"{to_camel(name)}={value!r}: use a positive Kubernetes quantity, e.g. 1Gi")
        memory = self.resources.limits.get("memory")
        if "shm_size" in self.model_fields_set and memory is not None and \
                parse_quantity(self.shm_size) > parse_quantity(memory):
            raise ValueError(f"shmSize={self.shm_size} is more than resources.limits.memory={memory}: /dev/shm's "
                             f"pages count against the container's memory limit; lower shmSize or raise the limit")
        return self

    @model_validator(mode="after")
    def _mounts_have_volumes(self) -> PodTemplate:
        names = [v.get("name") for v in self.volumes]
        if any(not isinstance(n, str) or not n for n in names):
            raise ValueError("every entry of volumes needs a name")
        if len(set(names)) != len(names):
            raise ValueError(f"volumes: names must be unique ({names})")
        for m in self.volume_mounts:
            if m.name not in names:
                raise ValueError(f"volumeMounts: {m.name!r} is not one of volumes {names}; add it to volumes")
        return self


class Trainer(PodTemplate):
    """The trainer pods: ranksPerPod ranks each (one per GPU); the ranks of all pods train one FSDP2-sharded model."""
    replicas: int = Field(1, ge=1, description="trainer pods")
    ranks_per_pod: int | None = Field(None, ge=1, description="trainer ranks per pod; default gpusPerPod (one rank "
                                      "per GPU), or 1 on CPU (gpusPerPod: 0)")
    activation_checkpointing: bool | None = Field(None, description="recompute each transformer block's "
                                                  "activations in the backward pass instead of keeping them; "
                                                  "default: on with GPUs, off on CPU")
    cpu_offload: bool = Field(False, description="keep parameters, gradients and optimizer states in host memory "
                              "(FSDP2's CPUOffloadPolicy): fits larger models, trains slower")
    deterministic: bool | None = Field(None, description="torch's deterministic algorithms, for bitwise-reproducible "
                                       "training and resumes: slower kernels; on GPUs the flash-attention backward "
                                       "stays nondeterministic (torch only warns). Default: on on CPU, off with GPUs")

    @property
    def ranks(self) -> int:
        return self.ranks_per_pod or self.gpus_per_pod or 1

    @property
    def world_size(self) -> int:
        return self.replicas * self.ranks

    @property
    def checkpointing(self) -> bool:
        return self.gpus_per_pod > 0 if self.activation_checkpointing is None else self.activation_checkpointing

    @model_validator(mode="after")
    def _ranks(self) -> Trainer:
        if self.gpus_per_pod and self.ranks_per_pod not in (None, self.gpus_per_pod):
            raise ValueError(f"trainer.ranksPerPod={self.ranks_per_pod} must equal gpusPerPod={self.gpus_per_pod} "
                             f"(one rank per GPU), or be left out")
        return self


class Prometheus(_Model):
    """Where the operator reads the generator pods' metrics (controller operator)."""
    url: str | None = Field(None, pattern=r"^https?://", description="default: the operator's --prometheus-url")
    query_interval: float = Field(1.0, gt=0, description="seconds between queries")


class AdaptiveTP(_Model):
    """Adaptive tensor parallelism: in a batch's long tail the engine ranks of a pod regroup into larger TP groups."""
    enabled: bool | None = Field(None, description="false: every rank stays a TP=1 replica; default: true with "
                                 "engine pat, off with engine vllm (which regroups on CPU only)")
    controller: Literal["pod", "operator"] = Field(
        "pod", description="pod: each generator pod plans its own regroups; operator: the operator plans from "
                           "Prometheus metrics and the pod only obeys")
    # At most 16: the CRD's CEL rules over the list must fit the API server's cost budget.
    tp_sizes: list[int] | None = Field(None, min_length=1, max_length=16, description="TP sizes a group may take "
                                       "(powers of two dividing the ranks per pod); default: all of them")
    min_gain: float = Field(0.1, ge=0, description="regroup only when the predicted gain beats the regroup cost by "
                                                   "this fraction of the time left")
    cooldown_steps: int = Field(4, ge=0, description="controller pod: decode steps after a regroup before the next")
    cooldown_seconds: float = Field(2.0, ge=0, description="controller operator: seconds after a regroup before "
                                                           "the next plan")
    migration: Literal["auto", "kv", "recompute"] = Field("auto", description="how unfinished requests move: "
                                                          "auto picks per request from measured costs")
    profile: str | None = Field(None, description="an offline T(tp, batch, context) profile (JSON, as "
                                                  "Profile.to_json writes it) in the pod; default: measured by each "
                                                  "pod at start")
    prometheus: Prometheus = Field(Prometheus(), description="controller operator: where the metrics come from")


# `vllm serve` flags the vLLM generator pod sets itself, and what to do instead of passing one in
# generator.vllm.extraArgs (which refuses them as --flag and as --flag=value).
_TP = "set generator.vllm.tensorParallelSize"
_DP = ("the pod runs ranks / tensorParallelSize engines: set generator.gpusPerPod (or ranksPerPod) and "
       "generator.vllm.tensorParallelSize")
VLLM_MANAGED_FLAGS: dict[str, str] = {
    "--model": "set model.path (or model.tiny)", "--tokenizer": "set tokenizer.path",
    "--served-model-name": "the pod names the model itself; remove it",
    "--host": "the pod sets it; remove it", "--port": "the pod sets it (its API listens on generator.port)",
    "--uds": "the pod sets it; remove it", "--api-key": "the pod authenticates with the job's token; remove it",
    "--tensor-parallel-size": _TP, "-tp": _TP, "--data-parallel-size": _DP, "-dp": _DP,
    "--gpu-memory-utilization": "set generator.vllm.gpuMemoryUtilization",
    "--max-model-len": "set generator.vllm.maxModelLen", "--enforce-eager": "set generator.vllm.enforceEager",
    "--dtype": "set model.dtype"}


def _vllm_flag(arg: str) -> str:
    """The flag an extraArgs entry sets, as vLLM's parser reads it: -tp=2 -> -tp, --max_model_len -> --max-model-len,
    --no-enforce-eager -> --enforce-eager."""
    flag = arg.split("=", 1)[0]
    if flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-").removeprefix("no-")
    return flag


class VllmSettings(_Model):
    """engine vllm: the vLLM engines of a generator pod (`vllm serve` settings)."""
    tensor_parallel_size: int = Field(1, ge=1, description="TP of each vLLM engine; the pod runs ranks / "
                                      "tensorParallelSize data-parallel engines")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of each GPU's memory vLLM may "
                                          "use (vLLM's gpu_memory_utilization)")
    max_model_len: int | None = Field(None, ge=2, description="vLLM's max_model_len; default generator.maxSeq")
    enforce_eager: bool = Field(False, description="no CUDA graphs (vLLM's enforce_eager): less memory and a "
                                "faster start, slower decoding")
    extra_args: list[str] = Field([], description="further `vllm serve` flags, e.g. [\"--max-num-seqs=128\"]; "
                                  "not the ones the pod sets (model, host, port, TP, DP, memory, dtype: use "
                                  "the spec's fields)")

    @model_validator(mode="after")
    def _extra_args(self) -> VllmSettings:
        for arg in self.extra_args:
            flag = _vllm_flag(arg)
            if flag in VLLM_MANAGED_FLAGS:
                raise ValueError(f"generator.vllm.extraArgs: {arg!r} sets {flag}, which the generator pod manages; "
                                 f"{VLLM_MANAGED_FLAGS[flag]}")
            if not arg.startswith("--") or any(c.isspace() for c in flag):
                raise ValueError(f"generator.vllm.extraArgs: {arg!r}: each entry must start with -- and be one "
                                 f"whole flag, --flag or --flag=value (e.g. \"--max-num-seqs=128\")")
        return self


class Generator(PodTemplate):
    """The generator pods: each runs ranksPerPod engine ranks, which regroup into TP groups in place (engine pat), or
    ranks / vllm.tensorParallelSize vLLM engines (engine vllm)."""
    replicas: int = Field(1, ge=1, description="generator pods")
    engine: Literal["pat", "vllm"] = Field("pat", description="pat: this project's engine with adaptive TP; vllm: "
                                           "vLLM engines at a fixed TP (generator.vllm), or with adaptiveTP.enabled "
                                           "(CPU) one engine per group of every layout; set "
                                           f"generator.image to {VLLM_WORKER_IMAGE}")
    ranks_per_pod: int | None = Field(None, ge=1, description="engine ranks per pod; default gpusPerPod (one rank "
                                      "per GPU); set it for CPU pods (gpusPerPod: 0)")
    max_batch: int = Field(64, ge=1, description="engine pat: sequences per TP=1 replica at most (like vLLM's "
                           "max_num_seqs); the KV cache never holds more than maxBatch sequences of maxSeq tokens "
                           "per rank")
    max_seq: int = Field(512, ge=2, description="prompt + response tokens per sequence")
    memory_utilization: float = Field(0.9, gt=0, le=1, description="engine pat: fraction of each GPU's memory the "
                                      "engine may use: the weights, working memory, and the paged KV cache, which "
                                      "gets the rest (like vLLM's gpu_memory_utilization)")
    port: int = Field(8000, ge=1, le=65535, description="the coordinator's HTTP port")
    compile_step: bool = Field(False, description="engine pat: run the decode step through torch.compile (inductor "
                               "fuses the work around the GEMMs; on GPUs inside the CUDA graphs), after about 30 s of "
                               "compiling per rank and TP size at start. On CPUs the eager step, whose GEMMs run on "
                               "prepacked weights, is as fast or faster (a 2-core CPU: 32 vs 41 ms at 8 rows)")
    adaptive_tp: AdaptiveTP = Field(AdaptiveTP(), alias="adaptiveTP")
    tensor_parallel_size: int = Field(1, ge=1, description="engine pat with adaptiveTP.enabled: false: the pod's "
                                      "fixed layout, ranks / tensorParallelSize TP groups of this size for every "
                                      "batch (a power of two dividing the ranks per pod, among the TP sizes the "
                                      "model's heads allow); engine vllm: use vllm.tensorParallelSize")
    vllm: VllmSettings = Field(VllmSettings(), description="engine vllm: its settings")

    @property
    def ranks(self) -> int:
        return self.ranks_per_pod or self.gpus_per_pod

    @property
    def adaptive(self) -> bool:
        """Whether the pods regroup: adaptiveTP.enabled if set, else on with engine pat."""
        return self.adaptive_tp.enabled if self.adaptive_tp.enabled is not None else self.engine == "pat"

    @property
    def tp_sizes(self) -> list[int]:
        return self.adaptive_tp.tp_sizes or [t for t in _powers_of_two(self.ranks)]

    @property
    def start_layout(self) -> tuple[int, ...]:
        """engine pat: the layout every batch starts in, all TP=1 unless tensorParallelSize fixes larger groups."""
        return (self.tensor_parallel_size,) * (self.ranks // self.tensor_parallel_size)

    @model_validator(mode="after")
    def _ranks(self) -> Generator:
        n = self.ranks
        if n == 0:
            raise ValueError("generator.gpusPerPod=0 needs generator.ranksPerPod (engine ranks on CPU)")
        if self.gpus_per_pod and self.ranks_per_pod not in (None, self.gpus_per_pod):
            raise ValueError(f"generator.ranksPerPod={self.ranks_per_pod} must equal gpusPerPod="
                             f"{self.gpus_per_pod} (one engine rank per GPU), or be left out")
        if n & (n - 1):
            name = "ranksPerPod" if self.ranks_per_pod else "gpusPerPod"
            raise ValueError(f"generator.{name}={n}: use a power of two (TP groups are powers of two)")
        for t in self.adaptive_tp.tp_sizes or ():
            if t < 1 or t & (t - 1) or n % t:
                raise ValueError(f"generator.adaptiveTP.tpSizes: {t} is not a power of two dividing the {n} "
                                 f"ranks per pod; use some of {_powers_of_two(n)}")
        if self.adaptive_tp.tp_sizes and 1 not in self.adaptive_tp.tp_sizes:
            raise ValueError("generator.adaptiveTP.tpSizes must include 1: every rollout batch starts at TP=1")
        fixed = self.tensor_parallel_size
        if fixed & (fixed - 1) or n % fixed:
            raise ValueError(f"generator.tensorParallelSize={fixed} is not a power of two dividing the {n} ranks per "
                             f"pod; use one of {_powers_of_two(n)}")
        if fixed > 1 and self.engine == "vllm":
            raise ValueError(f"generator.tensorParallelSize={fixed} is engine pat's fixed layout; engine vllm: set "
                             f"generator.vllm.tensorParallelSize instead")
        if fixed > 1 and self.adaptive:
            raise ValueError(f"generator.tensorParallelSize={fixed} fixes the layout, and adaptive TP regroups it "
                             f"(every batch starts at TP=1): set generator.adaptiveTP.enabled: false for a fixed "
                             f"layout, or leave tensorParallelSize at 1")
        if self.compile_step and self.engine == "vllm":
            raise ValueError("generator.compileStep is engine pat's; vLLM compiles its own step "
                             "(generator.vllm.enforceEager: false, its default)")
        tp = self.vllm.tensor_parallel_size
        if n % tp:
            raise ValueError(f"generator.vllm.tensorParallelSize={tp} does not divide the {n} ranks per pod; use one "
                             f"of {[t for t in range(1, n + 1) if n % t == 0]}")
        if self.vllm.max_model_len is not None and self.vllm.max_model_len < self.max_seq:
            raise ValueError(f"generator.vllm.maxModelLen={self.vllm.max_model_len} is below generator.maxSeq="
                             f"{self.max_seq}: vLLM would refuse the longest sequences; raise it to at least "
                             f"{self.max_seq} or leave it out (default: maxSeq)")
        if self.engine == "vllm" and self.adaptive_tp.enabled:
            # A running vLLM engine's TP is fixed: the pod runs one engine per group of each layout and moves
            # requests between them, as its planner (or the operator's) says.
            if self.gpus_per_pod:
                raise ValueError("generator.adaptiveTP.enabled with engine vllm runs on CPU only (gpusPerPod: 0): on "
                                 "GPUs the engines of every layout share a GPU, and handing the weights on between "
                                 "them (CUDA IPC) is not built; set adaptiveTP.enabled: false or use engine pat")
            if self.vllm.tensor_parallel_size != 1:
                raise ValueError(f"generator.vllm.tensorParallelSize={self.vllm.tensor_parallel_size} with adaptive "
                                 f"TP: the pod's base layout is all TP=1 engines (adaptiveTP.tpSizes sets the sizes "
                                 f"its planner may use); leave tensorParallelSize at 1, or set adaptiveTP.enabled: "
                                 f"false")
        return self


def _powers_of_two(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]


class Checkpoint(_Model):
    """The trainer's checkpoints and run folder."""
    every_iterations: int = Field(5, ge=1, description="a checkpoint every this many iterations, and after the last")
    keep: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")
    path: str = Field("/var/lib/pat/run", pattern=r"^/", description="run folder in the trainer pods: "
                      "checkpoints, metrics.jsonl, rollouts")
    volume: KubeObject | None = Field(None, description="a Kubernetes volume source mounted at path, e.g. "
                                      "{persistentVolumeClaim: {claimName: ckpt}}; without one a restarted gang "
                                      "starts from the beginning")


class Scheduling(_Model):
    """How the pods are scheduled."""
    gang: bool = Field(True, description="schedule all pods of an attempt together, through gangScheduler")
    gang_scheduler: Literal["kueue", "volcano", "coscheduling"] | None = Field(
        None, description="what places the gang as one: kueue (the pods join one Kueue pod group; needs queueName), "
        "volcano (a Volcano PodGroup, scheduling.volcano.sh, minMember all pods; schedulerName defaults to volcano), "
        "coscheduling (scheduler-plugins' PodGroup, scheduling.x-k8s.io, minMember all pods, scheduleTimeoutSeconds "
        "runPolicy.schedulingTimeoutSeconds; set schedulerName to the scheduler that runs the plugin, e.g. "
        "scheduler-plugins-scheduler). Default: kueue where queueName is set and volcano where schedulerName is "
        "volcano (both where both are), else none: the scheduler places the pods one at a time")
    queue_name: str | None = Field(None, pattern=DNS_LABEL, description="the queue: Kueue's LocalQueue (the pods "
                                   "join one pod group), or with gangScheduler volcano the PodGroup's Volcano queue")
    scheduler_name: str | None = Field(None, min_length=1, description="the pods' schedulerName, e.g. volcano: a "
                                       "PodGroup with minMember = all pods is created with the job")
    priority_class_name: str | None = Field(None, min_length=1, description="the pods' PriorityClass")

    @model_validator(mode="after")
    def _one_gang_scheduler(self) -> Scheduling:
        chosen = self.gang_scheduler
        if chosen and not self.gang:
            raise ValueError(f"scheduling.gangScheduler={chosen} places the pods as a gang, and scheduling.gang is "
                             f"false: set gang: true, or leave gangScheduler out")
        if chosen == "kueue" and not self.queue_name:
            raise ValueError("scheduling.gangScheduler=kueue needs scheduling.queueName (the Kueue LocalQueue)")
        if chosen == "coscheduling" and self.queue_name:
            raise ValueError(f"scheduling.queueName={self.queue_name} is a Kueue or Volcano queue, and "
                             f"gangScheduler=coscheduling has none: leave queueName out, or use gangScheduler kueue")
        if chosen == "coscheduling" and self.scheduler_name == "volcano":
            raise ValueError("scheduling.schedulerName=volcano ignores scheduler-plugins' PodGroup: use gangScheduler "
                             "volcano, or the scheduler that runs the coscheduling plugin")
        return self

    @property
    def gang_schedulers(self) -> frozenset[str]:
        """The gang schedulers in use: gangScheduler, else those queueName and schedulerName imply."""
        if not self.gang:
            return frozenset()
        if self.gang_scheduler:
            return frozenset({self.gang_scheduler})
        implied = (("kueue", self.queue_name is not None), ("volcano", self.scheduler_name == "volcano"))
        return frozenset(name for name, used in implied if used)

    @property
    def pod_scheduler_name(self) -> str | None:
        """The pods' schedulerName: schedulerName, or volcano for gangScheduler volcano."""
        return self.scheduler_name or ("volcano" if self.gang_scheduler == "volcano" else None)


CONFIG_EXIT_CODE = 2  # the workers' exit code for a configuration error: retrying cannot help


class ExitCodes(_Model):
    """Exit codes of a failed pod's containers, as a Kubernetes Job's podFailurePolicy matches them."""
    container_name: str | None = Field(None, description="only this container's exit code; default: any container")
    operator: Literal["In", "NotIn"] = Field("In", description="In: one of the exit codes is in values; NotIn: one "
                                                               "is not")
    values: list[int] = Field(min_length=1, description="exit codes (0 never matches: it is not a failure)")


class PodConditionPattern(_Model):
    type: str = Field(min_length=1, description="a pod condition type, e.g. DisruptionTarget")
    status: Literal["True", "False", "Unknown"] = Field("True", description="the condition's status")


class PodFailureRule(_Model):
    """What a pod failure does to the job, as a Kubernetes Job's podFailurePolicy rule: FailJob fails it at once,
    Ignore restarts without using backoffLimit, Count restarts and counts against backoffLimit."""
    action: Literal["FailJob", "Ignore", "Count"] = Field(description="FailJob: the job fails at once; Ignore: "
                                                          "restart, not counted; Count: restart, counted")
    on_exit_codes: ExitCodes | None = Field(None, description="matches a failed pod's containers' exit codes")
    on_pod_conditions: list[PodConditionPattern] = Field([], description="matches a failed pod with any of these "
                                                                         "conditions")

    @model_validator(mode="after")
    def _one_match(self) -> PodFailureRule:
        if (self.on_exit_codes is None) == (not self.on_pod_conditions):
            raise ValueError("set exactly one of onExitCodes or onPodConditions")
        return self


class PodFailurePolicy(_Model):
    """Rules tried in order before the built-in ones; the first that matches a failed pod decides. Built in, after
    the user's: a DisruptionTarget condition (preemption, eviction, a drain, a lost node) Ignore; exit code 2 (the
    workers' configuration error) FailJob. A failure no rule matches Counts."""
    rules: list[PodFailureRule] = Field([], description="tried in order; the first that matches decides")


class RunPolicy(_Model):
    """Restarts, deadlines and suspension: the one part of spec that may change while the job exists."""
    backoff_limit: int = Field(3, ge=0, description="restarts for pod failures (not disruptions, which do not "
                                                    "count) before the job fails")
    pod_failure_policy: PodFailurePolicy = PodFailurePolicy()
    scheduling_timeout_seconds: int | None = Field(
        None, ge=1, description="a gang not fully scheduled this long after its pods were created releases them "
                                "and tries again later (with backoff): without a gang scheduler, two jobs placed "
                                "half each would wait for each other forever")
    active_deadline_seconds: int | None = Field(None, ge=1, description="the job fails once it has run this long")
    ttl_seconds_after_finished: int | None = Field(None, ge=0, description="the finished job (and so its pods) "
                                                   "is deleted this long after it succeeded or failed")
    suspend: bool = Field(False, description="true deletes the pods and keeps the status; false again resumes "
                                             "from the last checkpoint")
    pod_deletion_timeout_seconds: int = Field(
        180, ge=1, description="a pod still Terminating this long after its grace period (its node is lost, so "
                               "no kubelet confirms the deletion) is force-deleted, so the next attempt can start")


class Tokenizer(_Model):
    """The tokenizer, if not the model's own."""
    path: str | None = Field(None, description="directory with tokenizer.json; default: the model's own")


# Pod settings that a colocated pod takes from generator: a trainer value that differs cannot be honoured.
COLOCATED_POD_FIELDS = ("replicas", "gpus_per_pod", "image", "image_pull_policy", "image_pull_secrets", "command",
                        "resources", "node_selector", "tolerations", "affinity", "shm_size", "tmp_size")
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # GPU feature discovery's node label


class RLHFJobSpec(_Model):
    """What the job trains, on which prompts, and how its pods run; only runPolicy may change once it exists."""
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: one gang of pods (generator.replicas, each generator.gpusPerPod GPUs), "
        "every GPU hosting a trainer rank and an engine rank that take turns: all GPUs generate, then all train, as "
        "verl's hybrid engine does; the pods take their settings from generator, the trainer's env and volumes are "
        "added. separate: trainer pods and generator pods, each idle while the other works; for scaling the roles "
        "independently or on different GPU types")
    model: ModelSource
    tokenizer: Tokenizer = Tokenizer()
    dataset: Dataset
    reward: Reward = Reward()
    algorithm: Algorithm = Algorithm()
    trainer: Trainer = Trainer()
    generator: Generator = Generator()
    checkpoint: Checkpoint = Checkpoint()
    scheduling: Scheduling = Scheduling()
    run_policy: RunPolicy = RunPolicy()

    @model_validator(mode="wrap")
    @classmethod
    def _placed(cls, data: Any, handler) -> RLHFJobSpec:
        """Colocated: the trainer runs on the generator pods' GPUs, so its pod shape is theirs (filled in where left
        out, refused where it differs)."""
        spec = handler(data)
        if spec.placement == "separate":
            return spec.checked()
        t, g = spec.trainer, spec.generator
        if g.engine == "vllm" and not g.gpus_per_pod:
            raise ValueError("spec.placement: colocated runs vLLM with its sleep mode, which needs CUDA: on CPU "
                             "(generator.gpusPerPod: 0) set spec.placement: separate")
        if g.engine == "vllm":
            raise ValueError("spec.placement: colocated with generator.engine: vllm needs vLLM's sleep mode and a "
                             "weight hand-over into its workers through the device, which this version does not "
                             "have yet (docs/placement.md): set spec.placement: separate")
        theirs, ours = t.node_selector.get(GPU_PRODUCT_LABEL), g.node_selector.get(GPU_PRODUCT_LABEL)
        if "node_selector" in t.model_fields_set and theirs != ours:
            raise ValueError(f"spec.placement: colocated puts both roles on the same GPUs, so they cannot select "
                             f"different GPU types (trainer.nodeSelector {GPU_PRODUCT_LABEL}={theirs!r}, generator's "
                             f"{ours!r}): use spec.placement: separate, or leave trainer.nodeSelector out")
        for name in COLOCATED_POD_FIELDS:
            if name in t.model_fields_set and getattr(t, name) != getattr(g, name):
                field = to_camel(name)
                raise ValueError(f"spec.placement: colocated runs both roles in the generator pods: trainer.{field}="
                                 f"{_show(getattr(t, name))} differs from generator.{field}={_show(getattr(g, name))}; "
                                 f"leave trainer.{field} out (or use spec.placement: separate)")
        if "ranks_per_pod" in t.model_fields_set and t.ranks != g.ranks:
            raise ValueError(f"spec.placement: colocated runs a trainer rank beside each of the {g.ranks} engine "
                             f"ranks per pod: trainer.ranksPerPod={t.ranks_per_pod} differs; leave it out")
        # All of them, so that the spec written out (the pods' ConfigMap) reads back the same.
        trainer = t.model_copy(update={**{name: getattr(g, name) for name in COLOCATED_POD_FIELDS},
                                       "ranks_per_pod": None if g.gpus_per_pod else g.ranks})
        return spec.model_copy(update={"trainer": trainer}).checked()

    def checked(self) -> RLHFJobSpec:
        """Checks across sections, on the trainer as it runs (colocated: the generator pods' shape)."""
        responses = self.algorithm.prompts_per_iteration * self.algorithm.samples_per_prompt
        world = self.trainer.world_size
        if responses < self.algorithm.mini_batches * world:
            raise ValueError(f"{responses} responses per iteration cannot give each of the {world} trainer ranks "
                             f"(trainer.replicas x ranks per pod) a sequence in each of algorithm.miniBatches="
                             f"{self.algorithm.mini_batches} mini-batches; raise algorithm.promptsPerIteration or "
                             f"lower one of them")
        if self.algorithm.max_tokens_per_micro_batch < self.generator.max_seq:
            raise ValueError(f"algorithm.maxTokensPerMicroBatch={self.algorithm.max_tokens_per_micro_batch} is below "
                             f"one whole sequence (prompt + response, up to generator.maxSeq="
                             f"{self.generator.max_seq}); raise it to at least {self.generator.max_seq}")
        if self.reward.overlong_buffer >= self.algorithm.max_response_tokens:
            raise ValueError(f"reward.overlongBuffer={self.reward.overlong_buffer} must be below "
                             f"algorithm.maxResponseTokens={self.algorithm.max_response_tokens}")
        if self.algorithm.max_response_tokens >= self.generator.max_seq:
            raise ValueError(f"algorithm.maxResponseTokens={self.algorithm.max_response_tokens} leaves no room "
                             f"for the prompt in generator.maxSeq={self.generator.max_seq}; raise maxSeq")
        return self


def _show(value: Any) -> str:
    return repr(value.model_dump(by_alias=True) if isinstance(value, BaseModel) else value)


class Metadata(_Model):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    namespace: str | None = None

    @field_validator("name")
    @classmethod
    def _dns_1035_label(cls, name: str) -> str:
        if len(name) > 63 or not re.match(DNS_1035_LABEL, name):
            raise ValueError(f"{name!r}: {NAME_RULE}")
        return name


class RLHFJob(_Model):
    """An RLHF training job: trainer and generator pods, run as one gang, with adaptive tensor parallelism."""
    api_version: Literal["pat.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["RLHFJob"] = KIND
    metadata: Metadata
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None


# What to do about a field that privileged_fields names.
PRIVILEGE_FIX = ("remove it (a persistentVolumeClaim or an emptyDir reads and writes files without the node's), or "
                 "allow it: pat validate --allow-privileged-pods; the operator's flags --allow-privileged-pods (the "
                 "chart value jobPods.allowPrivileged: true) or --allow-host-path PREFIX for paths under PREFIX")


def privileged_fields(spec: RLHFJobSpec, allowed_host_paths: Sequence[str] = ()) -> list[str]:
    """The fields of a job that give its pods access to their node, as Pod Security's baseline level forbids: hostPath
    volumes, in trainer and generator volumes, model.volume and checkpoint.volume (spec.generator.volumes[0].hostPath).
    The rest of what baseline forbids (privileged containers, allowPrivilegeEscalation, added capabilities,
    hostNetwork, hostPID, hostIPC, hostPorts) a job cannot set: the models have no such field and refuse unknown
    ones, and the builders set the pods' securityContext themselves. A key is matched in any case: an API server
    before 1.23 decoded JSON keys case-insensitively, so it read HostPath as hostPath. A hostPath under one of
    `allowed_host_paths` (absolute directories, e.g. a node's dataset disk) is allowed."""
    volumes = [(f"spec.{role}.volumes[{i}]", v) for role in ("trainer", "generator")
               for i, v in enumerate(getattr(spec, role).volumes)]
    volumes += [(f"spec.{name}.volume", getattr(spec, name).volume) for name in ("model", "checkpoint")]
    return [f"{path}.{key}" for path, volume in volumes for key in volume or {} if key.lower() == "hostpath"
            and not _under(volume[key], allowed_host_paths)]


def _under(host_path: Any, prefixes: Sequence[str]) -> bool:
    path = host_path.get("path") if isinstance(host_path, dict) else None
    if not isinstance(path, str) or not path.startswith("/"):
        return False
    path = posixpath.normpath(path)  # no way out of a prefix through ".."
    return any(posixpath.commonpath([path, prefix]) == posixpath.normpath(prefix) for prefix in prefixes)


def require_unprivileged(spec: RLHFJobSpec, source: str = "RLHFJob", allowed_host_paths: Sequence[str] = ()) -> None:
    """JobSpecError naming each of privileged_fields and the fix, as parse_job writes its errors."""
    if fields := privileged_fields(spec, allowed_host_paths):
        raise JobSpecError(f"{source} is invalid:\n" + "\n".join(
            f"  {field}: a hostPath volume gives the pods their node's files; {PRIVILEGE_FIX}" for field in fields))


PHASES = ("Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


class _Status(_Model):
    # Written by the operator; a status written by another version is read, not rejected.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class Condition(_Status):
    """A standard Kubernetes condition. The conditions are the one source of truth of a job's state."""
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="CamelCase, for machines")
    message: str = Field("", description="for people")
    last_transition_time: str = Field(description="RFC 3339, when status last changed")
    observed_generation: int | None = Field(None, description="the spec generation this was computed from")


class GeneratorPodStatus(_Status):
    pod: str
    layout: list[int] = Field([], description="TP group sizes in rank order, e.g. [2, 1, 1]")
    desired_epoch: int = Field(0, description="epoch of the last plan sent to the pod")
    applied_epoch: int = Field(0, description="epoch the pod acknowledged")
    last_regroup_time: str | None = None
    regroups: int = 0
    running: int | None = Field(None, description="requests running in the pod, from Prometheus: "
                                "pat_generator_requests_running or vLLM's vllm:num_requests_running")
    waiting: int | None = Field(None, description="requests waiting in the pod, from Prometheus: "
                                "pat_generator_requests_waiting or vLLM's vllm:num_requests_waiting")


class ForceDeleted(_Status):
    pod: str
    message: str = Field(description="the PodForceDeleted event's message, posted once the pod is gone")
    held: bool = Field(False, description="a finalizer still held the pod after the force delete (reported once)")


class RLHFJobStatus(_Status):
    """What the operator observed; written only by the operator."""
    phase: Literal[PHASES] = Field("Pending", description="derived from the conditions")  # type: ignore[valid-type]
    conditions: list[Condition] = []
    observed_generation: int | None = None
    iteration: int = Field(0, description="iterations the trainer has completed")
    restarts: int = Field(0, description="restarts counted against runPolicy.backoffLimit")
    disruptions: int = Field(0, description="restarts for disruptions (a DisruptionTarget condition or a "
                                            "podFailurePolicy Ignore rule): not counted against backoffLimit")
    scheduling_timeouts: int = Field(0, description="gangs released for runPolicy.schedulingTimeoutSeconds")
    attempt: int | None = Field(None, description="the gang's attempt (its pods' names and pat.dev/attempt "
                                                  "label); default: restarts, as before disruptions were counted")
    attempt_time: str | None = Field(None, description="when the current attempt's pods were created")
    next_attempt_time: str | None = Field(None, description="no pod of the next attempt is created before this")
    incarnations: dict[str, int] = Field({}, description="generator pods restarted alone in this attempt, by "
                                                         "role-index: how many times")
    force_deleted: list[ForceDeleted] = Field([], description="pods force-deleted and not yet gone")
    pods: list[str] = Field([], description="the current attempt's pods the operator has seen: one of them gone is "
                                            "a failure")
    start_time: str | None = None
    completion_time: str | None = None
    tp: str = Field("", description="the generator pods' TP layouts, e.g. 2+1+1 4")
    generators: list[GeneratorPodStatus] = []
    spec_hash: str | None = Field(None, description="hash of the spec as written (all but runPolicy, which may "
                                  "change; defaults left out, so that an operator upgrade keeps running jobs)")
    placement: Literal["colocated", "separate"] | None = Field(None, description="the placement the job started "
                                                               "with: a job that leaves spec.placement out keeps it")


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-after"))]
    return ".".join(parts) or "(document)"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in get_args(annotation) if (m := _model_in(a)) is not None), None)


def _unknown_field(loc: tuple[Any, ...]) -> str:
    """The message for an unknown field at loc: the closest known field of the model it is in, or all of them."""
    model: type[BaseModel] | None = RLHFJob
    for part in loc[:-1]:
        fields = {f.alias or n: f for n, f in model.model_fields.items()} if model else {}
        if part in fields:
            model = _model_in(fields[part].annotation)
    known = sorted(f.alias or n for n, f in model.model_fields.items()) if model else []
    if close := get_close_matches(str(loc[-1]), known, n=1):
        return f"unknown field; did you mean {close[0]}?"
    return f"unknown field; use one of {', '.join(known)}" if known else "unknown field; remove it"


# What a pattern asks for: pydantic's message shows only the regular expression.
_PATTERN_HINTS = {DNS_LABEL: "use a DNS label (lowercase letters, digits and '-', a letter or digit at both ends)",
                  r"^/": "use an absolute path (starting with /)",
                  r"^https?://": "use a URL starting with http:// or https://"}


def parse_job(doc: Any, source: str = "RLHFJob") -> RLHFJob:
    try:
        return RLHFJob.model_validate(doc)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = _unknown_field(err["loc"])
            elif err["type"] == "string_pattern_mismatch" and err["ctx"]["pattern"] in _PATTERN_HINTS:
                msg = f"{err['input']!r}: {_PATTERN_HINTS[err['ctx']['pattern']]}"
            lines.append(f"  {_field_path(err['loc'])}: {msg}")
        raise JobSpecError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def load_job(path: str | Path) -> RLHFJob:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise JobSpecError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise JobSpecError(f"{path} is not valid YAML: {e}") from None
    return parse_job(doc, str(path))
