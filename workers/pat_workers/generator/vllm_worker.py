"""What a vLLM pod adds to vLLM's workers (`--worker-extension-cls`): each worker joins the trainer's weight-sync
group as a member of its own (torch's ProcessGroupGloo, or ProcessGroupNCCL on GPUs: pat_workers.weightsync) and
loads the buckets into its model as they arrive, through vLLM's in-place reload (which re-runs what vLLM does to
weights after loading, such as its CPU GEMM prepacking). No file is written, nothing is staged in host memory on
GPUs, and the trainer's image needs no vLLM.

This module runs inside vLLM's interpreter, which has torch and vLLM but not this project's other dependencies: it
imports only pat_workers.weightsync (torch alone). vLLM mixes the class into its worker class, refusing names the
worker already has, hence the `pat_` prefix.
"""

from __future__ import annotations

import torch

from ..weightsync import WeightReceiver


class WeightSyncExtension:
    def pat_receive_weights(self, address: str, world: int, rank_offset: int, version: int, backend: str,
                            dtype: str, shapes: dict[str, list[int]]) -> None:
        """One weight-sync round: this worker is member rank_offset + its rank in the engine (its TP rank), and
        `shapes` are the checkpoint's tensors (names and shapes as the trainer sends them). Called through
        collective_rpc on every worker of an engine at once, and on every engine of the pod at once (the group
        forms only when all its members join)."""
        rank = rank_offset + self.rank
        receiver = getattr(self, "_pat_receiver", None)
        if receiver is None or (receiver.world, receiver.rank, receiver.address, receiver.backend) != \
                (world, rank, address, backend):
            if receiver is not None:  # the trainer's group changed (a gang restart): leave the old one
                receiver.close()
            receiver = self._pat_receiver = WeightReceiver(address, world, rank, backend=backend)
        self.reload_weights(weights_iterator=receiver.stream(shapes, getattr(torch, dtype), version, self.device))
