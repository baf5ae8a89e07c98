"""Published GPU measurements the simulator's GPU cost model is fitted to (calibration.py), each with its source.

Two decode throughput curves over TP sizes and one table of all-reduce times. Numbers are copied as published;
what this module derives from them (the batch and the context a curve ran at) says how, beside it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeCurve:
    """Decode throughput of one model on TP groups of one GPU type, with the batch and context it ran at."""
    name: str
    source: str
    engine: str
    gpu: str  # a key of pat_operator.fit.GPUS
    model: str  # a key of pat_operator.fit.SHAPES
    weight_bytes: int  # per weight: 2 for bf16, 1 for FP8
    batch: float  # sequences decoding per step
    context: float  # mean KV tokens per sequence while decoding
    tokens_per_s: dict[int, float]  # tp -> output tokens/s of one TP group (all its GPUs)
    measured: str  # what the numbers are, and where batch and context come from

    def per_gpu(self, tp: int) -> float:
        return self.tokens_per_s[tp] / tp

    def step_seconds(self, tp: int) -> float:
        """One decode step, as the curve implies it: batch / throughput."""
        return self.batch / self.tokens_per_s[tp]


@dataclass(frozen=True)
class AllReduceTimes:
    """Seconds of one all-reduce by TP size and message bytes."""
    name: str
    source: str
    gpu: str
    seconds: dict[tuple[int, int], float]  # (tp, bytes) -> seconds
    measured: str


GPT_FAST_A100 = DecodeCurve(
    name="gpt-fast, A100, batch 1",
    source="https://github.com/pytorch-labs/gpt-fast README.md, table 'Tensor Parallelism', rows Llama-3.1-8B "
           "(added with 'Add support for llama 3.1 8B/70B', #200)",
    engine="gpt-fast: torch.compile(mode='reduce-overhead') decode (CUDA graphs), TP by sharded linears and "
           "funcol.all_reduce with ENABLE_INTRA_NODE_COMM=1",
    gpu="A100-80GB", model="llama-3.1-8b", weight_bytes=2,
    batch=1,
    context=5 + 200 / 2,  # a 5-token prompt and generate.py's default --max_new_tokens 200: the mean context
    tokens_per_s={1: 93.83, 2: 149.10, 4: 217.21, 8: 276.01},
    measured="tokens/s of one request (batch 1), bf16, on 8 x A100-80GB SXM power-limited to 330 W (the README: "
             "'peak bandwidth is about 1700 GB/s' there)",
)

# vLLM 0.5.4 runs each step's scheduling, input preparation and sampling on the CPU between GPU steps (the same
# report: GPU power ~60%, v0.6.0 doubled the throughput by overlapping it), so its step time is mostly CPU time.
VLLM_H100 = DecodeCurve(
    name="vLLM 0.5.4, H100, 320 ShareGPT prompts",
    source="https://github.com/LambdaLabsML/vllm-benchmark benchmark_v0.md, table under 'Tensor Parallel v.s. "
           "Data Parallel' (output throughput / median inter-token latency), column Meta-Llama-3.1-8B-FP8; request "
           "lengths from results/prompt_320/1xH100-80GB-SXM/Meta-Llama-3.1-8B-FP8_tp1_len8000.json",
    engine="vLLM 0.5.4 OpenAI server (custom all-reduce), benchmark_serving.py --request-rate inf",
    gpu="H100-SXM", model="llama-3.1-8b", weight_bytes=1,
    # Little's law at TP1: sequences per step = output tokens/s x step seconds (the median inter-token latency,
    # 19.75 ms); the TP2/4/8 rows give 69-70 with their own latencies (18.83, 20.26, 17.61 ms).
    batch=3400.4 * 19.75e-3,
    # 320 ShareGPT requests: 65,578 prompt and 44,463 output tokens, so a prompt of 205 and half an output of 139
    context=65578 / 320 + 44463 / 320 / 2,
    tokens_per_s={1: 3400.4, 2: 3688.64, 4: 3475.27, 8: 3931.83},
    measured="output tokens/s of the server (all its GPUs) over 320 ShareGPT requests sent at once, "
             "neuralmagic/Meta-Llama-3.1-8B-FP8 (FP8 weights, 16-bit KV cache), max-num-seqs 1024",
)

# The custom all-reduce SGLang uses for small messages (TensorRT-LLM's one-shot kernel), timed per call over 5000
# calls without CUDA graphs; float32 tensors of 512 ... 1,048,576 elements (sgl-kernel/tests/test_trt_reduce.py).
_SGLANG_ELEMENTS = (512, 4096, 32768, 262144, 524288, 1048576)
_SGLANG_MS = {2: (0.0037, 0.0039, 0.0045, 0.0079, 0.0125, 0.0199),
              4: (0.0048, 0.0037, 0.0048, 0.0139, 0.0202, 0.0311),
              8: (0.0059, 0.0057, 0.0078, 0.0167, 0.0221, 0.0338)}
SGLANG_ALLREDUCE_H100 = AllReduceTimes(
    name="SGLang custom all-reduce, H100",
    source="https://github.com/sgl-project/sglang/pull/2904 ('optimize custom allreduce'), table 'custom "
           "allreduce' under 'unit test performance in H100 (without cuda graph)'",
    gpu="H100-SXM",
    seconds={(tp, 4 * n): ms * 1e-3 for tp, row in _SGLANG_MS.items() for n, ms in zip(_SGLANG_ELEMENTS, row)},
    measured="seconds per all-reduce of a float32 tensor (4 bytes per element) on 2, 4 and 8 H100 over NVLink",
)
