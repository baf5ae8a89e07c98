"""One engine rank: a process per device (a GPU, or a CPU core), driven by commands from the pod's coordinator.

Only a group's leader reads commands; it hands them to the other members at the step boundary through the
group's communicator, so every member applies them at the same step. Events (steps, finished requests,
regroup reports, weight updates) go back to the coordinator on one queue.
"""

from __future__ import annotations

import os
import queue
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import BACKENDS, CommunicatorPool
from . import faults
from .costs import measure
from .engine import Engine
from .loader import load_model
from .model import Transformer
from .regroup import MIGRATION_MODES, regroup
from ..weightsync import WeightReceiver, WeightSyncError

IDLE_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 32  # sequences per TP=1 replica; a TP=t group holds t times as many
    max_seq: int = 2048  # prompt + generated tokens per sequence
    dtype: str = "float32"
    migration: str = "auto"  # auto | kv | recompute
    comm_backend: str = "auto"  # auto | shm | gloo | nccl
    comm_timeout: float = 60.0
    # Batch sizes of the decode profile per TP; () = the powers of two up to the pod's capacity, so that the
    # planner interpolates over the whole range a batch can take instead of extrapolating.
    profile_batches: tuple[int, ...] = ()
    threads: int = 1  # torch threads per rank on CPU
    device: str = "auto"  # auto (CUDA when there is a GPU per rank) | cuda | cpu

    def __post_init__(self):
        for name, ok, fix in (
            ("max_batch", self.max_batch >= 1, "use 1 or more"),
            ("max_seq", self.max_seq >= 2, "use 2 or more (prompt + generated tokens)"),
            ("dtype", self.dtype in ("float32", "bfloat16", "float16"), "use float32, bfloat16 or float16"),
            ("migration", self.migration in MIGRATION_MODES, f"use one of {MIGRATION_MODES}"),
            ("comm_backend", self.comm_backend in ("auto", *BACKENDS), f"use auto or one of {BACKENDS}"),
            ("threads", self.threads >= 1, "use 1 or more"),
            ("device", self.device in ("auto", "cuda", "cpu"), "use auto, cuda or cpu"),
        ):
            if not ok:
                raise ValueError(f"engine option {name}={getattr(self, name)!r} is invalid: {fix}")


def _powers_of_two(up_to: int) -> list[int]:
    return [1 << i for i in range(up_to.bit_length()) if 1 << i <= up_to] + [up_to]


def _device(rank: int, world: int, choice: str) -> torch.device:
    """One device per rank: a GPU each when there are enough of them (NCCL needs distinct GPUs), else CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and gpus < world:
        raise RuntimeError(f"engine option device='cuda' needs a GPU per rank: {world} ranks, {gpus} GPU(s); "
                           f"use fewer ranks or device='cpu'")
    if choice == "cpu" or gpus < world:
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def rank_main(rank: int, world: int, model_dir: str, opts: EngineOptions, init_method: str,
              commands: list, events, env: dict[str, str] | None = None) -> None:
    os.environ.update(env or {})
    try:
        torch.set_num_threads(opts.threads)
        device = _device(rank, world, opts.device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                                rank=rank, world_size=world)
        pool = CommunicatorPool.build(rank, world, backend=opts.comm_backend, timeout=opts.comm_timeout)
        with torch.inference_mode():  # the whole rank only ever runs inference
            cfg, weights = load_model(model_dir, getattr(torch, opts.dtype), device)
            if faults.active("weights.corrupt", rank):  # silent corruption of the heads this rank serves last
                weights["model.layers.0.self_attn.q_proj.weight"][-cfg.head_dim:] += 0.5
            model = Transformer(cfg, weights)
            engine = Engine(model, pool, max_batch=opts.max_batch, max_seq=opts.max_seq)
            tp_sizes = cfg.tp_sizes(world)
            capacity = opts.max_batch * max(tp_sizes)
            batches = sorted({b for b in opts.profile_batches or _powers_of_two(capacity) if b <= capacity})
            costs = measure(model, pool, tp_sizes, batches)
            events.put(("ready", rank, costs if rank == 0 else None, tp_sizes))
            _serve(engine, costs, opts, commands[rank], events)
        pool.close()
        dist.destroy_process_group()
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        raise


def _serve(engine: Engine, costs, opts: EngineOptions, commands, events) -> None:
    pending: list[tuple] = []
    receivers: dict[tuple, WeightReceiver] = {}  # the weight-sync group, joined once per (address, world, rank)
    flag = torch.zeros(1, device=engine.model.device)
    while True:
        batch: list[tuple] = []
        if engine.is_leader:
            try:
                pending.append(commands.get(timeout=0 if engine.has_work() or pending else IDLE_POLL_SECONDS))
                while True:
                    pending.append(commands.get_nowait())
            except queue.Empty:
                pass
            # A regroup changes who is in the group: it ends the batch of commands applied at this boundary.
            cut = next((i + 1 for i, c in enumerate(pending) if c[0] == "regroup"), len(pending))
            batch, pending = pending[:cut], pending[cut:]
        if engine.tp > 1:
            flag.fill_(len(batch))
            engine.comm.all_reduce_(flag)
            if flag.item():
                batch = engine.comm.broadcast_object(batch)
        for command in batch:
            if command[0] == "stop":
                return
            if command[0] == "add":
                engine.add(command[1])
            elif command[0] == "regroup":
                _, epoch, old, new, migration = command
                report = regroup(engine, old, new, epoch, costs, migration or opts.migration)
                if engine.is_leader:
                    events.put(("regrouped", report))
            elif command[0] == "weights":
                events.put(("weights", engine.rank, command[1], _receive_weights(engine, receivers, *command[1:])))
        if engine.has_work():
            stats = engine.step()
            if engine.is_leader:
                events.put(("step", engine.group, stats.batch, len(engine.waiting), stats.seconds, stats.tokens,
                            stats.prefill_tokens, stats.finished, [(r.id, len(r.output)) for r in engine.running]))


def _receive_weights(engine: Engine, receivers: dict, version: int, address: str, world: int, rank_offset: int,
                     backend: str) -> str | None:
    """Joins the weight broadcast of `version` (the coordinator sends it only while no request is in the pod);
    returns why the round was refused, or None once the replica holds the new weights."""
    if engine.has_work():  # the coordinator's invariant: new weights mid-sequence would corrupt those requests
        raise RuntimeError(f"weights of version {version} arrived while requests are generating")
    key = (address, world, rank_offset + engine.rank)
    if key not in receivers:
        receivers[key] = WeightReceiver(address, world, rank_offset + engine.rank, backend)
    try:
        receivers[key].receive(engine.model.w, version)
    except WeightSyncError as refused:
        return str(refused)
    return None
