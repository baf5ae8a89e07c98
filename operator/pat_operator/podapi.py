"""The generator pod's HTTP API (its coordinator): payload models shared by the trainer, the operator and the pod.

JSON field names are snake_case, as in OpenAI-style inference APIs. Every endpoint but /healthz, /readyz and
/metrics needs `Authorization: Bearer <token>`: the job's control token (the job Secret's key `token`) grants them
all; its inference token (key `inference-token`) only POST /v1/rollouts and GET /v1/rollouts/{batch}.

Every model ignores fields it does not know, so that an operator and a pod of different versions still read each
other's payloads (a field added later is ignored by the older side); the fields it knows are validated strictly.

  POST /v1/rollouts          RolloutBatch  -> 202 BatchStatus   (a batch is generated with one policy version)
  GET  /v1/rollouts/{batch}  ?wait=seconds -> BatchStatus       (completions once done; long-polls up to wait)
  POST /v1/regroup           RegroupPlan   -> RegroupAck        (applied at the next step boundary)
  POST /v1/weights           WeightUpdate  -> 202 PodState      (ranks then receive the broadcast, or the hand-over)
  POST /v1/sleep             ?level=1|2    -> PodState          (between batches: the ranks give back their KV
                                                                  pools and step memory, for the colocated trainer;
                                                                  level 2 their weights too, until POST /v1/weights)
  POST /v1/wake_up                         -> PodState          (the ranks take their memory back)
  GET  /v1/state                           -> PodState
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


SLEEP_LEVELS = (1, 2)  # POST /v1/sleep?level=: 1 keeps the weights, 2 releases them too (as vLLM's)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")  # version skew: see the module's docstring


class Sampling(_Model):
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class RolloutRequest(_Model):
    id: str = Field(min_length=1)
    prompt: str | None = Field(None, description="text, tokenized by the pod's tokenizer")
    prompt_token_ids: list[int] | None = None
    sampling: Sampling = Sampling()

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("set exactly one of prompt (text) or prompt_token_ids")
        return self


class RolloutBatch(_Model):
    batch_id: str = Field(min_length=1)
    policy_version: int = Field(ge=0, description="the pod must hold this version; 409 otherwise")
    requests: list[RolloutRequest] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> RolloutBatch:
        first: dict[str, int] = {}
        for i, r in enumerate(self.requests):
            if r.id in first:
                raise ValueError(f"requests.{i}.id: {r.id!r} repeats requests.{first[r.id]}.id; ids must be unique "
                                 f"within a batch")
            first[r.id] = i
        return self


class Completion(_Model):
    id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    policy_version: int
    text: str | None = None


class BatchStatus(_Model):
    batch_id: str
    done: bool
    total: int
    finished: int
    completions: list[Completion] = []  # all of them, once done


class RegroupPlan(_Model):
    epoch: int = Field(ge=1, description="strictly increasing per pod; a repeated epoch is acknowledged again")
    layout: list[int] = Field(min_length=1, description="TP group sizes in rank order, e.g. [2, 1, 1]")
    from_epoch: int | None = Field(None, ge=0, description="apply only while the pod is still at this epoch (the "
                                   "layout the plan was made for); 409 once it has moved on, e.g. to a new batch")


class RegroupAck(_Model):
    applied_epoch: int
    layout: list[int]
    outcome: Literal["applied", "unchanged", "fallback"]
    requests: dict[str, int] = Field({}, description="requests moved, per migration mode (kv | recompute)")
    seconds: float = Field(0.0, description="how long the regroup took (its slowest region)")
    error: str | None = Field(None, description="why it fell back, if it did")


class WeightUpdate(_Model):
    version: int = Field(ge=1)
    transport: Literal["group", "device"] = Field("group", description="group: a broadcast from the trainer's rank "
                                                  "0 over the job's weight-sync group; device: placement colocated, "
                                                  "each engine rank takes the weights from the trainer rank on its "
                                                  "own device (weightsync.DeviceSender)")
    address: str = Field(description="group: host:port of the weight-sync store that the trainer's rank 0 hosts (a "
                                     "pod started with --weights-store takes only that store: 403 otherwise); "
                                     "device: the name of the trainer ranks' hand-over sockets (the job's own)")
    world: int | None = Field(None, ge=2, description="group: trainer rank 0 plus every generator rank of the job")
    rank_offset: int | None = Field(None, ge=1, description="group: this pod's first rank in the weight-sync group")
    backend: Literal["gloo", "nccl"] = "gloo"

    @model_validator(mode="after")
    def _group_needs_ranks(self) -> WeightUpdate:
        if self.transport == "group" and (self.world is None or self.rank_offset is None):
            raise ValueError("transport group needs world and rank_offset")
        return self


class GroupState(_Model):
    ranks: list[int]
    tp: int
    running: int
    waiting: int


class PodState(_Model):
    ready: bool
    layout: list[int]
    epoch: int
    groups: list[GroupState]
    policy_version: int
    batch_id: str | None = None
    batch_done: bool = True
    controller: Literal["pod", "operator"]
    world: int = Field(description="engine ranks (one per GPU)")
    weight_receivers: int = Field(ge=1, description="members of the trainer's weight-sync group this pod joins: "
                                  "each engine rank (engine pat), or each worker of every vLLM engine (engine vllm)")
    engine: Literal["pat", "vllm"] = "pat"
    dtype: str
    memory: Literal["held", "released"] = Field("held", description="released after POST /v1/sleep: the ranks hold "
                                                "their weights at most, and take no batch until POST /v1/wake_up")
    weights: Literal["held", "released"] = Field("held", description="released after POST /v1/sleep?level=2: the "
                                                 "pod wakes up only once a weight update has written new ones")
    memory_bytes: list[int] = Field([], description="each rank's memory at its last sleep or wake-up: the process's "
                                    "resident bytes on CPU, torch.cuda.memory_reserved on a GPU")
