"""What a job's pods write to their scratch folders (emptyDirs on the node's disk), in bytes: the folders' sizeLimits
and the pods' ephemeral-storage requests, so that the scheduler places a pod where its node has the room, and a pod
that writes far more than its job explains is evicted alone instead of filling the node's disk.

- work (builders.WORK_DIR): the tiny model that the init container builds (pat prepare): safetensors in float32,
  whatever model.dtype says (TINY_WEIGHT_BYTES per parameter of the preset's shape; a tokenizer trained on the
  dataset only shrinks the vocabulary), and its tokenizer. With model.path nothing is written there.
- run (checkpoint.path of trainer pods without checkpoint.volume): the checkpoint.keep checkpoints and the one being
  written (DCP: fp32 parameters and AdamW's two fp32 moments, CHECKPOINT_BYTES_PER_PARAM), and every iteration's
  rollouts (rollouts/iter-N.json: each sequence's token ids and log-probabilities as JSON, at most
  ROLLOUT_BYTES_PER_TOKEN per token of generator.maxSeq). Unknown with model.path: the operator never reads
  model files, so the folder gets no sizeLimit and adds nothing to the request.
- tmp (/tmp, the workers' HOME): the caches of torch.compile, Triton and vLLM; the pod template's tmpSize.
Each derived size gets MARGIN and FLOOR (metrics.jsonl, DCP's metadata, a tokenizer) and is rounded up to MiB.
"""

from __future__ import annotations

import math

from .api import PodTemplate, RLHFJobSpec
from .fit import MIB, PRESETS, tiny_shape

TINY_WEIGHT_BYTES = 4  # pat prepare writes float32 (engine/tiny.py: random_weights' dtype)
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 parameters, AdamW's exp_avg and exp_avg_sq
# A token in rollouts/iter-N.json: its id ("128255, ") and its log-probability as Python's repr writes a float
# ("-1.2345678901234567e-05, "); a prompt's tokens have ids only.
ROLLOUT_BYTES_PER_TOKEN = 40
ROLLOUT_BYTES_PER_SEQUENCE = 256  # a record's keys, id, policy version and reward
MARGIN = 1.25
FLOOR = 64 * MIB


def _rounded(nbytes: float) -> int:
    return math.ceil((nbytes * MARGIN + FLOOR) / MIB) * MIB


def _params(spec: RLHFJobSpec) -> int | None:
    tiny = spec.model.tiny
    return None if tiny is None or tiny.preset not in PRESETS else tiny_shape(tiny.preset, tiny.family).params


def work_bytes(spec: RLHFJobSpec) -> int:
    """The work folder: the tiny model, or nothing (FLOOR) with model.path."""
    return _rounded((_params(spec) or 0) * TINY_WEIGHT_BYTES)


def rollout_bytes(spec: RLHFJobSpec) -> int:
    """Every iteration's rollouts file, at most."""
    a = spec.algorithm
    sequences = a.iterations * a.prompts_per_iteration * a.samples_per_prompt
    return sequences * (spec.generator.max_seq * ROLLOUT_BYTES_PER_TOKEN + ROLLOUT_BYTES_PER_SEQUENCE)


def run_bytes(spec: RLHFJobSpec) -> int | None:
    """The run folder in an emptyDir (no checkpoint.volume): the checkpoints kept, the one being written and the
    rollouts; None where the model's size is unknown (model.path)."""
    params = _params(spec)
    if params is None:
        return None
    return _rounded((spec.checkpoint.keep + 1) * params * CHECKPOINT_BYTES_PER_PARAM + rollout_bytes(spec))


def user_sized(template: PodTemplate) -> bool:
    """Whether the user sized the pod's ephemeral storage (resources requests or limits): theirs wins."""
    return any("ephemeral-storage" in kind for kind in (template.resources.requests, template.resources.limits))
