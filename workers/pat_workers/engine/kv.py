"""A static KV cache: one [slots, local KV heads, max_seq, head_dim] tensor per layer for keys and values.

The running requests of a TP group occupy slots 0..n-1 in batch order, so the decode step attends over a view
(no gather). When a request leaves, the last one moves into its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass
class KVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelConfig, slots: int, kv_heads: int, max_seq: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> KVCache:
        # Zeroed: masked positions still enter the attention product, and garbage could hold NaNs.
        shape = (slots, kv_heads, max_seq, cfg.head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)])

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    def rows(self, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k[start:stop] for k in self.k], [v[start:stop] for v in self.v]

    def move(self, src: int, dst: int, length: int) -> None:
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]

    def heads(self, slot: int, heads: slice, length: int) -> list[torch.Tensor]:
        """Views of one request's keys and values for some heads, per layer (k0, v0, k1, v1, ...)."""
        return [cache[slot, heads, :length] for pair in zip(self.k, self.v) for cache in pair]
