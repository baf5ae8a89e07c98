"""The RLHFJob API: pydantic models, the one source of truth for the spec (the CRD is generated from them).

Field names are camelCase on the wire (Kubernetes style) and snake_case in Python. Unknown fields are errors, so
that a typo is reported instead of silently ignored. `load_job` turns every validation error into one message
per field, with the field's path (`spec.algorithm.clipRatio`) and what to use instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

GROUP = "pat.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"


class JobSpecError(ValueError):
    """An invalid RLHFJob: the message names each bad field and the fix."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class TinyModel(_Model):
    """A random-weight model built locally from a seed (no model hub is needed)."""
    family: Literal["llama", "qwen2", "qwen3"] = "llama"
    preset: str = Field("demo", description="a preset of pat_workers.engine.tiny: test, demo, bench, llama-8b")
    seed: int = 0
    tokenizer: Literal["dataset", "bytes"] = Field(
        "dataset", description="dataset: a BPE tokenizer trained on the dataset's text; bytes: byte-level")


class ModelSource(_Model):
    path: str | None = Field(None, description="directory with config.json, *.safetensors and tokenizer.json")
    tiny: TinyModel | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path (a Hugging Face model directory) or model.tiny")
        return self


class SyntheticDataset(_Model):
    kind: Literal["arithmetic"] = "arithmetic"
    size: int = Field(512, ge=1)
    seed: int = 0
    max_operand: int = Field(9, ge=1, description="operands are drawn from 0..maxOperand")


class Dataset(_Model):
    path: str | None = Field(None, description="a .jsonl or .parquet file of problems")
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    prompt_field: str = "problem"
    answer_field: str = "answer"
    prompt_template: str = Field("{prompt}", description="how a problem becomes a prompt; {prompt} is replaced")
    synthetic: SyntheticDataset | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Dataset:
        if (self.path is None) == (self.synthetic is None):
            raise ValueError("set exactly one of dataset.path (a .jsonl/.parquet file) or dataset.synthetic")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("dataset.promptTemplate must contain {prompt}")
        return self


class Reward(_Model):
    function: str = Field("math", description="math (built in) or a plugin as module:function")
    format_score: float = Field(0.0, ge=0, le=1, description="math: reward of a well-formed but wrong answer")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's soft overlong punishment: a response longer than "
                                 "maxResponseTokens - overlongBuffer loses up to overlongPenalty, linearly; 0: off")
    overlong_penalty: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _known(self) -> Reward:
        if self.function != "math" and ":" not in self.function:
            raise ValueError(f"reward.function={self.function!r}: use math or a plugin as module:function")
        return self


class Algorithm(_Model):
    name: Literal["grpo"] = "grpo"
    iterations: int = Field(20, ge=1)
    prompts_per_iteration: int = Field(16, ge=1)
    samples_per_prompt: int = Field(8, ge=2, description="G: responses per prompt (advantages are per group)")
    max_response_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0, description="0 is greedy (every sample of a prompt is the same)")
    top_p: float = Field(1.0, gt=0, le=1)
    learning_rate: float = Field(1e-3, gt=0)
    clip_ratio: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the frozen reference policy; 0 turns it off")
    scale_advantages_by_std: bool = Field(True, description="false for Dr. GRPO")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="seq-mean-token-sum-norm for Dr. GRPO")
    mini_batches: int = Field(2, ge=1, description="optimizer steps per iteration (the clip ratio acts from the 2nd)")
    grad_clip: float = Field(1.0, gt=0)
    seed: int = 0


class Trainer(_Model):
    replicas: int = Field(1, ge=1, description="data-parallel trainer ranks (DDP)")


class Generator(_Model):
    replicas: int = Field(1, ge=1, description="generator pods")
    ranks_per_pod: int = Field(2, ge=1, description="engine ranks per pod: one per GPU (a CPU core here)")
    max_batch: int = Field(64, ge=1, description="sequences per TP=1 replica")
    max_seq: int = Field(512, ge=2, description="prompt + response tokens per sequence")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _power_of_two(self) -> Generator:
        n = self.ranks_per_pod
        if n & (n - 1):
            raise ValueError(f"generator.ranksPerPod={n}: use a power of two (TP groups are powers of two)")
        return self


class AdaptiveTP(_Model):
    enabled: bool = True
    controller: Literal["pod", "operator"] = Field(
        "pod", description="pod: each generator pod plans its own regroups; operator: it only obeys plans")
    margin: float = Field(0.1, ge=0, description="regroup only when the predicted gain exceeds the cost by this")
    cooldown_steps: int = Field(4, ge=0, description="decode steps after a regroup before the next one")
    migration: Literal["auto", "kv", "recompute"] = "auto"
    profile: str | None = Field(None, description="an offline T(tp, batch) profile (JSON); default: measured "
                                                  "by each pod at start")


class Checkpoint(_Model):
    every_iterations: int = Field(5, ge=1)
    keep: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")


class RunPolicy(_Model):
    backoff_limit: int = Field(3, ge=0, description="gang restarts before the job fails")


class RLHFJobSpec(_Model):
    model: ModelSource
    dataset: Dataset
    reward: Reward = Reward()
    algorithm: Algorithm = Algorithm()
    trainer: Trainer = Trainer()
    generator: Generator = Generator()
    adaptive_tp: AdaptiveTP = Field(AdaptiveTP(), alias="adaptiveTP")
    checkpoint: Checkpoint = Checkpoint()
    run_policy: RunPolicy = RunPolicy()

    @model_validator(mode="after")
    def _fits(self) -> RLHFJobSpec:
        responses = self.algorithm.prompts_per_iteration * self.algorithm.samples_per_prompt
        if responses < self.algorithm.mini_batches * self.trainer.replicas:
            raise ValueError(f"{responses} responses per iteration cannot give each of trainer.replicas="
                             f"{self.trainer.replicas} ranks a share of algorithm.miniBatches="
                             f"{self.algorithm.mini_batches} mini-batches; lower one of them")
        if self.reward.overlong_buffer >= self.algorithm.max_response_tokens:
            raise ValueError(f"reward.overlongBuffer={self.reward.overlong_buffer} must be below "
                             f"algorithm.maxResponseTokens={self.algorithm.max_response_tokens}")
        if self.algorithm.max_response_tokens >= self.generator.max_seq:
            raise ValueError(f"algorithm.maxResponseTokens={self.algorithm.max_response_tokens} leaves no room "
                             f"for the prompt in generator.maxSeq={self.generator.max_seq}; raise maxSeq")
        return self


class Metadata(_Model):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    namespace: str | None = None


class RLHFJob(_Model):
    api_version: Literal["pat.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["RLHFJob"] = KIND
    metadata: Metadata
    spec: RLHFJobSpec


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-after"))]
    return ".".join(parts) or "(document)"


def parse_job(doc: Any, source: str = "RLHFJob") -> RLHFJob:
    try:
        return RLHFJob.model_validate(doc)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
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
