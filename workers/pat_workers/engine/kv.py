"""A paged KV cache: fixed-size blocks of tokens in one pool per rank, and a block table per request.

A block holds `block_size` tokens of `heads_per_block` KV heads: the model's KV heads divided by the largest TP size
the pod can take. A request at TP=t keeps, on each rank of its group, g = heads_per_rank / heads_per_block blocks
per `block_size` tokens; its table on that rank is g lists of block ids, one per head group it holds. A regroup
therefore moves whole blocks by heads: what a rank keeps stays where it is, only what changes rank is copied, and
no second cache is allocated.

Block 0 is scratch: padding rows and the padded positions of a batched prefill write there, and nothing reads it
unmasked. The pool is zeroed at start, since masked positions still enter the attention product (0 x NaN = NaN).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


class KVFull(RuntimeError):
    """Fewer free blocks than asked for; the engine preempts a request and asks again."""


class PagedKV:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, heads_per_block: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", mask_rows: int = 0):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs 2 or more blocks (one is scratch), got {num_blocks}")
        self.block_size, self.heads_per_block = block_size, heads_per_block
        # Head-major, so that a layer's keys are one [heads, slots, head_dim] tensor that attention reads in place.
        self.shape = (cfg.num_layers, 2, heads_per_block, num_blocks, block_size, cfg.head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.mask_rows = mask_rows  # rows (requests x head groups) of a decode step's block mask kept allocated
        self.data = torch.empty(0)
        self.acquire_memory()

    @property
    def memory_held(self) -> bool:
        """Whether the pool's memory is allocated (see release_memory)."""
        return self.data.numel() > 0

    def acquire_memory(self) -> None:
        """Allocates the pool (zeroed: masked positions still enter attention products, and 0 x NaN = NaN), every
        block free."""
        if not self.memory_held:
            self.data = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self._mask = torch.zeros(2, self.mask_rows, 1, 1, self.num_blocks, dtype=torch.int32, device=self.device)
        self.reset()

    def release_memory(self) -> None:
        """Gives the pool's memory back (between batches, so that another role can use the device): the caller holds
        no request in it. `acquire_memory` takes it again."""
        if any(self.refs[1:]):
            raise RuntimeError(f"{sum(r > 0 for r in self.refs[1:])} KV block(s) are in use: release the pool "
                               f"between batches")
        # Views of the pool can outlive it (compiled attention's first call leaves some in reference cycles until a
        # garbage collection): resized to nothing, its storage is freed whoever holds one.
        self.data.untyped_storage().resize_(0)
        self.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self._mask = None

    def mask_indices(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two int32 [rows, 1, 1, max(num_blocks, width)] tensors for a decode step's block mask (model.decode_mask):
        views of buffers kept with the pool, so that a step neither allocates nor clears them (the kernel reads only
        each row's first entries, which the step writes) and a captured graph keeps their address; fresh ones beyond
        mask_rows rows, or for a table wider than the pool (a profile's)."""
        if rows <= self.mask_rows and width <= self.num_blocks:
            return self._mask[0, :rows], self._mask[1, :rows]
        full = torch.zeros(rows, 1, 1, max(self.num_blocks, width), dtype=torch.int32, device=self.device)
        return full, torch.zeros_like(full)

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, heads_per_block: int, element_size: int) -> int:
        return 2 * cfg.num_layers * block_size * heads_per_block * cfg.head_dim * element_size

    @property
    def num_blocks(self) -> int:
        return self.shape[3]

    @property
    def nbytes(self) -> int:
        """The pool's bytes when held."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def reset(self) -> None:
        """Every block free (the contents stay: nothing reads a block before writing it)."""
        self.refs = [1] + [0] * (self.num_blocks - 1)  # scratch is never handed out
        self._free = list(range(self.num_blocks - 1, 0, -1))  # popped from the end: low ids first

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVFull(f"{n} KV blocks asked for, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self.refs[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        for i in ids:
            self.refs[i] += 1

    def release(self, ids: list[int]) -> None:
        for i in ids:
            self.refs[i] -= 1
            if not self.refs[i]:
                self._free.append(i)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i as [heads_per_block, blocks * block_size token slots, head_dim] (views)."""
        k, v = self.data[i]
        return k.flatten(1, 2), v.flatten(1, 2)

    def copy(self, src: list[int], dst: list[int]) -> None:
        self.data[:, :, :, dst] = self.data[:, :, :, src]

    def gather(self, ids: list[int]) -> torch.Tensor:
        """The blocks' contents in every layer, flat (what a regroup sends)."""
        return self.data[:, :, :, ids].reshape(-1)

    def scatter(self, ids: list[int], flat: torch.Tensor) -> None:
        self.data[:, :, :, ids] = flat.view(*self.shape[:3], len(ids), *self.shape[4:])

    def tables_for(self, batch: int, tokens: int, groups: int) -> torch.Tensor:
        """Allocates `batch` sequences of `tokens` tokens and `groups` head groups: their tables [B, g, blocks]
        (for callers of Transformer.forward outside the engine, such as the parity tests)."""
        n = -(-tokens // self.block_size)
        return torch.tensor(self.allocate(batch * groups * n), device=self.data.device).view(batch, groups, n)
