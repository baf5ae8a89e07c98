"""The decode step's inputs, kept on the device between steps and changed only where a row changes.

A row is a running request: its slot holds the last token, the position it writes next, the index of the token it
samples next, its block table on this rank (padded with block 0, scratch) and its sampling parameters. A step adds
one to every position and step and writes the sampled tokens in place, all on the device. The host writes a row
when it joins (after its prefill), one table entry when it enters a new block, and compacts the slots when rows
leave. Slots past the rows hold a greedy row at position 0 over scratch: what the batch buckets pad with.

Rows keep the engine's running order (the newest last, the first preempted), so slot i is running[i].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from .sampling import SamplingBatch, SamplingParams, row_values, sort_width

if TYPE_CHECKING:
    from .engine import Request


class DecodeBatch:
    def __init__(self, rows: int, groups: int, blocks: int, block_size: int, vocab: int, device: torch.device):
        self.block_size, self.vocab = block_size, vocab
        self.rows: list[Request] = []
        self._slot: dict[str, int] = {}
        self._needs: list[int] = []  # the sort width each row's sampling needs

        def full(value, dtype, *shape):
            return torch.full((rows, *shape), value, dtype=dtype, device=device)
        self.tokens, self.positions, self.steps = (full(0, torch.int64) for _ in range(3))
        self.tables = full(0, torch.int64, groups, blocks)
        greedy = row_values(SamplingParams(), vocab)
        self.sampling = [full(v, dtype) for v, dtype in zip(greedy, (torch.float32, torch.float32, torch.int64,
                                                                       torch.int64))]
        self._pad = (0, 0, 0, 0, *greedy[:4])  # each device tensor's value in an empty slot, in _device() order
        self.cached = torch.zeros(rows, dtype=torch.int64)  # the positions again, on the host: widths and boundaries

    def _device(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.positions, self.steps, self.tables, *self.sampling

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slot

    def slot(self, request_id: str) -> int:
        return self._slot[request_id]

    def add(self, requests: Sequence[Request], tables: dict[str, list[list[int]]]) -> None:
        """Rows joining after their prefill (cached tokens in their tables, the last output token next), in order."""
        if not requests:
            return
        n, k = len(self.rows), len(requests)
        if n + k > self.tokens.shape[0]:
            raise ValueError(f"{n + k} rows do not fit a decode batch of {self.tokens.shape[0]}")
        device, width = self.tokens.device, self.tables.shape[-1]
        values = [row_values(r.params, self.vocab) for r in requests]
        rows = torch.tensor([[r.output[-1], r.cached, len(r.output)] for r in requests], device=device)
        self.tokens[n:n + k], self.positions[n:n + k], self.steps[n:n + k] = rows.T
        self.cached[n:n + k] = torch.tensor([r.cached for r in requests])
        self.tables[n:n + k] = torch.tensor([[blocks + [0] * (width - len(blocks)) for blocks in tables[r.id]]
                                             for r in requests], device=device)
        for t, column in zip(self.sampling, zip(*values)):
            t[n:n + k] = torch.tensor(column, dtype=t.dtype, device=device)
        self._needs += [v[4] for v in values]
        self._slot.update((r.id, n + i) for i, r in enumerate(requests))
        self.rows += requests

    def remove(self, request_ids: Iterable[str]) -> None:
        """Rows leaving (finished or preempted; ids not in the batch are ignored): the rest move up, keeping order."""
        gone = {self._slot[i] for i in request_ids if i in self._slot}
        if not gone:
            return
        n = len(self.rows)
        keep = [s for s in range(n) if s not in gone]
        m, index = len(keep), torch.tensor(keep, dtype=torch.int64)  # on the host: the host mirror reads it too
        on_device = index.to(self.tokens.device)
        for t, pad in zip((*self._device(), self.cached), (*self._pad, 0)):
            t[:m] = t.index_select(0, on_device if t.device == on_device.device else index)
            t[m:n] = pad
        self.rows = [self.rows[s] for s in keep]
        self._needs = [self._needs[s] for s in keep]
        self._slot = {r.id: s for s, r in enumerate(self.rows)}

    def at_boundary(self) -> list[int]:
        """Slots whose next position starts a block (which they may not hold yet)."""
        return (self.cached[:len(self.rows)] % self.block_size == 0).nonzero()[:, 0].tolist()

    def set_blocks(self, entries: Sequence[tuple[int, int, list[int]]]) -> None:
        """Table entries (slot, block index, the block's id per head group) that changed."""
        if entries:
            slots, index, ids = zip(*entries)
            device = self.tables.device
            self.tables[torch.tensor(slots, device=device), :, torch.tensor(index, device=device)] = torch.tensor(
                ids, device=device)

    def inputs(self, rows: int, width: int) -> tuple:
        """The decode step's inputs for the first `rows` slots and `width` table entries (views: padded to a bucket
        by the empty slots and the tables' scratch entries)."""
        return (self.tokens[:rows], self.positions[:rows], self.tables[:rows, :, :width],
                SamplingBatch(*(t[:rows] for t in self.sampling), sort_k=sort_width(self._needs, self.vocab)),
                self.steps[:rows])

    def width(self) -> int:
        """Table entries the rows attend: the block of the furthest next position, + 1."""
        return int(self.cached[:len(self.rows)].max()) // self.block_size + 1

    def advance(self, tokens: torch.Tensor) -> None:
        """After a decode step: the sampled tokens (device, at least one per row) are the next inputs, one position
        and step on."""
        n = len(self.rows)
        self.tokens[:n] = tokens[:n]
        self.positions[:n] += 1
        self.steps[:n] += 1
        self.cached[:n] += 1
