"""Communicators of one pod: shared memory and gloo, over every block of the TP hierarchy."""

import os
import time

import pytest
import torch

from pat_workers.engine.comm import (CommError, CommunicatorPool, ShmCommunicator, SoloCommunicator,
                                     TorchCommunicator, measure_link_bandwidth)
from tests.engine.multiproc import run_ranks

pytestmark = pytest.mark.slow


def _member_tensor(rank: int, block: tuple, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + len(block) * 10 + block[0])
    return torch.randn(shape, generator=g)


def _expected_sum(block: tuple, shape) -> torch.Tensor:
    parts = [_member_tensor(r, block, shape) for r in block]
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def _sends(rank: int, block: tuple) -> list:
    """What `rank` sends to each member of `block` in all_to_all: uneven sizes, mixed dtypes, some None."""
    sends = []
    for i, dst in enumerate(block):
        if (rank + dst) % 3 == 2:
            sends.append(None)
        elif dst % 2:
            sends.append(torch.arange(rank * 7 + dst * 3, dtype=torch.int64) * 100 + rank * 10 + dst)
        else:
            sends.append(torch.full((rank * 5 + dst + 1,), rank * 10 + dst, dtype=torch.bfloat16))
    return sends


def _exercise_pool(rank: int, world: int, backend: str, capacity: int) -> dict:
    pool = CommunicatorPool.build(rank, world, backend=backend, timeout=30.0, capacity=capacity)
    assert pool.world == world and pool.rank == rank
    assert pool.sizes == (1, 2, 4)
    assert pool.blocks(2) == [(0, 1), (2, 3)] and pool.blocks(4) == [(0, 1, 2, 3)]
    assert sorted(pool.pids) == list(range(world)) and pool.pids[rank] == os.getpid()
    assert pool.dead_ranks() == frozenset()
    with pytest.raises(KeyError, match="not a TP block"):
        pool.get((1, 2))
    with pytest.raises(KeyError, match="not a member"):
        pool.get((2, 3) if rank < 2 else (0, 1))
    hot = ShmCommunicator if backend == "shm" else TorchCommunicator
    large = capacity // 4 * 2 + 123  # float32 elements: three chunks, the last partial
    out = {}
    for t in pool.sizes:
        for block in pool.blocks(t):
            if rank not in block:
                continue
            comm = pool.get(block)
            assert comm.ranks == block and comm.rank == rank and comm.size == t and comm.index == block.index(rank)
            assert isinstance(comm, SoloCommunicator if t == 1 else hot)
            assert isinstance(pool.fallback(block), SoloCommunicator if t == 1 else TorchCommunicator)
            res = out[block] = {}
            for name, shape in (("small", (3, 5)), ("large", (large,))):
                x = _member_tensor(rank, block, shape)
                assert comm.all_reduce_(x) is x
                res[name] = x
                res[name + "_expected"] = _expected_sum(block, shape)
            base = torch.stack([_member_tensor(rank, block, (4,)), torch.zeros(4)], dim=1)
            strided = base[:, 0]  # not contiguous: reduced in place through a copy
            comm.all_reduce_(strided)
            res["strided"] = base[:, 0].clone()
            res["strided_expected"] = _expected_sum(block, (4,))
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                x = torch.arange(6, dtype=dtype).reshape(2, 3) + rank
                got = comm.all_gather(x)
                assert [g.shape for g in got] == [x.shape] * t and all(g.dtype == dtype for g in got)
                assert all(torch.equal(g, torch.arange(6, dtype=dtype).reshape(2, 3) + r) for g, r in zip(got, block))
            big = torch.arange(large, dtype=torch.float32) * (rank + 1)
            assert all(torch.equal(g, torch.arange(large, dtype=torch.float32) * (r + 1))
                       for g, r in zip(comm.all_gather(big), block))
            assert comm.all_gather_object({"rank": rank, "pad": "x" * rank * 3}) == [
                {"rank": r, "pad": "x" * r * 3} for r in block]
            huge = bytes(range(256)) * (capacity // 128)  # pickles to several buffers
            assert comm.all_gather_object(huge if rank == block[-1] else rank)[-1] == huge
            for src in range(t):
                obj = ("from", block[src], list(range(block[src] + 1)))
                assert comm.broadcast_object(obj if comm.index == src else None, src=src) == obj
            assert comm.broadcast_object(huge if comm.index == t - 1 else None, src=t - 1) == huge
            sends = _sends(rank, block)
            got = comm.all_to_all(sends)
            assert got[comm.index] is sends[comm.index]
            for j, sender in enumerate(block):
                want = _sends(sender, block)[comm.index]
                if want is None:
                    assert got[j] is None, (block, sender)
                else:
                    assert got[j].dtype == want.dtype and torch.equal(got[j], want), (block, sender)
            # Streams longer than one buffer, uneven across members.
            sends = [torch.full((capacity // 8 * (r + 1) + r,), float(rank)) for r in block]
            got = comm.all_to_all(sends)
            assert all(torch.equal(g, torch.full((capacity // 8 * (rank + 1) + rank,), float(s)))
                       for g, s in zip(got, block))
            comm.barrier()
    bandwidth = measure_link_bandwidth(pool.get(pool.blocks(world)[0]), nbytes=1 << 20, repeats=2)
    pool.close()
    return {"out": out, "bandwidth": bandwidth}


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_pool_collectives(backend):
    results = run_ranks(_exercise_pool, 4, backend, 64 << 10)
    for t in (1, 2, 4):
        for i in range(4 // t):
            block = tuple(range(i * t, (i + 1) * t))
            first = results[block[0]]["out"][block]
            for name in ("small", "large", "strided"):
                if backend == "shm" or t == 1:  # shm sums in member order, exactly like _expected_sum
                    assert torch.equal(first[name], first[name + "_expected"]), (block, name)
                else:
                    torch.testing.assert_close(first[name], first[name + "_expected"])
                for r in block:  # bitwise identical on every member
                    assert torch.equal(results[r]["out"][block][name], first[name]), (block, name, r)
    bandwidths = [r["bandwidth"] for r in results]
    assert bandwidths[0] > 0 and bandwidths == [bandwidths[0]] * 4


def test_solo_is_identity():
    comm = SoloCommunicator(3)
    x = torch.ones(2)
    assert (comm.ranks, comm.rank, comm.size, comm.index) == ((3,), 3, 1, 0)
    assert comm.all_reduce_(x) is x and comm.all_gather(x)[0] is x
    assert comm.all_gather_object("a") == ["a"] and comm.broadcast_object("b") == "b"
    assert comm.all_to_all([x])[0] is x and comm.barrier() is None
    assert measure_link_bandwidth(comm) == float("inf")


def _die_before_all_reduce(rank: int, world: int):
    pool = CommunicatorPool.build(rank, world, backend="shm", timeout=60.0)
    comms = {"shm": pool.get((0, 1)), "gloo": pool.fallback((0, 1))}
    for comm in comms.values():
        comm.barrier()
    if rank == 1:
        os._exit(1)
    out = {}
    for name, comm in comms.items():
        start = time.monotonic()
        try:
            comm.all_reduce_(torch.ones(16))
        except CommError as e:
            out[name] = time.monotonic() - start, e.dead_ranks
    return out, pool.dead_ranks()


def test_dead_peer_is_reported():
    (failures, pool_dead), dead = run_ranks(_die_before_all_reduce, 2, timeout=60)
    assert dead is None and pool_dead == {1}
    assert sorted(failures) == ["gloo", "shm"]
    for elapsed, dead_ranks in failures.values():
        assert dead_ranks == {1} and elapsed < 5.0


def _peer_sleeps(rank: int, world: int, backend: str):
    pool = CommunicatorPool.build(rank, world, backend=backend, timeout=0.5)
    comm = pool.get((0, 1))
    if rank == 1:
        time.sleep(1.5)
        return None
    start = time.monotonic()
    try:
        comm.all_reduce_(torch.ones(16))
    except CommError as e:
        failed = time.monotonic() - start, e.dead_ranks
    # The communicator stays failed: its sequence numbers no longer match the peer's.
    with pytest.raises(CommError):
        comm.barrier()
    return failed


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_timeout_without_dead_peer(backend):
    """A peer alive but stalled: the collective fails after the timeout instead of hanging."""
    (elapsed, dead_ranks), _ = run_ranks(_peer_sleeps, 2, backend)
    assert dead_ranks == frozenset()
    assert 0.45 <= elapsed < 1.5


def _latency(rank: int, world: int, iters: int) -> dict:
    pool = CommunicatorPool.build(rank, world, backend="shm")
    x = torch.ones(4096)  # 16 KiB
    out = {}
    for name, comm in (("shm", pool.get((0, 1))), ("gloo", pool.fallback((0, 1)))):
        for _ in range(iters // 10):
            comm.all_reduce_(x)
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce_(x)
        out[name] = (time.perf_counter() - start) / iters
    pool.close()
    return out


def test_all_reduce_latency():
    results = run_ranks(_latency, 2, 500)
    shm, gloo = (max(r[name] for r in results) for name in ("shm", "gloo"))
    print(f"\n16 KiB float32 all_reduce on 2 ranks: shm {shm * 1e6:.1f} us, gloo {gloo * 1e6:.1f} us")
