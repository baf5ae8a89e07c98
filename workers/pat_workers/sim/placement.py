"""Placement (spec.placement) for `pat simulate`: at one GPU count, which pods generate, which GPUs train, and what a
colocated GPU's switch between the phases costs. Modelled, with the assumptions named below; nothing measured.

An iteration is synchronous: generation (the batch split over the generator pods, its time that of the pod given
the most prompts) then training. Separate: the generator pods generate while the trainer's GPUs wait, then the
trainer trains while the generator pods wait (the weight sync to them is not modelled, as before). Colocated: every
pod generates, then every GPU trains, then the weights pass to the engines in the pod (switch_seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_operator.api import RLHFJobSpec
from pat_operator.fit import GPU, ModelShape, colocated_equivalent, sharded_state_bytes, trainer_resident_bytes

from .hardware import BF16

# Assumed, per iteration: the engine releasing its KV cache and working memory for training (the tensors freed,
# torch.cuda.empty_cache) and taking them again before generating, with the handshake between the two processes of
# a GPU. cudaFree/cudaMalloc of tens of GiB take milliseconds; vLLM's sleep/wake_up of the KV cache a fraction of a
# second; no measurement of this engine yet.
MEMORY_SWITCH_SECONDS = 0.5
# Assumed: between nodes a GPU all-gathers over its own 400 Gb/s InfiniBand NIC (8 per node, as DGX H100/H200 have),
# at 80% of it.
NETWORK_BYTES_PER_S = 0.8 * 400e9 / 8
LINK_EFFICIENCY = 0.8  # of NVLink, within a node (as the GPU model assumes for KV moves)


@dataclass(frozen=True)
class Placement:
    """Where one iteration runs: `pods` generator pods of `gpus_per_pod` generate, then `trainer_gpus` train;
    colocated, the same GPUs do both, each keeping `resident_bytes` of trainer states while its engine generates."""
    name: str  # "separate" or "colocated"
    pods: int
    gpus_per_pod: int
    trainer_gpus: int
    resident_bytes: float = 0.0

    @property
    def colocated(self) -> bool:
        return self.name == "colocated"

    @property
    def gpus(self) -> int:
        return self.trainer_gpus if self.colocated else self.pods * self.gpus_per_pod + self.trainer_gpus

    def describe(self) -> str:
        pods = f"{self.pods} pod{'s' * (self.pods != 1)} x {self.gpus_per_pod} GPUs"
        if self.colocated:
            return f"colocated: {pods}, every GPU generating then training"
        return f"separate: {pods} generating, {self.trainer_gpus} trainer GPUs"


def handover_seconds(shape: ModelShape, gpu: GPU, placement: Placement) -> float:
    """Colocated, the trainer's weights to the engine on each GPU: every GPU gathers the whole bf16 model from the
    FSDP2 shards of all trainer ranks ((n - 1) / n of it, at NVLink's rate within one pod, the network's across
    pods), then copies it into the engine's weights (read and write at HBM bandwidth)."""
    n, nbytes = placement.trainer_gpus, shape.params * BF16
    link = NETWORK_BYTES_PER_S if placement.pods > 1 else LINK_EFFICIENCY * gpu.link_bytes_per_s
    return nbytes * (n - 1) / n / link + 2 * nbytes / gpu.hbm_bytes_per_s


def switch_seconds(shape: ModelShape, gpu: GPU, placement: Placement) -> float:
    """Per iteration, what colocated adds between the phases (0 separate): MEMORY_SWITCH_SECONDS and the hand-over."""
    return MEMORY_SWITCH_SECONDS + handover_seconds(shape, gpu, placement) if placement.colocated else 0.0


def preset_placements(world: int, trainer_gpus: int, shape: ModelShape) -> dict[str, Placement]:
    """A preset's setup (one generator pod of `world` GPUs, `trainer_gpus` beside) and the same GPUs colocated, in
    pods of `world`; the trainer keeps a reference policy (DeepScaleR's KL term)."""
    gpus = world + trainer_gpus
    return {"separate": Placement("separate", 1, world, trainer_gpus),
            "colocated": Placement("colocated", gpus // world, world, gpus,
                                   sharded_state_bytes(shape, gpus, reference=True))}


def job_placements(spec: RLHFJobSpec, shape: ModelShape) -> tuple[dict[str, Placement], dict[str, str]]:
    """The job's placement and the other one at the same GPU count (engine ranks count as GPUs on CPU), or why the
    other has none. A separate job colocated: all its GPUs in pods of the generator's shape. A colocated job
    separate: one of its pods trains, the others generate."""
    t, g = spec.trainer, spec.generator
    if spec.placement == "colocated":
        own = Placement("colocated", g.replicas, g.ranks, g.replicas * g.ranks, trainer_resident_bytes(spec, shape))
        if g.replicas < 2:
            return {"colocated": own}, {"separate": "one pod has no separate split of its GPUs (a trainer pod and a "
                                                    "generator pod take two)"}
        return {"colocated": own, "separate": Placement("separate", g.replicas - 1, g.ranks, g.ranks)}, {}
    own = Placement("separate", g.replicas, g.ranks, max(t.replicas * t.gpus_per_pod, 1))
    if own.gpus % g.ranks:
        return {"separate": own}, {"colocated": f"its {own.gpus} GPUs do not make whole pods of {g.ranks}"}
    pods = own.gpus // g.ranks
    colocated = colocated_equivalent(spec)
    resident = (trainer_resident_bytes(colocated, shape) if colocated is not None
                else sharded_state_bytes(shape, own.gpus, spec.algorithm.kl_coef > 0))  # CPU, or a spec it refuses
    return {"separate": own, "colocated": Placement("colocated", pods, g.ranks, own.gpus, resident)}, {}


def resized(lengths: tuple[int, ...], n: int) -> tuple[int, ...]:
    """A batch of n of these lengths: the first n, or all of them repeated."""
    return tuple(lengths[i % len(lengths)] for i in range(n))
