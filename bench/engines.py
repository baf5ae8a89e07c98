"""This project's engine against vLLM on the same ranks, the same model and the same long-tailed batch.

Layouts, each generating every sequence of the batch to its target length (greedy, ignore_eos):
  vllm 2xTP1   two vLLM OpenAI servers, one core each (VLLM_CPU_OMP_THREADS_BIND "0" and "1"); request i goes to
               server i % 2, as LocalGenerator.submit spreads a batch over its replicas (least loaded, ties to the
               first: round robin by request index)
  vllm TP2     one vLLM server with tensor parallelism 2 over both cores (VLLM_CPU_OMP_THREADS_BIND "0|1")
  pat 2xTP1, pat TP2, pat adaptive   this engine as bench/tail.py runs it (fixed DP, fixed TP, the planner)

The batch, the model and the engine's options come from bench/tail.py (`requests`, `model_and_options`: a cached
random Llama of --preset in an HF directory, which vLLM loads through its own loader as LlamaForCausalLM; lognormal
target lengths, 16-token prompts of token ids). vLLM gets the prompts as token ids on /v1/completions (max_tokens =
the target length, ignore_eos, temperature 0), all at once and concurrently so that it batches them; generation
seconds run from the first request sent to the last response, after one warm-up request per server. Server starts
are timed apart. Each repeat runs vLLM then this engine, the next one the other way round (drift favours no one);
every vLLM run gets fresh servers, and this engine's ranks stay up (idle) while vLLM runs. vLLM runs in its own
venv (scripts/vllm-venv.sh; PAT_VLLM_PYTHON or --vllm-python for another), float32, --enforce-eager, 1 GiB of KV
cache, prefix caching off (this engine has none; repeats would hit it).

Prints a table and, last, one JSON line (`pat_adaptive_over_vllm_best`: adaptive's seconds over the faster vLLM
layout's; `pat_best_fixed_over_vllm_best`: this engine's faster fixed layout over it; targets <= 1.10 both), with
bench/weight_sync.py's keys after the runs (a pod of each engine receiving the same weights: `vllm_weight_sync_over_pat`
<= 1.5, `vllm_weight_sync_disk_bytes` 0), then bench/vllm_adaptive.py's (a vLLM pod with adaptive TP against the
same pod at each fixed layout: `vllm_adaptive_over_vllm_best` <= 1.03). Not a test: it measures. About 11 minutes
on 2 cores (5 vLLM starts of ~23 s, then 4 pods); --quick about 5 minutes.
  python bench/engines.py            # 32 sequences, cap 512, 2 runs per layout
  python bench/engines.py --quick    # 8 sequences, cap 64
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from pat_operator.layout import uniform
from pat_workers.engine.engine import Request
from pat_workers.engine.generator import LocalGenerator
from pat_workers.engine.sampling import SamplingParams
from pat_workers.engine.tiny import PRESETS
from pat_workers.ports import free_port
from pat_workers.sim.lengths import lognormal_lengths
from tail import medians, model_and_options, planner_inputs, requests, run_alternating
from vllm_adaptive import measure as measure_vllm_adaptive
from weight_sync import measure as measure_weight_sync, vllm_python

SERVED_NAME = "bench"
START_TIMEOUT = 300.0


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when the bench dies, even by SIGKILL (Linux), so no server outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Server:
    """One vLLM OpenAI server, a subprocess in its own process group (stopped with the whole group)."""

    def __init__(self, python: str, model_dir: Path, tp: int, bind: str, max_model_len: int, seed: int, log: Path):
        self.port, self.log = free_port(), log
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=bind)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--tensor-parallel-size", str(tp), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", str(max_model_len), "--seed", str(seed), "--no-enable-prefix-caching"]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            tail = "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-30:])
            raise RuntimeError(f"vLLM server exited with {self.proc.returncode} while starting; log {self.log}:\n"
                               f"{tail}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def itl(self) -> tuple[float, int]:
        """The server's inter-token latency histogram so far: (sum of seconds, count of tokens)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        total, count = 0.0, 0
        for line in text.splitlines():
            if line.startswith("vllm:inter_token_latency_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:inter_token_latency_seconds_count"):
                count += int(float(line.rsplit(" ", 1)[1]))
        return total, count

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # workers left in the group after the server itself exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()


def start_servers(specs: list[tuple[int, str]], python: str, model_dir: Path, max_model_len: int, seed: int,
                  logdir: Path, name: str) -> tuple[list[Server], float]:
    """Starts the servers (tp, bind) at once and waits until all answer /health; the seconds that took."""
    t0 = time.perf_counter()
    servers: list[Server] = []
    try:
        for i, (tp, bind) in enumerate(specs):
            servers.append(Server(python, model_dir, tp, bind, max_model_len, seed, logdir / f"{name}-{i}.log"))
        pending = list(servers)
        while pending:
            if time.perf_counter() - t0 > START_TIMEOUT:
                raise RuntimeError(f"vLLM servers not up after {START_TIMEOUT:.0f} s; logs in {logdir}")
            pending = [s for s in pending if not s.ready()]
            time.sleep(0.25)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers, time.perf_counter() - t0


async def _complete(session: aiohttp.ClientSession, url: str, r: Request) -> list[int]:
    body = {"model": SERVED_NAME, "prompt": r.prompt, "max_tokens": r.params.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "seed": 0, "return_token_ids": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} {r.id}: HTTP {resp.status}: {(await resp.text())[:500]}")
        choice = (await resp.json())["choices"][0]
    tokens = choice.get("token_ids") or []
    if len(tokens) != r.params.max_tokens:
        raise RuntimeError(f"{r.id}: vLLM returned {len(tokens)} tokens, asked {r.params.max_tokens} "
                           f"(finish_reason {choice.get('finish_reason')})")
    return tokens


async def _generate(urls: list[str], reqs: list[Request]) -> tuple[float, dict[str, list[int]]]:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(_complete(session, urls[i % len(urls)], r) for i, r in enumerate(reqs)))
        seconds = time.perf_counter() - t0
    return seconds, {r.id: out for r, out in zip(reqs, outs)}


def run_vllm(name: str, specs: list[tuple[int, str]], python: str, model_dir: Path, max_model_len: int,
             batch: list[Request], seed: int, logdir: Path) -> dict:
    """One run of the batch on fresh servers (started, warmed up with one request each, stopped)."""
    servers, start_s = start_servers(specs, python, model_dir, max_model_len, seed, logdir, name.replace(" ", "-"))
    try:
        urls = [s.url for s in servers]
        warm = [Request("warm-up", batch[0].prompt, SamplingParams(max_tokens=8, ignore_eos=True))]
        for url in urls:
            asyncio.run(_generate([url], warm))
        before = [s.itl() for s in servers]
        seconds, outputs = asyncio.run(_generate(urls, batch))
        after = [s.itl() for s in servers]
    finally:
        for s in servers:
            s.stop()
    print(f"  {name:13s} {seconds:7.2f} s  ({len(servers)} server(s) up in {start_s:.1f} s)", flush=True)
    count = sum(a[1] - b[1] for a, b in zip(after, before))
    return {"seconds": seconds, "start_s": start_s, "outputs": outputs,
            "itl": (sum(a[0] - b[0] for a, b in zip(after, before)), count)}


def token_step_ms(results) -> float:
    """This engine's decode step time as a generated token sees it (each decode step weighted by its batch): the
    counterpart of vLLM's mean inter-token latency."""
    steps = [s for r in results for s in r.steps if s.batch and not s.prefill_tokens]
    return 1e3 * sum(s.seconds * s.batch for s in steps) / max(sum(s.batch for s in steps), 1)


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> tuple[int, float]:
    """Sequences identical in a and b, and the mean fraction of each sequence's tokens before the first difference."""
    same, prefix = 0, 0.0
    for rid, x in a.items():
        y = b[rid]
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += x == y
        prefix += n / max(len(x), 1)
    return same, prefix / max(len(a), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 sequences, cap 64, 1 run: well under 2 minutes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cap", type=int, default=512, help="response length cap (tokens)")
    ap.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each layout: vLLM first, then this engine; the other way round the next time")
    ap.add_argument("--min-gain", type=float, default=0.1, help="planner margin, as in bench/tail.py")
    ap.add_argument("--model-dir", type=Path, help="default: a cached random model of --preset")
    ap.add_argument("--vllm-python", default=os.environ.get("PAT_VLLM_PYTHON"),
                    help="the vLLM venv's python (default: scripts/vllm-venv.sh's)")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.cap, args.repeats = 8, 64, 1
    world = 2
    lengths = lognormal_lengths(args.batch, args.cap, args.seed)
    model_dir, cfg, options = model_and_options(args.preset, args.seed, args.model_dir, lengths, world)
    total_tokens = sum(lengths)
    python = vllm_python(args.vllm_python)
    print(f"model: {args.preset} (hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}, "
          f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} "
          f"KV heads, vocab {cfg['vocab_size']}), float32, {world} cores")
    print(f"batch: {len(lengths)} sequences, lengths min {min(lengths)} / mean {total_tokens / len(lengths):.0f} / "
          f"max {max(lengths)} tokens ({total_tokens} generated), greedy, ignore_eos; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    started = time.perf_counter()

    def batch() -> list[Request]:
        return requests(lengths, args.seed)

    vllm_layouts = [("vllm 2xTP1", [(1, "0"), (1, "1")]), ("vllm TP2", [(2, "0|1")])]
    vllm_runs: dict[str, list[dict]] = {name: [] for name, _ in vllm_layouts}
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="pat-engines-") as logdir:
        t0 = time.perf_counter()
        # This engine's ranks stay up all along (idle between its runs: a queue poll every 50 ms); each vLLM run gets
        # fresh servers, so that no idle vLLM server shares the cores with another layout's run.
        with LocalGenerator(model_dir, world, options) as gen:
            pat_start = time.perf_counter() - t0
            print(f"  pat ranks up and profiled in {pat_start:.1f} s", flush=True)
            profile, predictor, costs, first = planner_inputs(gen, lengths, args.min_gain)
            print(f"  planner: the batch starts at layout {first}", flush=True)
            configs = [("fixed DP", uniform(world), None), ("fixed TP", uniform(world, world), None),
                       ("adaptive", first, math.inf)]
            planner_args = (profile, predictor, costs, args.min_gain)
            for repeat in range(args.repeats):  # vLLM first, then this engine; the other way round next time
                def vllm_round(order):
                    for name, specs in order:
                        vllm_runs[name].append(run_vllm(name, specs, python, model_dir, options.max_seq, batch(),
                                                        args.seed, Path(logdir)))

                def pat_round(order):
                    for name, rs in run_alternating(gen, order, 1, batch, planner_args).items():
                        runs.setdefault(name, []).extend(rs)

                if repeat % 2 == 0:
                    vllm_round(vllm_layouts)
                    pat_round(configs)
                else:
                    pat_round(configs[::-1])
                    vllm_round(vllm_layouts[::-1])
    print("weight sync (bench/weight_sync.py), each engine's pod of 2 ranks:", flush=True)
    weight_sync = measure_weight_sync(model_dir, python, rounds=args.repeats + 1, seed=args.seed)
    print("adaptive TP on a vLLM pod against its fixed layouts (bench/vllm_adaptive.py):", flush=True)
    vllm_adaptive = measure_vllm_adaptive(model_dir, python, lengths, args.seed, args.repeats)

    results: dict[str, dict] = {}
    for name, rs in vllm_runs.items():
        itl_s, itl_n = sum(r["itl"][0] for r in rs), sum(r["itl"][1] for r in rs)
        results[name] = {"runs": [r["seconds"] for r in rs], "start_s": sum(r["start_s"] for r in rs) / len(rs),
                         "outputs": rs[0]["outputs"], "step_ms": 1e3 * itl_s / max(itl_n, 1)}
    picked = medians(runs)
    for key, name in (("pat 2xTP1", "fixed DP"), ("pat TP2", "fixed TP"), ("pat adaptive", "adaptive")):
        results[key] = {"runs": [r.seconds for r in runs[name]], "start_s": pat_start,
                        "outputs": {rid: list(q.output) for rid, q in picked[name].completions.items()},
                        "regroups": [f"{list(r.old)}->{list(r.new)}@{r.time:.1f}s" for r in picked[name].regroups],
                        "step_ms": token_step_ms(runs[name])}
    wall = time.perf_counter() - started

    for r in results.values():
        r["seconds"] = sum(r["runs"]) / len(r["runs"])
        r["tokens_per_s"] = total_tokens / r["seconds"]
    vllm_best = min(("vllm 2xTP1", "vllm TP2"), key=lambda k: results[k]["seconds"])
    best_s = results[vllm_best]["seconds"]
    reference = results["pat 2xTP1"]["outputs"]
    print(f"\n{'layout':13s} {'gen s':>8s} {'tokens/s':>9s} {'vs vllm best':>12s} {'step ms':>8s} {'start s':>8s} "
          f"{'same seqs':>9s}\n(gen s: mean of {args.repeats} run(s); start s: vLLM's mean, this engine's once; "
          f"step ms: a decode step as a token sees it, vLLM's mean inter-token latency; same seqs: identical to pat "
          f"2xTP1's tokens)")
    for key, r in results.items():
        same, _ = agreement(r["outputs"], reference)
        note = (" <- vLLM best" if key == vllm_best else "") + (f" {' '.join(r['regroups'])}" if r.get("regroups")
                                                               else "")
        print(f"{key:13s} {r['seconds']:8.2f} {r['tokens_per_s']:9.0f} {r['seconds'] / best_s:12.2f} "
              f"{r['step_ms']:8.1f} {r['start_s']:8.1f} {same:>4d}/{len(lengths):<4d}{note}")
    same, prefix = agreement(results["vllm TP2"]["outputs"], reference)
    print(f"\nvLLM TP2 vs pat 2xTP1 greedy tokens: {same}/{len(lengths)} sequences identical, {100 * prefix:.0f}% of "
          f"tokens before the first difference on average (float32 both; different kernels break near-ties "
          f"differently). Whole run: {wall:.0f} s; load average {os.getloadavg()[0]:.2f}")
    pat_best = min(("pat 2xTP1", "pat TP2"), key=lambda k: results[k]["seconds"])
    summary = {
        "pat_adaptive_over_vllm_best": round(results["pat adaptive"]["seconds"] / best_s, 4),
        "pat_best_fixed_over_vllm_best": round(results[pat_best]["seconds"] / best_s, 4),
        "pat_best_fixed": pat_best,
        "vllm_best": vllm_best,
        "layouts": {k: {"seconds": round(r["seconds"], 3), "tokens_per_s": round(r["tokens_per_s"], 1),
                        "runs": [round(s, 3) for s in r["runs"]], "start_s": round(r["start_s"], 1),
                        "token_step_ms": round(r["step_ms"], 2)}
                    for k, r in results.items()},
        "pat_adaptive_start_layout": list(first),
        "vllm_tp2_identical_sequences": same,
        "sequences": len(lengths), "cap": args.cap, "max_length": max(lengths), "generated_tokens": total_tokens,
        "preset": args.preset, "repeats": args.repeats, "wall_s": round(wall, 1),
        **weight_sync,
        **vllm_adaptive,
    }
    print(json.dumps(summary))
    return 0


def _terminate(signum, frame):  # SIGTERM, SIGHUP: unwind, so that the finally blocks stop the servers
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    sys.exit(main())
