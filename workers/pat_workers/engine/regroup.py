"""Regroup at a step boundary: change the TP layout of a block of ranks in place.

Each region (a block of ranks whose groups change) runs these phases collectively, while the rest of the pod
keeps decoding:
  1. share state: each old group's leader contributes its requests (prompt, tokens so far, sampling state);
  2. plan (the same on every member): which new group takes which request, and per request whether its
     KV cache migrates (split by heads to the new peers) or is recomputed (re-prefill), by measured costs;
  3. move: weight views for the new shard, KV pieces exchanged in one all-to-all;
  4. commit (a barrier), then recompute what was chosen for recompute, at the new TP.
A failure in any phase (a peer died, a timeout) falls back to TP=1 on every surviving rank of the region:
each old group's requests go to its lowest surviving member (or the region's lowest survivor) and are
re-prefilled there. No request is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from pat_operator.layout import Group, Layout, group_of, groups, regions

from .comm import CommError
from .costs import Costs
from .engine import Engine, Request
from .faults import failpoint

MIGRATION_MODES = ("auto", "kv", "recompute")


@dataclass
class RegroupReport:
    epoch: int
    rank: int
    group: Group  # this rank's group afterwards
    outcome: str  # "applied" | "unchanged" | "fallback" | "rejected"
    region: Group = ()
    modes: dict[str, int] = field(default_factory=dict)  # requests per migration mode
    seconds: dict[str, float] = field(default_factory=dict)  # kv, recompute, total
    kv_bytes: int = 0  # bytes this rank sent
    request_ids: list[str] = field(default_factory=list)  # what this rank's group holds afterwards
    dead_ranks: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class _Move:
    request: Request
    source: Group  # old group
    old_slot: int
    new_slot: int
    mode: str


def _heads(group: Group, rank: int, num_kv_heads: int) -> range:
    per = num_kv_heads // len(group)
    i = group.index(rank)
    return range(i * per, (i + 1) * per)


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def regroup(engine: Engine, old: Layout, new: Layout, epoch: int, costs: Costs, migration: str = "auto") -> RegroupReport:
    rank = engine.rank
    region = next((r for r in regions(old, new) if rank in r), None)
    mine_new = group_of(new, rank)
    if region is None:
        return RegroupReport(epoch, rank, engine.group, "unchanged", request_ids=_ids(engine))
    if group_of(old, rank) != engine.group:
        return RegroupReport(epoch, rank, engine.group, "rejected", region, request_ids=_ids(engine),
                             error=f"plan assumes group {group_of(old, rank)}, rank {rank} is in {engine.group}")
    arrived = time.perf_counter()
    comm = engine.pool.get(region)
    old_groups = [g for g in groups(old) if set(g) <= set(region)]
    new_groups = [g for g in groups(new) if set(g) <= set(region)]
    held: dict[Group, tuple[list[Request], list[Request]]] | None = None
    start = arrived
    try:
        # The region's groups reach their step boundaries at different times; what a regroup costs is
        # counted from when all are there ("sync" is the wait of the earliest).
        comm.barrier()
        start = time.perf_counter()
        failpoint("regroup.share", rank)
        state = (list(engine.running), list(engine.waiting)) if engine.is_leader else None
        held = {g: s for g, s in comm.all_gather_object((engine.group, state)) if s is not None}
        moves, waiting = _plan(engine, held, old_groups, new_groups, costs, migration)
        failpoint("regroup.transfer", rank)
        kv = engine.new_cache(len(mine_new))
        sent = _move_kv(engine, comm, region, moves, kv)
        kv_seconds = time.perf_counter() - start
        failpoint("regroup.commit", rank)
        comm.barrier()
    except CommError as error:
        return _fall_back(engine, region, old_groups, held, error, epoch, start)

    engine.join(mine_new, kv)
    engine.running = [m.request for m in moves[mine_new]]
    engine.waiting = deque(waiting[mine_new])
    recompute_start = time.perf_counter()
    try:
        engine.prefill_pending()
    except CommError as error:  # a peer died after the commit: the requests are all here, start over at TP=1
        return _fall_back(engine, region, old_groups, held, error, epoch, start)
    end = time.perf_counter()
    modes = {mode: sum(m.mode == mode for m in moves[mine_new]) for mode in ("kv", "recompute")}
    return RegroupReport(epoch, rank, mine_new, "applied", region, modes,
                         {"sync": start - arrived, "kv": kv_seconds, "recompute": end - recompute_start,
                          "total": end - start},
                         sent, _ids(engine))


def _ids(engine: Engine) -> list[str]:
    return [r.id for r in engine.running] + [r.id for r in engine.waiting]


def _plan(engine: Engine, held, old_groups: list[Group], new_groups: list[Group], costs: Costs, migration: str):
    """For each new group: the requests it runs (with their slots and modes) and those it queues."""
    if migration not in MIGRATION_MODES:
        raise ValueError(f"migration={migration!r}: use one of {MIGRATION_MODES}")
    cfg = engine.model.cfg
    bytes_per_head_token = 2 * cfg.num_layers * cfg.head_dim * engine.model.dtype.itemsize
    assigned: dict[Group, list[tuple[Request, Group, int]]] = {g: [] for g in new_groups}
    waiting: dict[Group, list[Request]] = {g: [] for g in new_groups}
    for old in old_groups:
        running, queued = held[old]
        targets = [g for g in new_groups if set(g) & set(old)]  # one group that merges it, or its parts
        for k, r in enumerate(running):
            assigned[targets[k % len(targets)]].append((r, old, k))
        for k, r in enumerate(queued):
            waiting[targets[(len(running) + k) % len(targets)]].append(r)
    moves: dict[Group, list[_Move]] = {}
    for g, items in assigned.items():
        capacity = engine.max_batch * len(g)
        for r, _, _ in items[capacity:]:  # more than the new cache holds: queue them, to be re-prefilled
            r.cached = 0
        waiting[g][:0] = [r for r, _, _ in items[capacity:]]
        chosen = []
        for r, old, old_slot in items[:capacity]:
            crossing = sum(len(_overlap(_heads(g, j, cfg.num_kv_heads), _heads(old, m, cfg.num_kv_heads)))
                           for j in g for m in old if m != j)
            mode = migration if migration != "auto" else costs.choose(
                crossing * r.cached * bytes_per_head_token, r.cached, len(g))
            chosen.append((mode != "kv", r, old, old_slot, mode))
        # Migrated requests first: those to recompute then fill consecutive slots, prefilled in one batch.
        chosen.sort(key=lambda c: c[0])
        moves[g] = [_Move(r, old, old_slot, slot, mode) for slot, (_, r, old, old_slot, mode) in enumerate(chosen)]
        for mv in moves[g]:
            if mv.mode == "recompute":
                mv.request.cached = 0
    return moves, waiting


def _move_kv(engine: Engine, comm, region: Group, moves: dict[Group, list[_Move]], kv) -> int:
    """Moves every migrating request's cache to its new owners in one all-to-all; returns bytes sent."""
    rank, n_kv = engine.rank, engine.model.cfg.num_kv_heads
    old_heads = _heads(engine.group, rank, n_kv)
    sends: list[list[torch.Tensor]] = [[] for _ in region]  # per region member: what goes to it, in order
    expected: list[list[torch.Tensor]] = [[] for _ in region]  # per region member: where its pieces land
    for g, group_moves in moves.items():
        for mv in group_moves:
            if mv.mode != "kv":
                continue
            for j in g:
                want = _heads(g, j, n_kv)
                for m in mv.source:
                    piece = _overlap(want, _heads(mv.source, m, n_kv))
                    if not piece or rank not in (j, m):
                        continue
                    length = mv.request.cached
                    if m == rank:
                        src = slice(piece.start - old_heads.start, piece.stop - old_heads.start)
                        views = engine.kv.heads(mv.old_slot, src, length)
                    if j == rank:
                        dst = slice(piece.start - want.start, piece.stop - want.start)
                        targets = kv.heads(mv.new_slot, dst, length)
                    if m == j:
                        for t, s in zip(targets, views):
                            t.copy_(s)
                    elif m == rank:
                        sends[region.index(j)].extend(v.reshape(-1) for v in views)
                    else:
                        expected[region.index(m)].extend(targets)
    flat = [torch.cat(s) if s else None for s in sends]
    received = comm.all_to_all(flat)
    for source, targets in enumerate(expected):
        offset = 0
        for t in targets:
            t.copy_(received[source][offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
    return sum(f.numel() * f.element_size() for f in flat if f is not None)


def _fall_back(engine: Engine, region: Group, old_groups: list[Group], held, error: CommError, epoch: int,
               start: float) -> RegroupReport:
    rank = engine.rank
    dead = set(error.dead_ranks) | (set(engine.pool.dead_ranks()) & set(region))
    alive = [r for r in region if r not in dead]
    if held is None:  # the state never got shared: each group keeps its own requests
        held = {engine.group: (list(engine.running), list(engine.waiting))}
    keep_own = engine.group == (rank,)  # still the TP=1 replica it was: its cache is intact
    adopted: list[Request] = []
    for old in old_groups:
        if old not in held:
            continue
        owner = next((r for r in old if r in alive), alive[0])
        if owner == rank and not (keep_own and old == (rank,)):
            adopted += held[old][0] + held[old][1]
    if keep_own:
        running, waiting = held[(rank,)]
        engine.running, engine.waiting = list(running), deque(waiting)
    else:
        engine.join((rank,))
        engine.running, engine.waiting = [], deque()
    for r in adopted:
        r.cached = 0
    engine.waiting.extendleft(reversed(adopted))
    return RegroupReport(epoch, rank, (rank,), "fallback", region, {"recompute": len(adopted)},
                         {"total": time.perf_counter() - start}, request_ids=_ids(engine),
                         dead_ranks=sorted(dead), error=str(error))
