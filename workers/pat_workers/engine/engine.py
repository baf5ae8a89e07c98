"""Continuous batching for the TP group a rank belongs to, over a paged KV cache.

Every member of a group runs the same steps on the same request list (the group's leader broadcasts what
arrives), so scheduling decisions and sampled tokens agree without further communication: each member's block
pool holds its share of the heads and sees the same allocations.

A step: admit waiting requests while blocks are free (the G samples of one prompt share its prefill and blocks),
prefill what has no cache, give each decoding row a block for its next position (copy on write where a block is
shared, preempting the newest request back to the queue when the pool is full), then one decode step: forward and
sampling on the device in shapes fixed per (batch, context) bucket, captured in a CUDA graph on GPUs, and one
device-to-host copy of the tokens and log-probabilities. The step's inputs stay on the device between steps
(batch.DecodeBatch): the host writes only the rows that join or leave and the table entries of new blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .batch import DecodeBatch
from .comm import CommunicatorPool
from .faults import failpoint
from .kv import KVFull, PagedKV
from .model import Transformer
from .sampling import SamplingBatch, SamplingParams, sample

PREFILL_TOKENS_PER_FORWARD = 4096  # padded tokens in one batched prefill: bounds its activation memory


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    cached: int = 0  # tokens whose keys and values are in this group's cache

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)


def _prefill_tokens(r: Request) -> list[int]:
    """What a prefill feeds: the prompt, or for a recomputed request everything but the last token."""
    return (r.prompt + r.output)[:-1] if r.output else r.prompt


def bucket(n: int, cap: int) -> int:
    """The static size a batch of n rows (or a table of n blocks) is padded to: a power of two, at most cap."""
    return min(1 << (n - 1).bit_length(), cap)


@dataclass
class StepStats:
    batch: int  # sequences decoded this step
    prefill_tokens: int
    tokens: int  # tokens generated
    seconds: float
    finished: list[Request]
    preempted: int = 0


class Engine:
    def __init__(self, model: Transformer, pool: CommunicatorPool, *, max_batch: int, max_seq: int,
                 kv_blocks: int | None = None, block_size: int = 16, cuda_graphs: bool = True,
                 compile_step: bool = False):
        self.model, self.pool, self.rank = model, pool, pool.rank
        self.max_batch, self.max_seq = max_batch, max_seq
        self.eos_ids = frozenset(model.cfg.eos_token_ids)
        cfg = model.cfg
        self.max_tp = max(cfg.tp_sizes(pool.world))
        self.blocks_per_seq = -(-max_seq // block_size)
        # Enough for max_batch sequences of max_seq tokens (all heads) unless told fewer: more could never be used.
        kv_blocks = kv_blocks or max_batch * self.blocks_per_seq * self.max_tp + 1
        if kv_blocks - 1 < self.blocks_per_seq * self.max_tp:
            raise ValueError(f"a KV cache of {kv_blocks} blocks cannot hold one sequence of max_seq={max_seq} tokens "
                             f"({self.blocks_per_seq * self.max_tp} blocks + 1 scratch): give the cache more memory "
                             f"or lower max_seq")
        self.kv = PagedKV(cfg, kv_blocks, block_size, cfg.num_kv_heads // self.max_tp, model.dtype, model.device,
                          mask_rows=max_batch * self.max_tp)  # a step's rows x head groups, at any TP
        self.tables: dict[str, list[list[int]]] = {}  # request id -> its blocks here, per head group held
        self.running: list[Request] = []  # admission order: the last is the first preempted
        self._batch: DecodeBatch | None = None  # the decode inputs of running[:len(_batch)] (None: built anew)
        self.waiting: deque[Request] = deque()
        self.preemptions = 0
        self._shares: dict[str, Request] = {}  # a fresh request -> the one prefilling the same prompt for it
        self._graphs: dict[tuple, Callable] = {}
        self._graph_pool = None
        self._cuda_graphs = cuda_graphs and model.device.type == "cuda"
        # Graphs need a few fixed shapes: batches and tables padded to power-of-two buckets. Eager steps run as is.
        self.static_shapes = self._cuda_graphs
        # The step's device part, run as is or captured. compile_step: through torch.compile (one graph: inductor fuses
        # the elementwise work around the GEMMs; the KV write and the attention are ops of their own). Not frozen: a
        # weight sync writes the weights in place, and frozen (prepacked) weights would be stale copies.
        self.decode_fn = torch.compile(self._decode, fullgraph=True) if compile_step else self._decode
        # Eager float32 CPU steps run their GEMMs on weights prepacked for oneDNN (model.prepacked: a copy per TP
        # size held). Not bfloat16: oneDNN's bf16 GEMM needs CPU instructions a host may lack.
        self.prepack = (model.device.type == "cpu" and model.dtype == torch.float32 and not compile_step
                        and torch.backends.mkldnn.is_available())
        self.weights_lost = False  # released with the engine's memory, not yet written again (release_memory)
        self.join((self.rank,))

    @property
    def running(self) -> list[Request]:
        return self._running

    @running.setter
    def running(self, requests: list[Request]) -> None:
        """A new running list (a regroup's): the device batch is built anew from it at the next step. Requests
        appended to the list join the batch at the next step; the engine removes what leaves it."""
        self._running, self._batch = requests, None

    # -- the group ---------------------------------------------------------------------------------------
    def join(self, group: tuple[int, ...]) -> None:
        """Makes `group` this rank's TP group: weight views for its shard (the caller moves the blocks)."""
        self.group = group
        self.comm = self.pool.get(group)
        self.shard = self.model.shard(len(group), group.index(self.rank), prepack=self.prepack)
        self._batch = None  # a table per head group: their number changes with the group

    def weights_changed(self) -> None:
        """The replica's weights were written in place (a weight sync): the shard's prepacked copies are made again."""
        self.model.weights_changed()
        self.join(self.group)

    @property
    def tp(self) -> int:
        return len(self.group)

    @property
    def head_groups(self) -> int:
        """Blocks per block of tokens a request holds on this rank."""
        return self.max_tp // self.tp

    @property
    def capacity(self) -> int:
        return self.max_batch * self.tp

    @property
    def is_leader(self) -> bool:
        return self.rank == self.group[0]

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (scratch not counted)."""
        return 1 - self.kv.free_blocks / (self.kv.num_blocks - 1)

    def release_memory(self, weights: bool = False) -> None:
        """Gives back the memory the engine holds beside the weights, between batches: the KV pool, the captured
        graphs with their memory pool (they read the pool's address, so they are captured again after
        `acquire_memory`), and on CPU the prepacked copies of the weights; with `weights` the weights too (their
        values are lost: a weight update must write them before `acquire_memory`). On GPUs the caching allocator
        returns the freed blocks to the device."""
        if self.has_work():
            raise RuntimeError(f"{len(self.running) + len(self.waiting)} request(s) are in the engine: release its "
                               f"memory between batches")
        self.kv.release_memory()
        self._batch = None
        self._graphs.clear()
        self._graph_pool = None
        self.model.drop_packed()
        if weights:  # no view may keep the loader's buffers (Transformer.release_weights): join takes them again
            self.shard = None
            self.model.release_weights()
            self.weights_lost = True
        else:
            self.shard = self.model.shard(self.tp, self.group.index(self.rank))  # views only until acquire_memory
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def acquire_memory(self) -> None:
        """Takes the KV pool back before the next batch (every block free), and packs the shard's weights again."""
        if self.weights_lost:
            raise RuntimeError("the weights were released with the engine's memory: a weight update must write new "
                               "ones before the engine takes its memory back")
        self.kv.acquire_memory()
        self.join(self.group)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of `tokens` cached tokens holds on this rank."""
        return -(-tokens // self.kv.block_size) * self.head_groups

    # -- blocks ------------------------------------------------------------------------------------------
    def _grant(self, r: Request, tokens: int, reserve: int = 0) -> bool:
        """Gives r the blocks for `tokens` cached tokens, if that leaves `reserve` blocks free."""
        n = -(-tokens // self.kv.block_size)
        if self.kv.free_blocks - self.blocks_for(tokens) < reserve:
            return False
        ids = self.kv.allocate(self.blocks_for(tokens))
        self.tables[r.id] = [ids[i * n:(i + 1) * n] for i in range(self.head_groups)]
        return True

    def free(self, r: Request) -> None:
        for blocks in self.tables.pop(r.id, ()):
            self.kv.release(blocks)

    def preempt(self, r: Request) -> None:
        """Back to the front of the queue; its tokens stay and are recomputed when it is admitted again."""
        self.free(r)
        r.cached = 0
        self.preemptions += 1
        self.running.remove(r)
        if self._batch is not None:
            self._batch.remove([r.id])
        self.waiting.appendleft(r)

    def _writable(self, r: Request) -> bool:
        """Makes the block of r's next position its own (allocated, not shared): preempts the newest requests
        while the pool is full. False when r itself was preempted."""
        table, j = self.tables[r.id], r.cached // self.kv.block_size
        while True:
            try:
                if j == len(table[0]):
                    for blocks, new in zip(table, self.kv.allocate(self.head_groups)):
                        blocks.append(new)
                elif any(self.kv.refs[blocks[j]] > 1 for blocks in table):  # copy on write
                    new = self.kv.allocate(self.head_groups)
                    old = [blocks[j] for blocks in table]
                    self.kv.copy(old, new)
                    self.kv.release(old)
                    for blocks, b in zip(table, new):
                        blocks[j] = b
                return True
            except KVFull:
                newest = self.running[-1]
                self.preempt(newest)
                if newest is r:
                    return False

    # -- stepping ----------------------------------------------------------------------------------------
    def add(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def step(self) -> StepStats:
        start = time.perf_counter()
        preemptions = self.preemptions
        self._admit()
        fresh = sum(not r.output for r in self.running)
        prefill_tokens = self.prefill_pending()
        finished = self._release()
        self._grow()
        batch = len(self.running)
        if batch:
            self._accept(list(self.running), *self._decode_step())
            finished += self._release()
            if self.tp > 1:
                failpoint("decode.tp", self.rank)  # tests: a slow link, which no start-up profile foresaw
        return StepStats(batch, prefill_tokens, fresh + batch, time.perf_counter() - start, finished,
                         self.preemptions - preemptions)

    def _admit(self) -> None:
        """Waiting requests enter while the batch has room and their prefill's blocks are free. A fresh request
        whose prompt a request entering in the same step prefills shares that prefill and its blocks."""
        prefilling: dict[tuple[int, ...], Request] = {}
        while self.waiting and len(self.running) < self.capacity:
            r = self.waiting[0]
            owner = prefilling.get(tuple(r.prompt)) if not r.output else None
            if owner is not None:
                self.tables[r.id] = [list(blocks) for blocks in self.tables[owner.id]]
                for blocks in self.tables[r.id]:
                    self.kv.share(blocks)
                self._shares[r.id] = owner
            # + the first decoded token's position; and a block's room for each running row to grow into, so that
            # what is admitted now does not preempt what runs at the next block boundary.
            elif not self._grant(r, len(_prefill_tokens(r)) + 1, reserve=len(self.running) * self.head_groups):
                break
            elif not r.output:
                prefilling[tuple(r.prompt)] = r
            self.running.append(self.waiting.popleft())

    def prefill_pending(self) -> int:
        """Prefills running requests without cached keys: new ones (then samples their first token) and
        recomputed ones (prompt + all generated tokens but the last, which is the next decode input). Returns the
        tokens prefilled: a prompt shared by several requests counts once.

        Rows go in right-padded forwards of at most PREFILL_TOKENS_PER_FORWARD tokens: positions past a row's end
        write keys that are never attended, since a decode step writes position p before it attends to it."""
        pending = [r for r in self.running if not r.cached and r.id not in self._shares]
        for r in pending:  # a regroup's recomputed requests come without blocks
            if r.id not in self.tables and not self._grant(r, len(_prefill_tokens(r)) + 1):
                self.running.remove(r)
                self.waiting.appendleft(r)
        pending = [(r, _prefill_tokens(r)) for r in pending if r.id in self.tables]
        total = 0
        while pending:
            width, n = len(pending[0][1]), 1
            while n < len(pending) and (n + 1) * max(width, len(pending[n][1])) <= PREFILL_TOKENS_PER_FORWARD:
                width = max(width, len(pending[n][1]))
                n += 1
            run, pending = pending[:n], pending[n:]
            total += self._prefill([r for r, _ in run], [c for _, c in run], width)
        return total

    def _grow(self) -> None:
        """Gives each running row the block of its next position and brings the device batch up to date. Only rows
        at a block boundary and rows new to the batch are looked at: a row inside a block wrote its previous
        position there, so that block is its own."""
        if self._batch is None:
            self._batch = DecodeBatch(self.capacity, self.head_groups, self.blocks_per_seq, self.kv.block_size,
                                      self.model.cfg.vocab_size, self.model.device)
        batch = self._batch
        due = [batch.rows[s] for s in batch.at_boundary()] + self.running[len(batch):]
        grown = [(r, r.cached // self.kv.block_size) for r in due if r.id in self.tables and self._writable(r)]
        # Preemptions (of the newest rows) may have moved slots meanwhile: the entries are placed by id.
        batch.set_blocks([(batch.slot(r.id), j, [blocks[j] for blocks in self.tables[r.id]])
                          for r, j in grown if r.id in batch])
        batch.add(self.running[len(batch):], self.tables)

    def _prefill(self, run: list[Request], contexts: list[list[int]], width: int) -> int:
        device = self.model.device
        tokens = torch.tensor([c + [0] * (width - len(c)) for c in contexts], device=device)
        last = torch.tensor([len(c) - 1 for c in contexts], device=device)
        logits = self.model.forward(self.shard, self.comm, self.kv, tokens, torch.zeros_like(last),
                                    self._table_tensor(run, -(-width // self.kv.block_size)), last=last)
        sharers: dict[str, list[Request]] = {}  # owner id -> the requests sharing its prefill
        for s in self.running:
            if s.id in self._shares:
                sharers.setdefault(self._shares[s.id].id, []).append(s)
        rows, sampled = [], []
        for i, (r, c) in enumerate(zip(run, contexts)):
            for s in [r, *sharers.get(r.id, ())]:
                self._shares.pop(s.id, None)
                s.cached = len(c)
                if not s.output:
                    rows.append(i)
                    sampled.append(s)
        if sampled:
            self._accept(sampled, *self._sample(logits[rows], sampled))
        return sum(map(len, contexts))

    def _table_tensor(self, rows: list[Request], width: int) -> torch.Tensor:
        """Block tables [rows, g, width] of a prefill's rows: their first `width` blocks, padded with scratch."""
        return torch.tensor([blocks[:width] + [0] * (width - len(blocks[:width])) for r in rows
                             for blocks in self.tables[r.id]], device=self.model.device).view(len(rows), -1, width)

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> tuple[list[int], list[float]]:
        device = logits.device
        params = SamplingBatch.build([r.params for r in rows], logits.shape[-1], device)
        steps = torch.tensor([len(r.output) for r in rows], device=device)
        return self._fetch(*sample(logits, params, steps))

    @staticmethod
    def _fetch(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
        # One device-to-host copy: the log-probabilities travel as the bits of int32 beside the tokens.
        packed = torch.stack([tokens.to(torch.int32), logprobs.float().view(torch.int32)]).cpu()
        return packed[0].tolist(), packed[1].view(torch.float32).tolist()

    # -- the decode step ---------------------------------------------------------------------------------
    def decode_inputs(self) -> tuple:
        """The next decode step's device inputs (views of the batch's), padded to their (batch, context) bucket
        for graphs: rows are the running requests, each with the block of its next position."""
        n, width = len(self._batch), self._batch.width()
        if self.static_shapes:
            n, width = bucket(n, self.capacity), bucket(width, self.blocks_per_seq)
        return self._batch.inputs(n, width)

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, params: SamplingBatch,
                steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and sampling of one decode step: no host synchronisation, shapes fixed by the inputs'."""
        logits = self.model.forward(self.shard, self.comm, self.kv, tokens[:, None], positions, tables)
        return sample(logits, params, steps)

    def run_decode(self, inputs: tuple) -> tuple[list[int], list[float]]:
        """The decode step as it is served, on device inputs shaped as decode_inputs() makes them: captured,
        compiled or eager, then the one device-to-host copy of its tokens and log-probabilities. The start-up
        profile (engine.costs) times this."""
        return self._fetch(*self._device_step(inputs))

    def _device_step(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        # A graph holds NCCL collectives; gloo and shared memory run on the host, where no graph can hold them.
        capturable = self._cuda_graphs and (self.tp == 1 or self.pool.backend == "nccl")
        return (self._captured(inputs) if capturable else self.decode_fn)(*inputs)

    def _decode_step(self) -> tuple[list[int], list[float]]:
        tokens, logprobs = self._device_step(self.decode_inputs())
        self._batch.advance(tokens)
        n = len(self.running)
        for r in self.running:
            r.cached += 1
        tokens, logprobs = self._fetch(tokens, logprobs)
        return tokens[:n], logprobs[:n]

    def _captured(self, inputs: tuple) -> Callable:
        """The decode step as a CUDA graph per (group, batch bucket, context bucket, sort width), captured on first
        use and kept: a regroup back into a layout already seen reuses its graphs."""
        tokens, positions, tables, params, steps = inputs
        key = (self.group, tokens.shape[0], tables.shape[-1], params.sort_k)
        if key not in self._graphs:
            sort_k = params.sort_k
            static = [t.clone() for t in (tokens, positions, tables, *params.tensors(), steps)]

            def step():
                t, pos, tab, *sampling, st = static
                return self.decode_fn(t, pos, tab, SamplingBatch(*sampling, sort_k=sort_k), st)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture (it writes the keys the step will write)
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):  # one memory pool for all the graphs
                out = step()
            self._graph_pool = graph.pool()

            def replay(tokens, positions, tables, params, steps):
                for dst, src in zip(static, (tokens, positions, tables, *params.tensors(), steps)):
                    dst.copy_(src)
                graph.replay()
                return out
            self._graphs[key] = replay
        return self._graphs[key]

    def _accept(self, requests: list[Request], tokens: list[int], logprobs: list[float]) -> None:
        for r, token, logprob in zip(requests, tokens, logprobs):
            r.output.append(token)
            r.logprobs.append(logprob)
            p = r.params
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                r.finish_reason = "stop"
            elif len(r.output) >= p.max_tokens or r.context_len >= self.max_seq:
                r.finish_reason = "length"

    def _release(self) -> list[Request]:
        finished = [r for r in self.running if r.finish_reason]
        for r in finished:
            self.free(r)
        if finished:
            self._running = [r for r in self.running if not r.finish_reason]
            if self._batch is not None:
                self._batch.remove(r.id for r in finished)
        return finished
