"""Run a function on several torch.distributed ranks, each in a fresh process (gloo, localhost)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from pat_workers.ports import free_port


def _rank_main(fn: Callable, rank: int, world: int, port: int, args: tuple, env: dict | None,
               timeout: float, conn: mp.connection.Connection) -> None:
    os.environ.update(env or {})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share few cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            result = (True, fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = (False, traceback.format_exc())
    # Plain pickle: Connection.send would share tensors through file descriptors (torch registers that
    # reduction), which the parent cannot open once this process has exited.
    try:
        payload = pickle.dumps(result)
    except Exception:
        payload = pickle.dumps((False, traceback.format_exc()))
    conn.send_bytes(payload)
    conn.close()
    # Skip interpreter shutdown: with torch loaded it takes about a second of CPU per rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120, env: dict | None = None) -> list:
    """fn(rank, world, *args) on `world` spawned processes after init_process_group("gloo"); returns
    their results in rank order, None for a rank that exited without one (killed, os._exit). Raises
    RuntimeError with the traceback of every rank that raised, TimeoutError after `timeout` seconds."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, readers = [], []
    for rank in range(world):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, rank, world, port, args, env, timeout, writer),
                        name=f"rank{rank}", daemon=True)
        p.start()
        writer.close()  # so that the reader sees EOF once the child is gone
        procs.append(p)
        readers.append(reader)
    results: dict[int, tuple[bool, Any] | None] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(results))
                raise TimeoutError(f"ranks {missing} gave no result within {timeout} s")
            pending = [r for r in range(world) if r not in results]
            mp.connection.wait([readers[r] for r in pending], timeout=remaining)
            for r in pending:
                if readers[r].poll():
                    try:
                        results[r] = pickle.loads(readers[r].recv_bytes())
                    except EOFError:  # exited without a result
                        results[r] = None
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for reader in readers:
            reader.close()
    failures = [f"rank {r} raised:\n{res[1]}" for r, res in sorted(results.items()) if res and not res[0]]
    if failures:
        raise RuntimeError("\n".join(failures))
    return [res[1] if res else None for _, res in sorted(results.items())]
