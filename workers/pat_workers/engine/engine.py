"""Continuous batching for the TP group a rank belongs to.

Every member of a group runs the same steps on the same request list (the group's leader broadcasts what
arrives), so scheduling decisions and sampled tokens agree without further communication.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .comm import CommunicatorPool
from .kv import KVCache
from .model import Transformer
from .sampling import SamplingParams, sample

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


@dataclass
class StepStats:
    batch: int  # sequences decoded this step
    prefill_tokens: int
    tokens: int  # tokens generated
    seconds: float
    finished: list[Request]


class Engine:
    def __init__(self, model: Transformer, pool: CommunicatorPool, *, max_batch: int, max_seq: int):
        self.model, self.pool, self.rank = model, pool, pool.rank
        self.max_batch, self.max_seq = max_batch, max_seq
        self.eos_ids = frozenset(model.cfg.eos_token_ids)
        self.running: list[Request] = []  # running[i] owns cache slot i
        self.waiting: deque[Request] = deque()
        self.join((self.rank,))

    # -- the group ---------------------------------------------------------------------------------------
    def join(self, group: tuple[int, ...], kv: KVCache | None = None) -> None:
        """Makes `group` this rank's TP group: weight views for its shard and a cache shaped for it."""
        self.group = group
        self.comm = self.pool.get(group)
        self.shard = self.model.shard(len(group), group.index(self.rank))
        self.kv = kv if kv is not None else self.new_cache(len(group))

    def new_cache(self, tp: int) -> KVCache:
        # A TP=t group holds 1/t of the heads per rank, so the same memory serves t times the sequences.
        cfg = self.model.cfg
        return KVCache.allocate(cfg, self.max_batch * tp, cfg.num_kv_heads // tp, self.max_seq,
                                self.model.dtype, self.model.device)

    @property
    def tp(self) -> int:
        return len(self.group)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.group[0]

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- stepping ----------------------------------------------------------------------------------------
    def add(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def step(self) -> StepStats:
        start = time.perf_counter()
        while self.waiting and len(self.running) < self.kv.slots:
            self.running.append(self.waiting.popleft())
        fresh = sum(not r.output for r in self.running)
        prefill_tokens = self.prefill_pending()
        finished = self._release()
        batch = len(self.running)
        if batch:
            k, v = self.kv.rows(0, batch)
            tokens = torch.tensor([[r.output[-1]] for r in self.running], device=self.model.device)
            start_pos = torch.tensor([r.cached for r in self.running], device=self.model.device)
            logits = self.model.forward(self.shard, self.comm, tokens, start_pos, k, v)
            for r in self.running:
                r.cached += 1
            self._accept(self.running, logits)
            finished += self._release()
        return StepStats(batch, prefill_tokens, fresh + batch, time.perf_counter() - start, finished)

    def prefill_pending(self) -> int:
        """Prefills running requests without cached keys: new ones (then samples their first token) and
        recomputed ones (prompt + all generated tokens but the last, which is the next decode input).

        Consecutive slots go in one right-padded forward: positions past a row's end get keys that are never
        attended, since a decode step writes position p before it attends to it."""
        pending = {i: _prefill_tokens(r) for i, r in enumerate(self.running) if not r.cached}
        order = list(pending)
        total = 0
        while order:
            run, width = [order[0]], len(pending[order[0]])
            for i in order[1:]:
                if i != run[-1] + 1 or (len(run) + 1) * max(width, len(pending[i])) > PREFILL_TOKENS_PER_FORWARD:
                    break
                run.append(i)
                width = max(width, len(pending[i]))
            order = order[len(run):]
            requests = [self.running[i] for i in run]
            contexts = [pending[i] for i in run]
            device = self.model.device
            tokens = torch.tensor([c + [0] * (width - len(c)) for c in contexts], device=device)
            k, v = self.kv.rows(run[0], run[-1] + 1)
            start = torch.zeros(len(run), dtype=torch.long, device=device)
            last = torch.tensor([len(c) - 1 for c in contexts], device=device)
            logits = self.model.forward(self.shard, self.comm, tokens, start, k, v, last=last)
            for r, c in zip(requests, contexts):
                r.cached = len(c)
                total += len(c)
            fresh = [j for j, r in enumerate(requests) if not r.output]
            if fresh:
                self._accept([requests[j] for j in fresh], logits[fresh])
        return total

    def _accept(self, requests: list[Request], logits: torch.Tensor) -> None:
        tokens, logprobs = sample(logits, [r.params for r in requests], [len(r.output) for r in requests])
        for r, token, logprob in zip(requests, tokens, logprobs):
            r.output.append(token)
            r.logprobs.append(logprob)
            p = r.params
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                r.finish_reason = "stop"
            elif len(r.output) >= p.max_tokens or r.context_len >= self.max_seq:
                r.finish_reason = "length"

    def _release(self) -> list[Request]:
        done = [i for i, r in enumerate(self.running) if r.finish_reason]
        finished = [self.running[i] for i in done]
        for i in reversed(done):  # fill each hole with the last request, keeping slots 0..n-1 dense
            last = len(self.running) - 1
            if i != last:
                self.kv.move(last, i, self.running[last].cached)
                self.running[i] = self.running[last]
            self.running.pop()
        return finished
