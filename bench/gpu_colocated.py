"""make gpu-check, the colocated part: an engine rank gives its GPU back and takes a new replica from the trainer rank
of its device (placement colocated), on one GPU.

Sections, each written to the JSON as soon as it ends; each starts where the one before left the engine, so the
first that fails (its traceback recorded) ends the run:
- model: an engine rank of a Llama-3.1-8B-shaped model (bf16, random weights made on the GPU, as bench/gpu_engine.py
  makes them), a one-rank pool, a KV pool of 4 GiB; and the process standing for the trainer rank (spawned now, so
  that it starts CUDA while this one decodes).
- sleep: memory_reserved (rank.memory_bytes, what a pod reports) awake after a short greedy decode (the step's memory
  and the captured graphs exist), asleep at level 1 (Engine.release_memory: the KV pool and the graphs), awake again
  (acquire_memory), asleep at level 2 (release_memory(weights=True): Transformer.release_weights too), and the
  seconds of each call. Targets: level 1 frees >= 0.9 x the KV pool (engine.kv.nbytes); level 2 >= 0.9 x (the pool
  + the weights: the bytes of their distinct storages).
- handover: the trainer rank (a spawned process, a DeviceSender) hands over version 1 through CUDA IPC and one
  staging bucket, making each tensor from a seed as it goes (never a second replica: the trainer's gather holds one
  full tensor at a time too), while the engine, asleep at level 2, takes it as a rank does (rank._take_weights:
  reserve_weights, DeviceReceiver.receive, weights_changed) and wakes (acquire_memory). The round's seconds and GB/s
  (the sender's making of the tensors included); this process's peak memory_reserved during it above its level-2
  bytes, against the weights + the sender's staging bucket (target: no more, i.e. no second copy here). Checked, and
  each check can fail: every tensor equals the sender's (made again here from the seed, one at a time: torch.equal,
  which a moved row fails where a sum would not); the greedy tokens of a few requests equal those of a fresh Engine
  on the same replica (nothing stale from the sleep) and differ from those before the hand-over (it changed the
  weights that generate).
- rounds: ten more rounds of level-2 sleep, hand-over (versions 2..11, each tensor checked) and wake with a short
  decode: memory_reserved awake after the last round minus after the first. Target: < 256 MiB (nothing leaks).
The JSON goes to bench/results/gpu-check-colocated.json (--out to change), with the engine's revision and the commit
(pat_workers.revision); a watchdog ends the run after --timeout seconds, leaving what was measured, and kills the
trainer rank. Exit status 1 when a section failed or a check did not hold (a tensor or a token), 3 when the watchdog
fired; the memory and speed targets are reported beside each number, pass or fail, and do not change it.

--smoke runs the same code on CPU in ~30 s: the test preset widened (hidden 512, intermediate 1536, vocab 1024: every
tensor but the norms 1 MiB or more, which get pages of their own, given back when freed, once
rank._return_freed_memory has run, as in the ranks), float32, a 64 MiB KV pool; memory is the resident set, the peak
its high-water mark (VmHWM), the staging buffer shared memory. On CPU level 1 also frees the weights' copies
prepacked for oneDNN (as much as the GEMM weights), which a wake packs again inside the round; it writes only with
--out.
  python bench/gpu_colocated.py            # needs a CUDA GPU; well under a minute on an H100 (an estimate: not run yet)
  python bench/gpu_colocated.py --smoke --out /tmp/colocated.json
"""

from __future__ import annotations

import argparse
import gc
import math
import secrets
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.multiprocessing

from gpu_engine import LLAMA_31, Clock, OneRankPool, Results, watchdog
from pat_operator import fit
from pat_workers.engine import rank as rank_module
from pat_workers.engine.config import ModelConfig
from pat_workers.engine.engine import Engine, Request
from pat_workers.engine.kv import PagedKV
from pat_workers.engine.model import Transformer
from pat_workers.engine.sampling import SamplingParams
from pat_workers.engine.tiny import fresh, random_weights
from pat_workers.revision import stamp
from pat_workers.weightsync import HANDOVER_BUCKET_BYTES, DeviceReceiver, DeviceSender, buckets, handover_address

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "gpu-check-colocated.json"
SMOKE = dict(fit.PRESETS["test"], hidden_size=512, intermediate_size=1536, vocab_size=1024)
KV_POOL_BYTES = {"cuda": 4 << 30, "cpu": 64 << 20}
ROUNDS = 10  # after the hand-over section's
MAX_SEQ = 256  # the requests' prompt + tokens fit
TARGETS = {"level1_drop_of_pool": 0.9, "level2_drop_of_pool_and_weights": 0.9,
           "handover_peak_above_asleep_of_weights_and_staging": 1.0, "awake_growth_bytes": 256 << 20}


# -- the replicas a hand-over sends --------------------------------------------------------------------------------
def replica_tensor(name: str, shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype
                   ) -> torch.Tensor:
    """Tensor `name` of the replica of `seed`, made alone (a generator of its own), at random_weights' scale: norms
    near 1, the embedding's entries of unit variance, a linear layer's outputs too (1/sqrt(its inputs))."""
    # 32 bits: the CPU generator (mt19937) keeps no more of a seed
    g = torch.Generator(device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    t = torch.randn(shape, generator=g, device=device, dtype=dtype)
    if name.endswith("norm.weight"):
        return t.mul_(0.1).add_(1.0)
    return t if name == "model.embed_tokens.weight" else t.mul_(shape[-1] ** -0.5)


def mismatched(weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], seed: int) -> list[str]:
    """The tensors of `weights` that differ from the replica of `seed`, made again one at a time: [] when the
    hand-over wrote every value where it belongs. `shapes`: as sent (the engine holds q/k/v and gate/up as views
    [chunks, rows, hidden] of its fused tensors, which the receiver fills in the sent order)."""
    wrong = []
    for name in sorted(shapes):
        held = weights[name]
        sent = replica_tensor(name, shapes[name], seed, held.device, held.dtype)
        if not torch.equal(held, sent.view_as(held)):
            wrong.append(name)
    return wrong


def trainer_rank(address: str, token: str, shapes: dict[str, tuple[int, ...]], versions: int, device_name: str,
                 dtype_name: str) -> None:
    """The trainer rank of the device (a spawned process): hands over versions 1..versions, version v's tensors made
    from seed v as they are sent."""
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    sender = DeviceSender(address, 0, token)
    try:
        for version in range(1, versions + 1):
            tensors = ((name, replica_tensor(name, shapes[name], version, device, dtype)) for name in sorted(shapes))
            sender.send(shapes, tensors, version, agree=lambda refused: int(refused))  # the only trainer rank
    finally:
        sender.close()


def staging_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """The sender's staging buffer: its largest bucket (a tensor larger than a bucket goes alone)."""
    tensors = [[name, shapes[name]] for name in sorted(shapes)]
    return dtype.itemsize * max(sum(math.prod(tensors[i][1]) for i in bucket)
                                for bucket in buckets(tensors, dtype.itemsize, HANDOVER_BUCKET_BYTES))


# -- memory ------------------------------------------------------------------------------------------------------
def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the resident set's high-water mark starts again


def peak_bytes(device: torch.device) -> int:
    """The most rank.memory_bytes was since reset_peak: memory_reserved's peak, or on CPU the resident set's."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) * 1024


# -- the pod -----------------------------------------------------------------------------------------------------
class Pod:
    """The engine rank under test, in this process, and the trainer rank of its device, a spawned child."""

    def __init__(self, device: torch.device, smoke: bool):
        self.device, self.smoke, self.clock = device, smoke, Clock(device)
        self.token = secrets.token_hex(8)
        self.address = handover_address(self.token)
        self.receivers: dict = {}  # as rank._serve keeps them: the hand-over's connection, by address
        self.engine: Engine | None = None
        self.trainer = None  # build() sets it, the engine, its model, shapes and requests

    def new_engine(self) -> Engine:
        return Engine(self.model, OneRankPool(), max_batch=8, max_seq=MAX_SEQ, kv_blocks=self.kv_blocks)

    def memory(self) -> int:
        return rank_module.memory_bytes(self.device)

    def collect(self) -> None:
        """Frees what only reference cycles hold (a dropped Engine: decode_fn is a bound method of its own)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def timed(self, fn) -> float:
        self.clock.sync()
        start = time.perf_counter()
        fn()
        self.clock.sync()
        return time.perf_counter() - start

    def take(self, version: int) -> float:
        """A round as a rank takes it (the receiver already connected): its seconds."""
        start = time.perf_counter()
        refused = rank_module._take_weights(self.engine, self.receivers, version, self.address, self.token)
        self.clock.sync()
        if refused:
            raise RuntimeError(f"hand-over of version {version} refused: {refused}")
        return time.perf_counter() - start

    def generate(self, engine: Engine | None = None) -> list[list[int]]:
        """Greedy tokens of the requests, run to the end (the engine holds none after)."""
        engine = engine or self.engine
        requests = fresh(self.requests)
        engine.add(requests)
        while engine.has_work():
            engine.step()
        return [r.output for r in requests]

    def close(self) -> int | None:
        """The trainer rank's exit status: it ends once the last round is received; else its connection closes."""
        for receiver in self.receivers.values():
            receiver.conn.close()
        if self.trainer is None:
            return None
        self.trainer.join(10)
        if self.trainer.is_alive():
            self.trainer.kill()
            self.trainer.join()
        return self.trainer.exitcode


# -- sections ----------------------------------------------------------------------------------------------------
def build(result: dict, pod: Pod) -> None:
    hf = fit.hf_config("llama", **(SMOKE if pod.smoke else LLAMA_31))
    dtype = torch.float32 if pod.smoke else torch.bfloat16
    cfg = ModelConfig.from_hf(hf)
    pod.model = Transformer(cfg, random_weights(hf, 0, pod.device, dtype))
    pod.shapes = pod.model.hf_shapes
    # Distinct storages: q/k/v and gate/up are views of fused tensors.
    pod.weights_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                             for t in pod.model.w.values()}.values())
    pod.kv_blocks = KV_POOL_BYTES[pod.device.type] // PagedKV.block_bytes(cfg, 16, cfg.num_kv_heads, dtype.itemsize)
    pod.engine = pod.new_engine()
    g = torch.Generator().manual_seed(0)
    pod.requests = [Request(f"r{i}", torch.randint(cfg.vocab_size, (16 + 8 * i,), generator=g).tolist(),
                            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for i in range(4)]
    pod.trainer = torch.multiprocessing.get_context("spawn").Process(
        target=trainer_rank, args=(pod.address, pod.token, pod.shapes, 1 + ROUNDS, str(pod.device),
                                   str(dtype).removeprefix("torch.")), daemon=True)
    pod.trainer.start()
    result.update(params=sum(math.prod(s) for s in pod.shapes.values()), weights_bytes=pod.weights_bytes,
                  kv_pool_bytes=pod.engine.kv.nbytes, dtype=str(dtype), tensors=len(pod.shapes),
                  staging_bytes=staging_bytes(pod.shapes, dtype))


def sleep(result: dict, pod: Pod) -> None:
    engine = pod.engine
    pod.greedy_before = pod.generate()
    awake = pod.memory()
    level1_s = pod.timed(engine.release_memory)
    level1 = pod.memory()
    acquire_s = pod.timed(engine.acquire_memory)
    reacquired = pod.memory()
    level2_s = pod.timed(lambda: engine.release_memory(weights=True))
    level2 = pod.memory()
    pool = engine.kv.nbytes
    drop1, drop2 = awake - level1, reacquired - level2
    result.update(awake_bytes=awake, level1_bytes=level1, reacquired_bytes=reacquired, level2_bytes=level2,
                  level1_drop=drop1, level1_expected=pool, level1_fraction=round(drop1 / pool, 4),
                  level2_drop=drop2, level2_expected=pool + pod.weights_bytes,
                  level2_fraction=round(drop2 / (pool + pod.weights_bytes), 4),
                  pass_level1=drop1 >= TARGETS["level1_drop_of_pool"] * pool,
                  pass_level2=drop2 >= TARGETS["level2_drop_of_pool_and_weights"] * (pool + pod.weights_bytes),
                  release_level1_s=round(level1_s, 4), acquire_s=round(acquire_s, 4),
                  release_level2_s=round(level2_s, 4))
    print(f"sleep: level 1 frees {drop1 / 2**20:.0f} MiB of a {pool / 2**20:.0f} MiB pool "
          f"({result['level1_fraction']:.0%}) in {level1_s:.3f} s; level 2 {drop2 / 2**20:.0f} MiB of "
          f"{(pool + pod.weights_bytes) / 2**20:.0f} MiB ({result['level2_fraction']:.0%}) in {level2_s:.3f} s; "
          f"acquire {acquire_s:.3f} s", flush=True)


def handover(result: dict, pod: Pod) -> None:
    engine, staging = pod.engine, staging_bytes(pod.shapes, pod.model.dtype)
    # Connected first: the trainer rank listens once its process has started, which is not the round's time.
    pod.receivers[pod.address] = DeviceReceiver(pod.address, 0, pod.token, timeout=60)
    asleep = pod.memory()
    reset_peak(pod.device)
    seconds = pod.take(1)
    peak = peak_bytes(pod.device)
    wake_s = pod.timed(engine.acquire_memory)
    wrong = mismatched(pod.model.w, pod.shapes, 1)
    after = pod.generate()
    fresh_engine = pod.new_engine()
    reference = pod.generate(fresh_engine)
    del fresh_engine
    pod.collect()
    growth, ceiling = peak - asleep, pod.weights_bytes + staging
    result.update(round_s=round(seconds, 4), gb_per_s=round(pod.weights_bytes / seconds / 1e9, 2),
                  wake_s=round(wake_s, 4), asleep_bytes=asleep, peak_bytes=peak, peak_above_asleep=growth,
                  weights_and_staging_bytes=ceiling, peak_fraction=round(growth / ceiling, 4),
                  pass_peak=growth <= TARGETS["handover_peak_above_asleep_of_weights_and_staging"] * ceiling,
                  mismatched=wrong, greedy_equal_fresh_engine=after == reference,
                  greedy_changed=after != pod.greedy_before)
    result["pass"] = not wrong and result["greedy_equal_fresh_engine"] and result["greedy_changed"]
    print(f"handover: {pod.weights_bytes / 2**30:.2f} GiB in {seconds:.3f} s ({result['gb_per_s']} GB/s), wake "
          f"{wake_s:.3f} s; peak {growth / 2**20:.0f} MiB above asleep, of weights + staging {ceiling / 2**20:.0f} "
          f"MiB; {len(wrong)} tensors mismatched, greedy tokens equal a fresh engine's: "
          f"{result['greedy_equal_fresh_engine']}, changed: {result['greedy_changed']}", flush=True)


def rounds(result: dict, pod: Pod) -> None:
    engine, awake, seconds, wrong = pod.engine, [], [], 0
    for version in range(2, 2 + ROUNDS):
        engine.release_memory(weights=True)
        seconds.append(pod.take(version))
        engine.acquire_memory()
        pod.generate()
        awake.append(pod.memory())
        wrong += len(mismatched(pod.model.w, pod.shapes, version))
    growth = awake[-1] - awake[0]
    result.update(rounds=ROUNDS, awake_bytes=awake, growth_bytes=growth,
                  pass_growth=growth < TARGETS["awake_growth_bytes"], mismatched=wrong,
                  handover_s=[round(s, 4) for s in seconds],
                  gb_per_s_median=round(pod.weights_bytes / statistics.median(seconds) / 1e9, 2))
    result["pass"] = not wrong
    print(f"rounds: {ROUNDS} level-2 sleeps and hand-overs, awake memory grew {growth / 2**20:.1f} MiB (target < "
          f"{TARGETS['awake_growth_bytes'] >> 20} MiB); median {result['gb_per_s_median']} GB/s; {wrong} tensors "
          f"mismatched", flush=True)


SECTIONS = {"model": build, "sleep": sleep, "handover": handover, "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, the widened test preset, float32, seconds")
    ap.add_argument("--out", type=Path, help=f"write the JSON here (default on a GPU: {RESULTS})")
    ap.add_argument("--timeout", type=float, default=90, help="seconds before the watchdog ends the run")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_colocated: no CUDA device here; this check measures a GPU and needs one (--smoke runs its code on "
              "CPU).", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the trainer rank has the other core
        rank_module._return_freed_memory()  # as the ranks do: freed blocks of 1 MiB or more leave the resident set
    results = Results(args.out or (None if args.smoke else RESULTS), stamp({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "smoke": args.smoke, "targets": TARGETS, "command": "python bench/gpu_colocated.py " + " ".join(sys.argv[1:])}))
    watchdog(results, args.timeout)
    pod = Pod(device, args.smoke)
    data = results.data
    try:
        with torch.inference_mode():  # as in a rank: the weights are inference tensors, written in place
            for name, fn in SECTIONS.items():
                results.section(name, fn, pod)
                if data[name]["status"] == "error":
                    break
    finally:
        data["trainer_exitcode"] = pod.close()
    failed = [name for name in SECTIONS if data.get(name, {}).get("status") != "done"]
    failed += [f"{name} (correctness)" for name in ("handover", "rounds")
               if data.get(name, {}).get("status") == "done" and not data[name]["pass"]]
    if data["trainer_exitcode"] != 0:
        failed.append(f"trainer rank (exit {data['trainer_exitcode']})")
    return results.finish(failed)


if __name__ == "__main__":
    sys.exit(main())
