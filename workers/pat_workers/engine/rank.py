"""One engine rank: a process per device (a GPU, or a CPU core), driven by commands from the pod's coordinator.

Only a group's leader reads commands; it hands them to the other members at the step boundary through the
group's communicator, so every member applies them at the same step. Events (steps, finished requests,
regroup reports, weight updates) go back to the coordinator on one queue.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from pat_operator.fit import DTYPE_BYTES, REGROUP_IN_FLIGHT, ModelShape, engine_working_bytes, read_shape
from pat_operator.layout import Layout, group_of

from .comm import BACKENDS, CommunicatorPool, nccl_env, process_group_options
from . import faults
from .config import ModelConfig
from .costs import measure
from .engine import Engine
from .kv import PagedKV
from .loader import load_model
from .model import Transformer
from .regroup import MIGRATION_MODES, regroup
from ..affinity import ENGINE_CPUS, pin
from ..weightsync import DeviceReceiver, WeightReceiver, WeightSyncError

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
    # auto (CUDA when there is a GPU per rank) | cuda | cpu | cuda-shared: tests only, every rank on GPU 0 with gloo
    # communicators staging through the host (NCCL refuses two ranks on one device; see _device)
    device: str = "auto"
    # The paged KV cache per rank: kv_cache_bytes when set, else what memory_utilization of the device's memory
    # leaves after the weights and the working memory (like vLLM's gpu_memory_utilization); never more blocks
    # than max_batch sequences of max_seq tokens could use.
    memory_utilization: float = 0.9
    kv_cache_bytes: int = 0
    reserved_bytes: int = 0  # of each device, for a colocated trainer rank: what it keeps between phases
    block_size: int = 16  # tokens per KV block
    compile_step: bool = False  # the decode step through torch.compile (Engine's compile_step)

    def __post_init__(self):
        for name, ok, fix in (
            ("max_batch", self.max_batch >= 1, "use 1 or more"),
            ("max_seq", self.max_seq >= 2, "use 2 or more (prompt + generated tokens)"),
            ("dtype", self.dtype in ("float32", "bfloat16", "float16"), "use float32, bfloat16 or float16"),
            ("migration", self.migration in MIGRATION_MODES, f"use one of {MIGRATION_MODES}"),
            ("comm_backend", self.comm_backend in ("auto", *BACKENDS), f"use auto or one of {BACKENDS}"),
            ("threads", self.threads >= 1, "use 1 or more"),
            ("device", self.device in ("auto", "cuda", "cpu", "cuda-shared"),
             "use auto, cuda or cpu (cuda-shared: tests only)"),
            ("comm_backend", self.device != "cuda-shared" or self.comm_backend in ("auto", "gloo"),
             "ranks sharing a GPU (device cuda-shared) communicate over gloo: use auto or gloo"),
            ("memory_utilization", 0 < self.memory_utilization <= 1, "use a fraction in (0, 1]"),
            ("kv_cache_bytes", self.kv_cache_bytes >= 0, "use 0 (from memory_utilization) or a byte count"),
            ("reserved_bytes", self.reserved_bytes >= 0, "use 0 or a byte count"),
            ("block_size", self.block_size >= 1 and not self.block_size & (self.block_size - 1),
             "use a power of two, e.g. 16"),
        ):
            if not ok:
                raise ValueError(f"engine option {name}={getattr(self, name)!r} is invalid: {fix}")


def _powers_of_two(up_to: int) -> list[int]:
    return [1 << i for i in range(up_to.bit_length()) if 1 << i <= up_to] + [up_to]


def _device(rank: int, world: int, choice: str, gpus: int) -> torch.device:
    """One device per rank, given the GPUs the pod sees: a GPU each (NCCL needs distinct GPUs), or CPU when there
    is none (choice auto) or choice is cpu. A pod that sees fewer GPUs than ranks fails here: falling back to CPU
    silently would run a GPU job orders of magnitude slower.

    choice cuda-shared, for tests on a machine with fewer GPUs than ranks (e.g. the regroup checks of make
    gpu-check): every rank on GPU 0, asked for by name, never a fallback. The ranks' memory checks each see the
    whole GPU (set kv_cache_bytes), and their groups run gloo (process_group_options(shared=True))."""
    if choice == "cpu" or (choice == "auto" and gpus == 0):
        return torch.device("cpu")
    if choice == "cuda-shared" and gpus:
        return torch.device("cuda", 0)
    if gpus == 0:
        raise RuntimeError(f"engine option device={choice!r}, but the generator pod has no GPU for its {world} engine "
                           f"rank(s): set generator.gpusPerPod to {world} (one GPU per rank), or use device 'cpu'")
    if gpus < world:
        raise RuntimeError(f"the generator pod has {gpus} GPU(s) for {world} engine ranks, and each rank needs its "
                           f"own GPU: set generator.gpusPerPod to {world} or generator.ranksPerPod to {gpus} "
                           f"(or device 'cpu' to run the ranks on CPU)")
    return torch.device("cuda", rank)


def kv_cache_blocks(opts: EngineOptions, cfg: ModelConfig, shape: ModelShape, world: int, free: int, total: int
                    ) -> int:
    """Blocks of this rank's paged KV cache (+1 scratch), from the device's free and total bytes before the
    weights are loaded, as `pat plan` counts them (pat_operator.fit). ValueError, naming the spec fields, when
    they cannot hold one maxSeq sequence."""
    if opts.max_seq > cfg.max_position_embeddings:
        raise ValueError(f"generator.maxSeq={opts.max_seq} is beyond the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}: lower generator.maxSeq")
    max_tp = max(cfg.tp_sizes(world))
    block = PagedKV.block_bytes(cfg, opts.block_size, cfg.num_kv_heads // max_tp, DTYPE_BYTES[opts.dtype])
    per_sequence = -(-opts.max_seq // opts.block_size) * max_tp  # one maxSeq sequence, every head
    if opts.kv_cache_bytes:
        budget, source, knob = opts.kv_cache_bytes, f"--kv-cache-bytes={opts.kv_cache_bytes}", "--kv-cache-bytes"
    else:
        weights = shape.params * DTYPE_BYTES[opts.dtype]
        working = int(engine_working_bytes(shape, opts.dtype, opts.max_batch, opts.max_seq, world))
        in_flight = REGROUP_IN_FLIGHT if world > 1 else 0.0  # a regroup's buffers beside the cache
        # A colocated trainer rank keeps reserved_bytes here between phases; it may not have allocated them yet.
        used = max(total - free, opts.reserved_bytes)
        budget = int((opts.memory_utilization * total - used - weights - working) / (1 + in_flight))
        source = (f"generator.memoryUtilization={opts.memory_utilization} of {_size(total)} ({_size(free)} free"
                  f"{f', {_size(opts.reserved_bytes)} kept for the trainer rank' if opts.reserved_bytes else ''}), "
                  f"less the weights ({_size(weights)}) and working memory ({_size(working)}),")
        knob = "generator.memoryUtilization"
    if budget // block < per_sequence:
        raise ValueError(f"{source} leaves {_size(max(budget, 0))} for the KV cache of an engine rank; one sequence "
                         f"of generator.maxSeq={opts.max_seq} tokens needs {_size(per_sequence * block)}: raise "
                         f"{knob} or lower generator.maxSeq")
    return min(budget // block, opts.max_batch * per_sequence) + 1


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


def _device_memory(device: torch.device, world: int) -> tuple[int, int]:
    """(free, total) bytes of the rank's device; on CPU the host's available memory, shared by the ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return available // world, available // world


def rank_main(rank: int, world: int, model_dir: str, opts: EngineOptions, init_method: str,
              commands: list, events, env: dict[str, str] | None = None, layout: Layout | None = None) -> None:
    """One engine rank: loads the model, measures the costs, joins its group of `layout` (default TP=1) and serves
    the commands of that group's leader until told to stop."""
    os.environ.update(env or {})
    try:
        torch.set_num_threads(opts.threads)
        pin(ENGINE_CPUS, rank)
        device = _device(rank, world, opts.device, torch.cuda.device_count())
        if device.type == "cuda":
            torch.cuda.set_device(device)
            os.environ.update(nccl_env(os.environ))
        else:
            _return_freed_memory()
        dist.init_process_group(init_method=init_method, rank=rank, world_size=world,
                                **process_group_options(device, opts.comm_timeout, opts.device == "cuda-shared"))
        pool = CommunicatorPool.build(rank, world, backend=opts.comm_backend, timeout=opts.comm_timeout,
                                      device=device)
        # The cache's size is known, and checked, before any device memory is taken.
        cfg, shape = ModelConfig.from_dir(model_dir), read_shape(Path(model_dir) / "config.json")
        kv_blocks = kv_cache_blocks(opts, cfg, shape, world, *_device_memory(device, world))
        with torch.inference_mode():  # the whole rank only ever runs inference
            cfg, weights = load_model(model_dir, getattr(torch, opts.dtype), device)
            if faults.active("weights.corrupt", rank):  # silent corruption of the heads this rank serves last
                weights["model.layers.0.self_attn.q_proj.weight"][-cfg.head_dim:] += 0.5
            model = Transformer(cfg, weights)
            tp_sizes = cfg.tp_sizes(world)
            capacity = opts.max_batch * max(tp_sizes)
            batches = sorted({b for b in opts.profile_batches or _powers_of_two(capacity) if b <= capacity})
            engine = Engine(model, pool, max_batch=opts.max_batch, max_seq=opts.max_seq, kv_blocks=kv_blocks,
                            block_size=opts.block_size, compile_step=opts.compile_step)
            costs = measure(engine, tp_sizes, batches)
            if layout is not None:  # the starting layout: nothing is cached yet, so a group is all it takes
                engine.join(group_of(layout, rank))
            events.put(("ready", rank, costs if rank == 0 else None, tp_sizes))
            _serve(engine, costs, opts, commands[rank], events)
        pool.close()
        dist.destroy_process_group()
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        raise


def _serve(engine: Engine, costs, opts: EngineOptions, commands, events) -> None:
    pending: list[tuple] = []
    # The weight-sync group, joined once per (address, world, rank), or the hand-over's connection per address.
    receivers: dict = {}
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
            elif command[0] in ("weights", "weights_device"):
                receive = _receive_weights if command[0] == "weights" else _take_weights
                events.put(("weights", engine.rank, command[1], receive(engine, receivers, *command[1:])))
            elif command[0] == "memory":
                if command[1]:
                    engine.acquire_memory()
                else:
                    engine.release_memory(weights=command[2])
                events.put(("memory", engine.rank, memory_bytes(engine.model.device)))
        if engine.has_work():
            stats = engine.step()
            if engine.is_leader:
                events.put(("step", engine.group, stats.batch, len(engine.waiting), stats.seconds, stats.tokens,
                            stats.prefill_tokens, stats.finished, [(r.id, len(r.output)) for r in engine.running],
                            stats.preempted, engine.kv_usage))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _return_freed_memory() -> None:
    """Allocations of 1 MiB or more get pages of their own (mmap), which free() gives back to the system. glibc's
    default threshold rises to the size of each such block freed, after which a KV pool released and taken again
    comes from the heap and stays in the process: its memory would never go back to a colocated trainer."""
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 1 << 20)


def memory_bytes(device: torch.device) -> int:
    """What the rank holds: the CUDA caching allocator's reserved bytes, or on CPU the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _receive_weights(engine: Engine, receivers: dict, version: int, address: str, world: int, rank_offset: int,
                     backend: str) -> str | None:
    """Joins the weight broadcast of `version` (the coordinator sends it only while no request is in the pod);
    returns why the round was refused, or None once the replica holds the new weights."""
    key = (address, world, rank_offset + engine.rank)
    return _update(engine, version, receivers, key,
                   lambda: WeightReceiver(address, world, rank_offset + engine.rank, backend))


def _take_weights(engine: Engine, receivers: dict, version: int, address: str, token: str) -> str | None:
    """As _receive_weights, from the trainer rank on this rank's device (placement colocated)."""
    return _update(engine, version, receivers, address, lambda: DeviceReceiver(address, engine.rank, token))


def _update(engine: Engine, version: int, receivers: dict, key, connect) -> str | None:
    if engine.has_work():  # the coordinator's invariant: new weights mid-sequence would corrupt those requests
        raise RuntimeError(f"weights of version {version} arrived while requests are generating")
    if key not in receivers:
        receivers[key] = connect()
    engine.model.reserve_weights()  # released ones (Engine.release_memory): the round writes every tensor
    try:
        receivers[key].receive(engine.model.w, version, engine.model.hf_shapes)
    except WeightSyncError as refused:
        return str(refused)
    finally:  # even a refused round may have written some weights
        engine.weights_changed()
    engine.weights_lost = False
    return None
