"""Regroup at a step boundary: change the TP layout of a block of ranks in place.

Each region (a block of ranks whose groups change) runs these phases collectively, while the rest of the pod
keeps decoding:
  1. share state: each old group's leader contributes its requests (prompt, tokens so far, sampling state);
  2. plan (the same on every member): which new group takes which request, and per request whether its
     KV cache migrates (split by heads to the new peers) or is recomputed (re-prefill), by measured costs;
  3. move: weight views for the new shard; KV blocks by heads: a rank keeps the blocks of the heads it still
     holds, the others go to their new holder in rounds of all-to-alls (each a few % of the pool: no second cache).
     A block that several requests share (the G samples of a prompt) goes once to each rank that needs it and is
     shared there again; a request whose blocks find no room (KVFull) is recomputed instead;
  4. commit (the group agrees on what it recomputes), then recompute what was chosen for recompute, at the new TP.
A failure in any phase (a peer died, a timeout) falls back to TP=1 on every surviving rank of the region:
each old group's requests go to its lowest surviving member (or the region's lowest survivor) and are
re-prefilled there. No request is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from pat_operator.fit import REGROUP_IN_FLIGHT
from pat_operator.layout import Group, Layout, group_of, groups, regions

from .comm import CommError
from .costs import Costs
from .engine import Engine, Request
from .faults import active, failpoint
from .kv import KVFull

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
    kv_buffer_bytes: int = 0  # the most a round of the KV move held in send and receive buffers, beside the pool
    kv_pool_bytes: int = 0  # the pool's size
    kv_free_blocks: int = 0  # free blocks in this rank's pool afterwards
    request_ids: list[str] = field(default_factory=list)  # what this rank's group holds afterwards
    dead_ranks: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class _Move:
    request: Request
    source: Group  # old group
    mode: str  # kv | recompute


@dataclass
class _Blocks:
    """Where the migrating requests' blocks go (the same plan on every rank). Head groups are indices into a
    request's table on a rank; a transfer's users are the table entries its one copy fills on the receiving rank."""
    kept: dict[int, dict[tuple[str, int], int]]  # rank -> (request, head group before) -> head group after
    transfers: dict[tuple[int, int], list[tuple[int, list[tuple[str, int, int]]]]]
    # (sender, receiver) -> [(block id on the sender, [(request, head group, block index) on the receiver])]


def regroup(engine: Engine, old: Layout, new: Layout, epoch: int, costs: Costs, migration: str = "auto"
            ) -> RegroupReport:
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
    start, touched = arrived, False
    try:
        # The region's groups reach their step boundaries at different times; what a regroup costs is
        # counted from when all are there ("sync" is the wait of the earliest).
        comm.barrier()
        start = time.perf_counter()
        failpoint("regroup.share", rank)
        state = (list(engine.running), list(engine.waiting)) if engine.is_leader else None
        # Every rank's block tables too (which requests share a block) and the size of its pool.
        shared = comm.all_gather_object((engine.group, state, engine.tables, engine.kv.num_blocks - 1))
        held = {g: s for g, s, _, _ in shared if s is not None}
        rank_tables = {r: tables for r, (_, _, tables, _) in zip(region, shared)}
        usable = {r: n for r, (_, _, _, n) in zip(region, shared)}
        moves, waiting, blocks = _plan(engine, held, rank_tables, usable, old_groups, new_groups, costs, migration)
        failpoint("regroup.transfer", rank)
        touched = True  # from here on this rank's blocks change: a failure recomputes everything
        tables, sent, buffered, lost = _move_kv(engine, comm, region, moves, blocks)
        kv_seconds = time.perf_counter() - start
        failpoint("regroup.commit", rank)
        lost = set().union(*comm.all_gather_object(lost))  # a request any member lost, its whole group recomputes
    except CommError as error:
        return _fall_back(engine, region, old_groups, held, error, epoch, start, touched)

    engine.join(mine_new)
    for mv in moves[mine_new]:
        if mv.request.id in lost:
            for ids in tables.pop(mv.request.id):
                engine.kv.release([b for b in ids if b is not None])  # None: a block that found no room here
            mv.mode, mv.request.cached = "recompute", 0
    engine.tables = tables
    engine.running = [m.request for m in moves[mine_new]]
    engine.waiting = deque(waiting[mine_new])
    recompute_start = time.perf_counter()
    try:
        engine.prefill_pending()
    except CommError as error:  # a peer died after the commit: the requests are all here, start over at TP=1
        return _fall_back(engine, region, old_groups, held, error, epoch, start, True)
    end = time.perf_counter()
    modes = {mode: sum(m.mode == mode for m in moves[mine_new]) for mode in ("kv", "recompute")}
    return RegroupReport(epoch, rank, mine_new, "applied", region, modes,
                         {"sync": start - arrived, "kv": kv_seconds, "recompute": end - recompute_start,
                          "total": end - start},
                         sent, buffered, engine.kv.nbytes, engine.kv.free_blocks, _ids(engine))


def _ids(engine: Engine) -> list[str]:
    return [r.id for r in engine.running] + [r.id for r in engine.waiting]


def _plan(engine: Engine, held, rank_tables, usable, old_groups: list[Group], new_groups: list[Group], costs: Costs,
          migration: str):
    """For each new group: the requests it runs (with their modes) and those it queues; and where the blocks of
    those that migrate go. The same on every rank."""
    if migration not in MIGRATION_MODES:
        raise ValueError(f"migration={migration!r}: use one of {MIGRATION_MODES}")
    cfg = engine.model.cfg
    bytes_per_head_token = 2 * cfg.num_layers * cfg.head_dim * engine.model.dtype.itemsize
    assigned: dict[Group, list[tuple[Request, Group]]] = {g: [] for g in new_groups}
    waiting: dict[Group, list[Request]] = {g: [] for g in new_groups}
    for old in old_groups:
        running, queued = held[old]
        targets = [g for g in new_groups if set(g) & set(old)]  # one group that merges it, or its parts
        for k, r in enumerate(running):
            assigned[targets[k % len(targets)]].append((r, old))
        for k, r in enumerate(queued):
            waiting[targets[(len(running) + k) % len(targets)]].append(r)
    moves: dict[Group, list[_Move]] = {}
    for g, items in assigned.items():
        capacity = engine.max_batch * len(g)
        for r, _ in items[capacity:]:  # more than the new group runs: queue them, to be re-prefilled
            r.cached = 0
        waiting[g][:0] = [r for r, _ in items[capacity:]]
        moves[g] = []
        for r, old in items[:capacity]:
            crossing = engine.kv.heads_per_block * sum(
                _holder(old, h, engine.max_tp) != _holder(g, h, engine.max_tp) for h in range(engine.max_tp))
            mode = migration if migration != "auto" else costs.choose(
                crossing * r.cached * bytes_per_head_token, r.cached, len(g))
            moves[g].append(_Move(r, old, mode))
    blocks = _place_blocks(engine, moves, rank_tables, usable, check=not active("regroup.overcommit", engine.rank))
    for group_moves in moves.values():
        group_moves.sort(key=lambda mv: mv.mode != "kv")  # those to recompute go in one batched prefill
        for mv in group_moves:
            if mv.mode == "recompute":
                mv.request.cached = 0
    return moves, waiting, blocks


def _place_blocks(engine: Engine, moves: dict[Group, list[_Move]], rank_tables: dict[int, dict[str, list]],
                  usable: dict[int, int], check: bool) -> _Blocks:
    """Where the blocks of the migrating requests go: a rank keeps those of the heads it still holds; the others go
    to their new holder, each physical block once per receiving rank, however many requests share it.

    A request migrates while every rank's pool holds, at once, what it keeps, what it sends (as if held until the
    move ends: a bound) and what it receives, each physical block counted once; the others are recomputed
    (re-prefilled after the move, when blocks are free again). check=False (failpoint regroup.overcommit, for
    tests) skips that count, so that the move itself runs out of blocks."""
    max_tp, bs = engine.max_tp, engine.kv.block_size
    holding: dict[int, set[tuple[int, int]]] = {rank: set() for rank in usable}  # rank -> (holder before, block id)
    kept: dict[int, dict[tuple[str, int], int]] = {}
    transfers: dict[tuple[int, int], dict[int, list[tuple[str, int, int]]]] = {}
    for g, group_moves in moves.items():
        for mv in group_moves:
            if mv.mode != "kv":
                continue
            r, per_old, per_new = mv.request, max_tp // len(mv.source), max_tp // len(g)
            heads = []  # (holder before, after, head group before, after, its blocks) per head group of the pod
            for h in range(max_tp):
                m = _holder(mv.source, h, max_tp)
                heads.append((m, _holder(g, h, max_tp), h % per_old, h % per_new,
                              rank_tables[m][r.id][h % per_old][:-(-r.cached // bs)]))
            adds: dict[int, set[tuple[int, int]]] = {}
            for m, j, _, _, ids in heads:
                for rank in {m, j}:
                    adds.setdefault(rank, set()).update((m, b) for b in ids)
            if check and any(len(holding[x]) + len(new - holding[x]) > usable[x] for x, new in adds.items()):
                mv.mode = "recompute"
                continue
            for x, new in adds.items():
                holding[x] |= new
            for m, j, i, k, ids in heads:
                if m == j:
                    kept.setdefault(m, {})[r.id, i] = k
                    continue
                items = transfers.setdefault((m, j), {})
                for b, block in enumerate(ids):
                    items.setdefault(block, []).append((r.id, k, b))
    return _Blocks(kept, {pair: list(items.items()) for pair, items in transfers.items()})


def _holder(group: Group, head_group: int, max_tp: int) -> int:
    """The rank of `group` that holds a head group (of the pod's max_tp), and so its blocks."""
    return group[head_group // (max_tp // len(group))]


def _move_kv(engine: Engine, comm, region: Group, moves: dict[Group, list[_Move]], blocks: _Blocks):
    """Gives every migrating request its blocks in its new group, as `blocks` places them: what a rank keeps stays in
    place, what changes rank goes in rounds of all-to-alls of at most REGROUP_IN_FLIGHT / 2 of the pool each way (no
    second cache). Returns the new tables of this rank's requests, the bytes it sent, the most bytes one round
    buffered, and the requests whose blocks found no room here (KVFull: their entries stay None)."""
    rank, kv = engine.rank, engine.kv
    tables: dict[str, list[list[int | None]]] = {
        mv.request.id: [[None] * -(-mv.request.cached // kv.block_size) for _ in range(engine.max_tp // len(g))]
        for g, group_moves in moves.items() if rank in g for mv in group_moves if mv.mode == "kv"}
    outgoing = {pair: items for pair, items in blocks.transfers.items() if pair[0] == rank}
    kv.share([block for items in outgoing.values() for block, _ in items])  # held until sent
    kept = blocks.kept.get(rank, {})
    for rid, lists in engine.tables.items():  # then every other reference goes: room for what arrives
        for i, ids in enumerate(lists):
            if (rid, i) in kept:
                table = tables[rid][kept[rid, i]]
                table[:] = ids[:len(table)]
                ids = ids[len(table):]
            kv.release(ids)
    per_round = max(1, int(REGROUP_IN_FLIGHT / 2 * kv.num_blocks / max(len(region) - 1, 1)))  # sent, and received
    rounds = max((-(-len(items) // per_round) for items in blocks.transfers.values()), default=0)
    sent = buffered = 0
    lost: set[str] = set()
    for k in range(rounds):
        sends: list[torch.Tensor | None] = [None] * len(region)
        arriving: list[list[tuple[int, list]]] = [[] for _ in region]
        for (m, j), items in blocks.transfers.items():
            chunk = items[k * per_round:(k + 1) * per_round]
            if m == rank and chunk:
                ids = [block for block, _ in chunk]
                sends[region.index(j)] = kv.gather(ids)
                kv.release(ids)
                sent += sends[region.index(j)].nbytes
            if j == rank:
                arriving[region.index(m)] = chunk
        received = comm.all_to_all(sends)
        buffered = max(buffered, sum(t.nbytes for t in sends + received if t is not None))
        for chunk, flat in zip(arriving, received):
            if not chunk:
                continue
            try:
                ids = kv.allocate(len(chunk))
            except KVFull:  # the plan's bound did not hold: recompute these requests rather than fail the regroup
                lost |= {rid for _, users in chunk for rid, _, _ in users}
                continue
            kv.scatter(ids, flat)
            for new, (_, users) in zip(ids, chunk):
                kv.share([new] * (len(users) - 1))  # the requests that shared it on the sender share it here
                for rid, i, b in users:
                    tables[rid][i][b] = new
    return tables, sent, buffered, lost


def _fall_back(engine: Engine, region: Group, old_groups: list[Group], held, error: CommError, epoch: int,
               start: float, touched: bool) -> RegroupReport:
    rank = engine.rank
    dead = set(error.dead_ranks) | (set(engine.pool.dead_ranks()) & set(region))
    alive = [r for r in region if r not in dead]
    if held is None:  # the state never got shared: each group keeps its own requests
        held = {engine.group: (list(engine.running), list(engine.waiting))}
    keep_own = engine.group == (rank,) and not touched  # still the TP=1 replica it was, its blocks intact
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
    else:  # every request here is re-prefilled: no block is worth keeping
        engine.join((rank,))
        engine.running, engine.waiting = [], deque()
        engine.tables.clear()
        engine.kv.reset()
    for r in adopted:
        r.cached = 0
    engine.waiting.extendleft(reversed(adopted))
    return RegroupReport(epoch, rank, (rank,), "fallback", region, {"recompute": len(adopted)},
                         {"total": time.perf_counter() - start}, request_ids=_ids(engine),
                         dead_ranks=sorted(dead), error=str(error))
