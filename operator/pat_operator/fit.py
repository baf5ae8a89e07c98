"""Will a job fit? The memory of each trainer rank and each generator engine rank, from the model's shape, against
the GPUs' memory (by name, or by the node label GPU feature discovery sets).

Pure arithmetic, no torch: `pat plan` prints it; `pat validate` and the operator check it wherever the shape and
the GPUs are known without reading model files; the trainer checks its device's free memory at start (check_free).
The model shapes (built in, tiny presets, a config.json) and the GPU table are here too, so that the operator, the
engine and the simulator share them.

Counted per rank (P parameters, W = trainer.world_size, e = 2 bytes per element computed on GPUs (bf16), 4 on CPU):
- trainer, FSDP2 (fully_shard per transformer block and at the root): fp32 master weights 4P/W, fp32 gradients
  4P/W, AdamW's two fp32 moments 8P/W, and with algorithm.klCoef > 0 the frozen reference policy 4P/W (these in
  host memory with trainer.cpuOffload); the unsharded parameters, e bytes each, of two blocks (the running one and
  the prefetched next) and of the root (embedding, final norm, an untied lm_head); the activations autograd keeps
  for one micro-batch of algorithm.maxTokensPerMicroBatch tokens (layer_activation_bytes per token and layer; with
  activation checkpointing each block keeps only its input, and one block at a time its whole set); the loss's
  lm_head + log-softmax over LOSS_CHUNK_TOKENS tokens at a time (logits, log-probabilities and a gradient, fp32).
- generator engine rank, within generator.memoryUtilization of its GPU (like vLLM's gpu_memory_utilization): the
  whole replica in model.dtype (a TP shard is a view of it); working memory: the fp32 logits of the largest decode
  batch (maxBatch x the largest TP size), and one layer's activations (as the trainer's layer_activation_bytes
  counts them: more than inference keeps) for the longest forward (a batched prefill of PREFILL_TOKENS or one
  recomputed sequence of maxSeq); the profiling pass at start runs in the cache. Then the paged KV cache (blocks
  of BLOCK_SIZE tokens) gets the rest, and a regroup's transfer buffers beside it (REGROUP_IN_FLIGHT of the
  cache). The cache never holds more than maxBatch sequences of maxSeq tokens (all KV heads): a TP=t group holds
  t x maxBatch sequences with 1/t of the heads on each rank, the same bytes per rank. The rank fits when the cache
  holds at least one sequence of maxSeq tokens.
- generator GPU with engine vllm, within generator.vllm.gpuMemoryUtilization: only what is sure, since vLLM
  profiles its own activations and CUDA graphs at start and its KV cache gets the rest: the GPU's shard of the
  weights (1/tensorParallelSize) and its share of the KV cache of one sequence of maxModelLen (vLLM refuses to start
  without room for one). The model's attention heads must split over the TP size.
- colocated GPU (spec.placement colocated: a trainer rank and an engine rank on it, taking turns), per phase.
  Resident through all: the trainer's sharded states but the gradients (fp32 parameters, AdamW's moments, the
  reference; none with trainer.cpuOffload: trainer_resident_bytes). Generating, within memoryUtilization: the
  engine's weights, working memory and KV cache, which gets what the rest leaves (at least one sequence of maxSeq).
  Training, within all but HEADROOM (the engine asleep at level 2 has given back its weights, KV cache and working
  memory): the gradients, the trainer's unsharded blocks, activations and loss chunk. The hand-over after the step,
  within all but HEADROOM (the gradients freed): the engine's weights, written one weight-sync bucket
  (WEIGHT_SYNC_BUCKET_BYTES) at a time.
HEADROOM (a tenth of each trainer device) is kept free for what is not counted: the CUDA context, NCCL buffers,
allocator fragmentation, the gradients of activations inside a block's backward.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .api import COLOCATED_POD_FIELDS, GPU_PRODUCT_LABEL, JobSpecError, RLHFJobSpec
from .layout import tp_degrees

GIB = 1 << 30
MIB = 1 << 20
HEADROOM = 0.1  # of each trainer device's memory, kept free for what is not counted (see above)
LOSS_CHUNK_TOKENS = 1024  # tokens per lm_head + log-softmax chunk of the trainer's loss
PREFILL_TOKENS = 4096  # padded tokens in one batched prefill of the engine (engine/engine.py)
BLOCK_SIZE = 16  # tokens per KV block (engine/rank.py: EngineOptions.block_size)
# Of the KV cache, what a regroup holds beside it at a time: a round's blocks sent and received, 4% of the cache
# each way (engine/regroup.py).
REGROUP_IN_FLIGHT = 0.08
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_GPUS_PER_POD = 8  # the largest pod a fix suggests (one node of 8 GPUs)
# Colocated, the trainer hands its weights to the engine in buckets of at most this many bytes (weightsync.py's
# BUCKET_BYTES): the most that is in transit on a GPU at a time.
WEIGHT_SYNC_BUCKET_BYTES = 256 * MIB


class FitError(ValueError):
    """A model shape or GPU this module cannot read; the message names the flag or field and the fix."""


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float  # what the device reports (nvidia-smi's total)
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    link_bytes_per_s: float  # NVLink (PCIe without it), one direction per GPU
    link_latency_s: float  # one small all-reduce (an assumption: datasheets give no latency)
    source: str
    products: tuple[str, ...] = ()  # its values of the node label GPU_PRODUCT_LABEL


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("A100-40GB", 40960 * MIB, 1.555e12, 312e12, 300e9, 10e-6,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): HBM2 1,555 GB/s, BF16 312 TFLOPS dense, NVLink 600 GB/s "
        "(both directions); 40,960 MiB as nvidia-smi reports it", ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB")),
    GPU("A100-80GB", 81920 * MIB, 2.039e12, 312e12, 300e9, 10e-6,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): HBM2e 2,039 GB/s, BF16 312 TFLOPS dense, "
        "NVLink 600 GB/s (both directions); 81,920 MiB as nvidia-smi reports it",
        ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe")),
    GPU("H100-PCIe", 81559 * MIB, 2.0e12, 756e12, 300e9, 10e-6,
        "NVIDIA H100 PCIe product brief: HBM2e 2,000 GB/s, BF16 1,513 TFLOPS with sparsity (756 dense), NVLink "
        "bridge 600 GB/s (both directions); 81,559 MiB as nvidia-smi reports it", ("NVIDIA-H100-PCIe",)),
    GPU("H100-SXM", 81559 * MIB, 3.35e12, 989e12, 450e9, 8e-6,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): HBM3 3.35 TB/s, BF16 1,979 TFLOPS with sparsity (989 "
        "dense), NVLink 900 GB/s (both directions); 81,559 MiB as nvidia-smi reports it", ("NVIDIA-H100-80GB-HBM3",)),
    GPU("H200", 143771 * MIB, 4.8e12, 989e12, 450e9, 8e-6,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, BF16 1,979 TFLOPS with sparsity "
        "(989 dense), NVLink 900 GB/s (both directions); 143,771 MiB as nvidia-smi reports it", ("NVIDIA-H200",)),
    GPU("L40S", 46068 * MIB, 864e9, 362e12, 32e9, 10e-6,
        "NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, BF16 733 TFLOPS with sparsity (362 dense), no NVLink: PCIe "
        "Gen4 x16 64 GB/s (both directions); 46,068 MiB as nvidia-smi reports it", ("NVIDIA-L40S",)),
)}


def gpu(name: str) -> GPU:
    """A GPU by its name here (H200) or its node label value (NVIDIA-H200), in any case; FitError if unknown."""
    key = name.lower()
    for g in GPUS.values():
        if key == g.name.lower() or key in (p.lower() for p in g.products):
            return g
    raise FitError(f"GPU {name!r} is unknown; use one of {', '.join(GPUS)} or a {GPU_PRODUCT_LABEL} value "
                   f"({', '.join(p for g in GPUS.values() for p in g.products)})")


def selected_gpu(node_selector: dict[str, str]) -> GPU | None:
    """The GPU a pod's nodeSelector asks for by GPU_PRODUCT_LABEL; None without that label (FitError: unknown)."""
    product = node_selector.get(GPU_PRODUCT_LABEL)
    return None if product is None else gpu(product)


@dataclass(frozen=True)
class ModelShape:
    """A decoder (Llama-3, Qwen2, Qwen3: rms_norm, GQA attention with RoPE, SwiGLU MLP), as the engine loads it."""
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int | None = None  # config.json's max_position_embeddings
    tied_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str) -> ModelShape:
        """From a Hugging Face config.json: Qwen2 always has q/k/v biases, Llama and Qwen3 follow attention_bias
        (Llama also on o_proj), Qwen3 normalises q and k per head."""
        try:
            heads = int(cfg["num_attention_heads"])
            model_type, attention_bias = cfg.get("model_type"), bool(cfg.get("attention_bias", False))
            positions = cfg.get("max_position_embeddings")
            return cls(name, int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"]),
                       heads, int(cfg.get("num_key_value_heads") or heads),
                       int(cfg.get("head_dim") or cfg["hidden_size"] // heads), int(cfg["vocab_size"]),
                       max_positions=int(positions) if positions else None,
                       tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qkv_bias=model_type == "qwen2" or attention_bias,
                       o_bias=model_type != "qwen2" and attention_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
                       qk_norm=model_type == "qwen3")
        except KeyError as e:
            raise FitError(f"{name}: config.json lacks {e.args[0]}; give a Hugging Face config.json of a Llama/Qwen "
                           f"model") from None

    @property
    def layer_matmul_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * d * (2 * self.heads + 2 * self.kv_heads) + 3 * h * self.intermediate

    @property
    def layer_params(self) -> int:
        """One decoder layer: its matrices, biases and norms."""
        d, kv_width = self.head_dim, self.kv_heads * self.head_dim
        biases = ((self.heads * d + 2 * kv_width) * self.qkv_bias + self.hidden * self.o_bias
                  + (2 * self.intermediate + self.hidden) * self.mlp_bias)
        return self.layer_matmul_params + biases + 2 * self.hidden + 2 * d * self.qk_norm

    @property
    def root_params(self) -> int:
        """Outside the layers: the embedding, the final norm and an untied lm_head."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies with: the layers and the LM head (not the embedding lookup)."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    def kv_bytes_per_token(self, element_size: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size

    def tp_sizes(self, world: int) -> list[int]:
        """As the engine allows: powers of two dividing the pod's ranks, the KV heads and the MLP width."""
        return [t for t in tp_degrees(world) if self.kv_heads % t == 0 and self.intermediate % t == 0]


# From the models' published config.json (meta-llama/Llama-3.1-8B, Qwen/Qwen3-14B on Hugging Face).
SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape.from_hf(dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                            max_position_embeddings=131072),
                       "llama-3.1-8b"),
    ModelShape.from_hf(dict(model_type="qwen3", hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                            num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                            max_position_embeddings=40960),
                       "qwen3-14b"),
)}

# model.tiny presets: config.json dimensions, plus lm_head_gain where a preset wants another logit scale (not a
# config.json field; engine/tiny.py builds the weights).
PRESETS: dict[str, dict[str, Any]] = {
    # For tests: fast, 4 KV heads so that TP 1/2/4 all apply.
    "test": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=320),
    # For RL on a 2-core CPU (synthetic arithmetic): small, and near-uniform at the start.
    "demo": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=320, lm_head_gain=0.1),
    # The demo model with 32-wide heads, the narrowest vLLM's CPU attention kernels take (examples/vllm.yaml).
    "demo-vllm": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, lm_head_gain=0.1),
    # make run's (examples/local.yaml): one wide layer, near-uniform at the start. A decode step reads its 45 MB
    # of weights, so that at small batches it is memory-bound and a TP=2 group, each rank reading half, steps
    # about twice as fast; with 11M parameters training stays cheap on a 2-core CPU.
    "demo-wide": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=1, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=320, lm_head_gain=0.1),
    # For the CPU benchmark: compute per step outweighs a shared-memory all-reduce (~10 us).
    "bench": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=2048),
    # Llama-3.1-8B's shape (random weights), for the GPU benchmark.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}


def hf_config(family: str, **dims: Any) -> dict[str, Any]:
    """A Hugging Face config.json of a tiny model of `family` with these dimensions."""
    if family not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"family={family!r}: use llama, qwen2 or qwen3")
    cfg: dict[str, Any] = dict(
        model_type=family, architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                           "qwen3": "Qwen3ForCausalLM"}[family]],
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257, torch_dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if family == "llama":
        cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 1024}
    if family == "qwen3":
        cfg["head_dim"] = 2 * dims["hidden_size"] // dims["num_attention_heads"]  # Qwen3 decouples head_dim
    cfg.update(dims)
    return cfg


def tiny_shape(preset: str, family: str = "llama") -> ModelShape:
    if preset not in PRESETS:
        raise FitError(f"model.tiny.preset={preset!r} is unknown; known: {sorted(PRESETS)}")
    return ModelShape.from_hf(hf_config(family, **PRESETS[preset]), f"tiny {family} {preset}")


def read_shape(path: Path) -> ModelShape:
    """The shape in a config.json; FitError naming the file when it cannot be read."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FitError(f"{path}: {e}; give a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise FitError(f"{path}: not a JSON object; give a Hugging Face config.json")
    return ModelShape.from_hf(cfg, path.parent.name or str(path))


# --- memory per rank ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Memory:
    """Bytes per rank by term, in the order printed; `host` is what trainer.cpuOffload keeps in host memory."""
    terms: tuple[tuple[str, float], ...]
    host: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        return sum(b for _, b in self.terms)


def layer_activation_bytes(shape: ModelShape, element_size: int) -> int:
    """What autograd keeps per token of one transformer block of the trainer (trainer/policy.py's Block), its
    input included: each rms_norm a float32 copy of its input and its output (q- and k-norm too); attention's fused
    kernel q, k, v (RoPE'd), its output and a float32 log-sum-exp per head, and o_proj a contiguous copy of that
    output; the MLP's gate, silu(gate), up and their product. Measured on CPU with saved_tensors_hooks (float32
    and bfloat16): within 4% (qk-norm counted high), the rest exact."""
    e, h, d, nh, nkv = element_size, shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    norms = 2 * (4 + e) * h + (4 + e) * d * (nh + nkv) * shape.qk_norm
    attention = e * d * (3 * nh + 2 * nkv) + 4 * nh
    return e * h + norms + attention + 4 * e * shape.intermediate


def _state_terms(shape: ModelShape, world: int, reference: bool) -> list[tuple[str, float]]:
    """The sharded states a trainer rank keeps from step to step, over `world` ranks: fp32 parameters, AdamW's
    moments and, with a KL term, the reference policy."""
    w, p = world, shape.params
    return [(f"parameters (fp32, 1/{w})", 4 * p / w), (f"AdamW moments (fp32, 1/{w})", 8 * p / w),
            *[(f"reference policy (fp32, 1/{w})", 4 * p / w)] * reference]


def sharded_state_bytes(shape: ModelShape, world: int, reference: bool) -> float:
    """What _state_terms counts, for a trainer without a spec (`pat simulate`'s presets)."""
    return sum(b for _, b in _state_terms(shape, world, reference))


def _trainer_resident(spec: RLHFJobSpec, shape: ModelShape) -> list[tuple[str, float]]:
    """The job's trainer rank's sharded states (wherever they live: trainer_memory says where)."""
    return _state_terms(shape, spec.trainer.world_size, spec.algorithm.kl_coef > 0)


def _trainer_gradients(spec: RLHFJobSpec, shape: ModelShape) -> tuple[str, float]:
    """The sharded fp32 gradients: they exist from the first backward of a step to its optimizer step."""
    w = spec.trainer.world_size
    return f"gradients (fp32, 1/{w})", 4 * shape.params / w


def _trainer_buffers(spec: RLHFJobSpec, shape: ModelShape) -> list[tuple[str, float]]:
    """What a trainer rank allocates only while it trains, always on its device: the unsharded parameters of two
    blocks and the root, one micro-batch's activations, a loss chunk's logits."""
    t, tokens = spec.trainer, spec.algorithm.max_tokens_per_micro_batch
    on_gpu = t.gpus_per_pod > 0
    e = 2 if on_gpu else 4
    block = layer_activation_bytes(shape, e)
    final_norm = (4 + 2 * e) * shape.hidden  # the final rms_norm, and the response rows gathered for the loss
    if t.checkpointing:
        activations = (f"activations ({tokens} tokens, checkpointed)",
                       tokens * (shape.layers * e * shape.hidden + block + final_norm))
    else:
        activations = (f"activations ({tokens} tokens, every block)", tokens * (shape.layers * block + final_norm))
    return [(f"unsharded: 2 blocks + root ({'bf16' if on_gpu else 'fp32'})",
             e * (2 * shape.layer_params + shape.root_params)), activations,
            (f"loss: logits of {min(LOSS_CHUNK_TOKENS, tokens)} tokens (fp32 x 3)",
             3 * 4 * min(LOSS_CHUNK_TOKENS, tokens) * shape.vocab)]


def _offloaded(spec: RLHFJobSpec) -> bool:
    """Whether the sharded states (parameters, gradients, AdamW's moments, the reference) live in host memory."""
    return spec.trainer.gpus_per_pod > 0 and spec.trainer.cpu_offload


def trainer_memory(spec: RLHFJobSpec, shape: ModelShape) -> Memory:
    """Per trainer rank (see the module's docstring): the sharded states, then what only training allocates."""
    states = [*_trainer_resident(spec, shape), _trainer_gradients(spec, shape)]
    buffers = _trainer_buffers(spec, shape)
    return Memory(tuple(buffers), tuple(states)) if _offloaded(spec) else Memory(tuple(states + buffers))


def trainer_resident_bytes(spec: RLHFJobSpec, shape: ModelShape) -> float:
    """Bytes a trainer rank keeps on its device between steps (colocated: while the engine generates): its shards of
    the fp32 parameters, AdamW's moments and the reference policy; 0 with trainer.cpuOffload (in host memory)."""
    return 0.0 if _offloaded(spec) else sum(b for _, b in _trainer_resident(spec, shape))


def engine_working_bytes(shape: ModelShape, dtype: str, max_batch: int, max_seq: int, ranks: int) -> float:
    """An engine rank's working memory (the module's docstring); the engine sizes its KV cache with it too."""
    tokens, rows = max(PREFILL_TOKENS, max_seq), max_batch * shape.tp_sizes(ranks)[-1]
    logits = 3 * 4 * rows * shape.vocab  # logits, probabilities and a sorted copy (top-p), fp32
    return tokens * layer_activation_bytes(shape, DTYPE_BYTES[dtype]) + logits


def utilization(spec: RLHFJobSpec) -> float:
    """The fraction of a GPU the generator engine may use: generator.memoryUtilization, or with engine vllm
    generator.vllm.gpuMemoryUtilization."""
    g = spec.generator
    return g.vllm.gpu_memory_utilization if g.engine == "vllm" else g.memory_utilization


def max_len(spec: RLHFJobSpec) -> int:
    """The longest sequence the engine holds: generator.maxSeq, or with engine vllm vllm.maxModelLen if set."""
    g = spec.generator
    return (g.vllm.max_model_len or g.max_seq) if g.engine == "vllm" else g.max_seq


def _kv_share(spec: RLHFJobSpec, shape: ModelShape) -> float:
    """The fraction of the KV heads on one GPU: all of them on an engine rank of engine pat (a TP=t group holds t
    times the sequences); with engine vllm 1/tensorParallelSize, a KV head per GPU at least (vLLM replicates them)."""
    g = spec.generator
    tp = g.vllm.tensor_parallel_size if g.engine == "vllm" else 1
    return max(shape.kv_heads // tp, 1) / shape.kv_heads


def _engine_weights(spec: RLHFJobSpec, shape: ModelShape) -> tuple[str, float]:
    """An engine rank's weights: the whole replica in model.dtype (engine vllm: the GPU's 1/tensorParallelSize)."""
    g, dtype = spec.generator, spec.model.dtype
    tp = g.vllm.tensor_parallel_size if g.engine == "vllm" else 1
    if g.engine == "vllm":
        return f"weights ({dtype}, {f'1/{tp} of ' if tp > 1 else ''}the model)", shape.params * DTYPE_BYTES[dtype] / tp
    return f"weights ({dtype}, the whole model)", shape.params * DTYPE_BYTES[dtype]


def _engine_working(spec: RLHFJobSpec, shape: ModelShape) -> list[tuple[str, float]]:
    """An engine rank's working memory while it generates (none counted with engine vllm: vLLM profiles its own)."""
    g = spec.generator
    if g.engine == "vllm":
        return []
    return [(f"working memory (a forward of {max(PREFILL_TOKENS, g.max_seq)} tokens)",
             engine_working_bytes(shape, spec.model.dtype, g.max_batch, g.max_seq, g.ranks))]


def _engine_fixed(spec: RLHFJobSpec, shape: ModelShape) -> list[tuple[str, float]]:
    """What an engine rank holds beside its KV cache: the weights and the working memory (the module's docstring);
    with engine vllm only the GPU's shard of the weights."""
    return [_engine_weights(spec, shape), *_engine_working(spec, shape)]


def _beside_engine(spec: RLHFJobSpec, shape: ModelShape) -> float:
    """What else holds the engine's device while it generates: colocated, the trainer rank's resident states."""
    return trainer_resident_bytes(spec, shape) if spec.placement == "colocated" else 0.0


def _in_flight(spec: RLHFJobSpec, shape: ModelShape) -> float:
    """REGROUP_IN_FLIGHT where the engine may regroup, else 0."""
    g = spec.generator
    regroups = g.adaptive and any(t > 1 for t in g.tp_sizes if t in shape.tp_sizes(g.ranks))
    return REGROUP_IN_FLIGHT if regroups else 0.0


def sequence_blocks(spec: RLHFJobSpec) -> int:
    """KV blocks of one sequence of maxSeq tokens (engine vllm: maxModelLen)."""
    return -(-max_len(spec) // BLOCK_SIZE)


def _block_bytes(spec: RLHFJobSpec, shape: ModelShape) -> float:
    """A KV block's bytes on one GPU (all KV heads with engine pat; engine vllm: the GPU's share of them)."""
    return BLOCK_SIZE * shape.kv_bytes_per_token(DTYPE_BYTES[spec.model.dtype]) * _kv_share(spec, shape)


def kv_blocks(spec: RLHFJobSpec, shape: ModelShape, memory_bytes: float | None) -> tuple[int, int | None]:
    """(blocks the KV cache of an engine rank holds, blocks memoryUtilization x memory_bytes has room for, or None
    without a device to size it from); at most maxBatch sequences of maxSeq tokens (engine vllm: no cap here, and one
    sequence without a device). Colocated, the trainer rank's resident states (trainer_resident_bytes) take their
    part of memoryUtilization first."""
    g = spec.generator
    cap = g.max_batch * sequence_blocks(spec) if g.engine == "pat" else None
    if memory_bytes is None:
        return cap or sequence_blocks(spec), None
    beside = sum(b for _, b in _engine_fixed(spec, shape)) + _beside_engine(spec, shape)
    rest = utilization(spec) * memory_bytes - beside
    room = max(int(rest / (_block_bytes(spec, shape) * (1 + _in_flight(spec, shape)))), 0)
    return (room if cap is None else min(cap, room)), room


def _kv_terms(spec: RLHFJobSpec, shape: ModelShape, memory_bytes: float | None) -> list[tuple[str, float]]:
    """The KV cache kv_blocks sizes, and a regroup's transfer buffers beside it. A cache without room for one
    sequence counts as one (what the rank needs at least)."""
    blocks, room = kv_blocks(spec, shape, memory_bytes)
    block, moving, length = _block_bytes(spec, shape), _in_flight(spec, shape), max_len(spec)
    bound = ("at most " if spec.generator.engine == "pat" else "at least ") * (room is None)
    if held := blocks // sequence_blocks(spec):
        label = f"KV cache ({bound}{held} x {length} tokens)"
    else:
        label, blocks = f"KV cache (1 x {length} tokens: no room)", sequence_blocks(spec)
    terms = [(label, blocks * block)]
    if moving:
        terms.append((f"regroup: KV in flight ({moving:.0%} of the cache)", moving * blocks * block))
    return terms


def generator_memory(spec: RLHFJobSpec, shape: ModelShape, memory_bytes: float | None = None) -> Memory:
    """Per generator engine rank on a device of memory_bytes (None: not known, the cache at its cap); see the
    module's docstring."""
    return Memory((*_engine_fixed(spec, shape), *_kv_terms(spec, shape, memory_bytes)))


def generator_need(spec: RLHFJobSpec, shape: ModelShape) -> float:
    """The least an engine rank needs: its weights, working memory and a KV cache of one sequence of maxSeq (engine
    vllm: its shard of the weights and its share of the KV cache of one sequence of maxModelLen)."""
    one = sequence_blocks(spec) * _block_bytes(spec, shape) * (1 + _in_flight(spec, shape))
    return sum(b for _, b in _engine_fixed(spec, shape)) + one


ROLES: dict[str, Callable[[RLHFJobSpec, ModelShape, float | None], Memory]] = {
    "trainer": lambda spec, shape, _memory_bytes: trainer_memory(spec, shape), "generator": generator_memory}


@dataclass(frozen=True)
class Phases:
    """Per GPU of a colocated pod, its trainer rank and engine rank together, in bytes by term: what stays across the
    phases, what generating adds (the engine's weights, working memory and KV cache, released for training), what
    training adds (the trainer's gradients and buffers, freed before the hand-over) and what the hand-over adds (the
    engine's weights again, and a bucket in transit); `host`: what trainer.cpuOffload keeps in host memory."""
    resident: tuple[tuple[str, float], ...]
    generate: tuple[tuple[str, float], ...]
    train: tuple[tuple[str, float], ...]
    handover: tuple[tuple[str, float], ...]
    host: tuple[tuple[str, float], ...] = ()

    @property
    def resident_bytes(self) -> float:
        return sum(b for _, b in self.resident)

    @property
    def generate_bytes(self) -> float:
        """On the GPU while generating: the resident part and the generate phase's."""
        return self.resident_bytes + sum(b for _, b in self.generate)

    @property
    def train_bytes(self) -> float:
        return self.resident_bytes + sum(b for _, b in self.train)

    @property
    def handover_bytes(self) -> float:
        return self.resident_bytes + sum(b for _, b in self.handover)


def colocated_memory(spec: RLHFJobSpec, shape: ModelShape, memory_bytes: float | None = None) -> Phases:
    """Per GPU of a colocated pod on a device of memory_bytes (None: not known, the KV cache at its cap). Resident:
    the trainer's sharded states (trainer_resident_bytes). The engine's weights go with it to sleep (the hand-over
    writes every tensor anew), and come back in the hand-over, one bucket at a time."""
    label, weights = _engine_weights(spec, shape)
    states, gradients = _trainer_resident(spec, shape), _trainer_gradients(spec, shape)
    offloaded = _offloaded(spec)
    engine = lambda terms: [(f"engine {name}", b) for name, b in terms]  # noqa: E731
    return Phases(resident=tuple(states * (not offloaded)),
                  generate=tuple(engine([(label, weights), *_engine_working(spec, shape),
                                         *_kv_terms(spec, shape, memory_bytes)])),
                  train=tuple([gradients] * (not offloaded) + _trainer_buffers(spec, shape)),
                  handover=tuple(engine([(label, weights)])
                                 + [("one bucket in transit", min(WEIGHT_SYNC_BUCKET_BYTES, weights))]),
                  host=tuple([*states, gradients] * offloaded))


# --- the check ---------------------------------------------------------------------------------------------------

def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.0f} MiB"


def usable(memory_bytes: float) -> float:
    return memory_bytes * (1 - HEADROOM)


def allowance(spec: RLHFJobSpec, role: str, memory_bytes: float) -> float:
    """What a rank may use of a device's memory: a trainer rank all but HEADROOM, an engine rank memoryUtilization
    (engine vllm: vllm.gpuMemoryUtilization)."""
    return utilization(spec) * memory_bytes if role == "generator" else usable(memory_bytes)


def need(spec: RLHFJobSpec, shape: ModelShape, role: str) -> float:
    """The least a rank needs: all that a trainer rank counts; an engine rank's weights, working memory and a KV
    cache of one sequence of maxSeq (its cache takes the rest)."""
    return trainer_memory(spec, shape).total if role == "trainer" else generator_need(spec, shape)


@dataclass(frozen=True)
class Budget:
    """One limit on a device: at least `need` bytes of the `allowed` (a trainer rank, an engine rank, or a colocated
    GPU's phase: generate, train or hand-over)."""
    name: str
    need: float
    allowed: float

    @property
    def fits(self) -> bool:
        return self.need <= self.allowed


def budgets(spec: RLHFJobSpec, shape: ModelShape, role: str, memory_bytes: float) -> list[Budget]:
    """The limits a role's device of memory_bytes must keep. Role trainer or generator: the rank's need() within its
    allowance(). Role colocated, per phase: generating, the trainer's resident states (trainer_resident_bytes), the
    engine's weights, working memory and a KV cache of one sequence within memoryUtilization (as the engine alone);
    training, the resident states and the trainer's gradients and buffers, and the hand-over, the resident states and
    the engine's weights, each within all but HEADROOM (as the trainer alone)."""
    if role != "colocated":
        return [Budget(role, need(spec, shape, role), allowance(spec, role, memory_bytes))]
    generate = trainer_resident_bytes(spec, shape) + generator_need(spec, shape)
    phases = colocated_memory(spec, shape)
    return [Budget("generate", generate, allowance(spec, "generator", memory_bytes)),
            Budget("train", phases.train_bytes, usable(memory_bytes)),
            Budget("hand-over", phases.handover_bytes, usable(memory_bytes))]


def fits(spec: RLHFJobSpec, shape: ModelShape, role: str, memory_bytes: float) -> bool:
    return all(b.fits for b in budgets(spec, shape, role, memory_bytes))


def role_gpus(spec: RLHFJobSpec, name: str | None = None, *, lenient: bool = False) -> dict[str, GPU | None]:
    """Each GPU role's GPU: `name` for every role, else its nodeSelector's (None without the label); CPU roles are
    left out. Colocated, one role, "colocated": the generator pods' GPUs, which host both. An unknown GPU is a
    FitError, or with `lenient` None (the operator's table may lag the hardware)."""
    named = gpu(name) if name else None

    def one(node_selector: dict[str, str]) -> GPU | None:
        try:
            return named or selected_gpu(node_selector)
        except FitError:
            if lenient:
                return None
            raise

    roles = ((("colocated", spec.generator),) if spec.placement == "colocated"
             else (("trainer", spec.trainer), ("generator", spec.generator)))
    return {role: one(template.node_selector) for role, template in roles if template.gpus_per_pod > 0}


def problems(spec: RLHFJobSpec, shape: ModelShape, gpus: dict[str, GPU | None]) -> list[str]:
    """A generator.maxSeq (engine vllm: vllm.maxModelLen) beyond the model's positions, a vLLM TP size that does not
    split the attention heads, an engine pat fixed TP size (generator.tensorParallelSize) its heads and MLP do not
    allow, and one message per role that does not fit its GPU (a role mapped to None is not checked; colocated: a
    phase that does not fit), naming the field to change and the least change that fits."""
    g, seq, positions = spec.generator, max_len(spec), shape.max_positions
    name = "generator.vllm.maxModelLen" if g.engine == "vllm" and g.vllm.max_model_len else "generator.maxSeq"
    beyond = (f"spec.{name}: {name}={seq} is beyond the model's max_position_embeddings={positions}; lower {name} "
              f"to {positions} or less")
    tp = g.vllm.tensor_parallel_size
    sizes = [t for t in range(1, g.ranks + 1) if g.ranks % t == 0 and shape.heads % t == 0]
    split = (f"spec.generator.vllm.tensorParallelSize: vLLM splits the model's {shape.heads} attention heads over the "
             f"{tp} GPUs of an engine; use one of {sizes}")
    fixed, allowed = g.tensor_parallel_size, shape.tp_sizes(g.ranks)
    layout = (f"spec.generator.tensorParallelSize: {shape.name} splits over TP sizes that divide its "
              f"{shape.kv_heads} KV heads and {shape.intermediate}-wide MLP (and the {g.ranks} ranks per pod): "
              f"generator.tensorParallelSize={fixed} is not one of them; use one of {allowed}")
    over = [message for role, device in gpus.items()
            if device is not None and (message := _check(spec, shape, role, device.memory_bytes,
                                                          f"an {device.name}'s {gib(device.memory_bytes)}"))]
    cpu_heads = (f"spec.generator.engine: vLLM's CPU attention kernels take heads {VLLM_CPU_HEAD_SIZES} wide; "
                 f"{shape.name}'s are {shape.head_dim} (on CPU use a model with such heads, e.g. model.tiny.preset: "
                 f"demo-vllm, or generator.engine: pat)")
    on_cpu = g.engine == "vllm" and not g.gpus_per_pod and shape.head_dim not in VLLM_CPU_HEAD_SIZES
    return ([beyond] * bool(positions and seq > positions) + [split] * (g.engine == "vllm" and shape.heads % tp > 0)
            + [layout] * (g.engine == "pat" and fixed not in allowed) + [cpu_heads] * on_cpu + over)


# vLLM 0.32's CPU attention backend (CPUAttentionBackend.get_supported_head_sizes): others fail at the first request.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def known_problems(spec: RLHFJobSpec, shape: ModelShape | None = None) -> list[str]:
    """problems() wherever the shape and the GPUs are known: `shape` if the caller could read the model's
    config.json, else a tiny preset's (the operator never reads model files); the GPUs the nodeSelectors name."""
    if shape is None and (spec.model.tiny is None or spec.model.tiny.preset not in PRESETS):
        return []  # an unknown preset: not this check's to report
    shape = shape or tiny_shape(spec.model.tiny.preset, spec.model.tiny.family)
    return problems(spec, shape, role_gpus(spec, lenient=True))


def require_fit(spec: RLHFJobSpec, source: str, shape: ModelShape | None = None) -> None:
    """JobSpecError, one line per role as parse_job writes them, when known_problems() finds any."""
    if found := known_problems(spec, shape):
        raise JobSpecError(f"{source} does not fit:\n" + "\n".join(f"  {p}" for p in found))


def check_free(spec: RLHFJobSpec, shape: ModelShape, free_bytes: float, role: str | None = None,
               device: str = "this device") -> str | None:
    """A rank's start-up check: the same estimate against the memory free on its device (on a GPU
    torch.cuda.mem_get_info()[0]; on CPU MemAvailable over the ranks on the host). Role: by default the trainer
    rank's own, or colocated the whole device's, both ranks through both phases (checked before either rank
    allocates). None when it fits, else the message naming the field to change."""
    role = role or ("colocated" if spec.placement == "colocated" else "trainer")
    return _check(spec, shape, role, free_bytes, f"the {gib(free_bytes)} free on {device}")


# What each role's fixes change, in the order they are preferred: the cheapest in speed or GPUs first.
FIXES = {"trainer": ("algorithm.maxTokensPerMicroBatch", "trainer.activationCheckpointing", "trainer.gpusPerPod",
                     "trainer.replicas", "trainer.cpuOffload"),
         "generator": ("generator.memoryUtilization", "model.dtype", "generator.maxSeq"),
         "generator-vllm": ("generator.vllm.gpuMemoryUtilization", "model.dtype", "generator.vllm.tensorParallelSize"),
         # Colocated, the pods are the generator's: more of them, or more GPUs each, shard the trainer further.
         "colocated": ("algorithm.maxTokensPerMicroBatch", "trainer.activationCheckpointing",
                       "generator.memoryUtilization", "model.dtype", "generator.maxSeq", "generator.gpusPerPod",
                       "generator.replicas", "trainer.cpuOffload"),
         "colocated-vllm": ("algorithm.maxTokensPerMicroBatch", "trainer.activationCheckpointing",
                            "generator.vllm.gpuMemoryUtilization", "model.dtype", "generator.vllm.tensorParallelSize",
                            "generator.gpusPerPod", "generator.replicas", "trainer.cpuOffload")}


def _fix_fields(spec: RLHFJobSpec, role: str) -> tuple[str, ...]:
    return FIXES[f"{role}-vllm" if role in ("generator", "colocated") and spec.generator.engine == "vllm" else role]


MAX_REPLICAS = 64  # the most trainer pods (colocated: pods) a fix suggests


def _check(spec: RLHFJobSpec, shape: ModelShape, role: str, capacity: float, of: str) -> str | None:
    limits = budgets(spec, shape, role, capacity)
    if all(b.fits for b in limits):
        return None
    template = spec.generator if role == "colocated" else getattr(spec, role)
    unit = "GPU" if template.gpus_per_pod > 0 else "rank"
    if role == "colocated":
        who = (f"a {unit} of colocated {shape.name} (a trainer rank and an engine rank) needs "
               + "; and ".join(_phase(spec, shape, b, of) for b in limits if not b.fits))
        room = ""
    else:
        (limit,) = limits
        who = f"a {role} rank of {shape.name} needs {gib(limit.need)} per {unit}"
        room = f", more than the {gib(limit.allowed)} it may use of {of}"
        if role == "generator" and spec.generator.engine == "vllm":
            tp = spec.generator.vllm.tensor_parallel_size
            who = (f"a vLLM engine of {shape.name} needs {gib(limit.need)} per GPU (its 1/{tp} of the weights and of "
                   f"the KV cache of one sequence of maxModelLen={max_len(spec)} tokens; vLLM's own working memory is "
                   f"not counted)")
        elif role == "generator":
            who += (f" (weights, working memory and the KV cache of one sequence of maxSeq={spec.generator.max_seq} "
                    f"tokens)")
        else:
            room = f", more than the {gib(limit.allowed)} usable of {of} ({HEADROOM:.0%} kept free)"
    fixes = list(_fixes(spec, shape, role, capacity))
    if not fixes:
        selector = "generator" if role == "colocated" else role
        return (f"spec.{selector}.nodeSelector: {who}{room}, and no single change of "
                f"{', '.join(_fix_fields(spec, role))} fits; use GPUs with more memory")

    def result(fixed: list[Budget]) -> str:
        if role == "colocated":
            return ", ".join(f"{b.name} {gib(b.need)} of {gib(b.allowed)}" for b in fixed)
        (b,) = fixed
        return gib(b.need) + (f" of {gib(b.allowed)}" if b.allowed != limits[0].allowed else "")

    (path, now, new, fixed), *others = fixes
    name = path.rsplit(".", 1)[1]
    also = "; also fits: " + ", ".join(f"{p}={_text(v)} ({result(f)})" for p, _, v, f in others) if others else ""
    if role == "colocated":
        return f"spec.{path}: with {name}={_text(now)}, {who}; with {name}={_text(new)}: {result(fixed)}{also}"
    return f"spec.{path}: {who} with {name}={_text(now)}{room}; with {name}={_text(new)}: {result(fixed)}{also}"


def _phase(spec: RLHFJobSpec, shape: ModelShape, b: Budget, of: str) -> str:
    """A colocated phase's need over its limit, with its parts: `101.8 GiB to train (...), more than the 71.7 GiB usable
    of ...`."""
    trainer, weights = trainer_resident_bytes(spec, shape), _engine_weights(spec, shape)[1]
    beside = {"generate": f"the engine's weights {gib(weights)}, its working memory and the KV cache of one sequence "
                          f"of {max_len(spec)} tokens {gib(b.need - trainer - weights)}",
              "train": f"gradients, activations and buffers {gib(b.need - trainer)}",
              "hand-over": f"the engine's weights {gib(weights)} and a bucket in transit"}[b.name]
    knob = "vllm.gpuMemoryUtilization" if spec.generator.engine == "vllm" else "memoryUtilization"
    limit = (f"the {gib(b.allowed)} that {knob}={utilization(spec)} allows of {of}" if b.name == "generate"
             else f"the {gib(b.allowed)} usable of {of} ({HEADROOM:.0%} kept free)")
    verb = {"hand-over": "hand the weights over"}.get(b.name, b.name)
    return f"{gib(b.need)} to {verb} (the trainer's states {gib(trainer)}; {beside}), more than {limit}"


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)  # as YAML writes it


def _fixes(spec: RLHFJobSpec, shape: ModelShape, role: str,
           capacity: float) -> Iterator[tuple[str, Any, Any, list[Budget]]]:
    """(field path, its value now, the least change of it that fits, the budgets with it) for each field of
    FIXES[role] that has one; a change that would make the spec invalid is not one."""
    a, t, g = spec.algorithm, spec.trainer, spec.generator
    v = g.vllm
    halved = [1 << i for i in range(a.max_tokens_per_micro_batch.bit_length() - 1, 0, -1)]
    more_gpus = lambda now: [n for n in tp_degrees(MAX_GPUS_PER_POD) if 0 < now < n]  # noqa: E731
    tried = {"algorithm.maxTokensPerMicroBatch": (a.max_tokens_per_micro_batch, [
                 n for n in [*halved, g.max_seq] if g.max_seq <= n < a.max_tokens_per_micro_batch]),
             "trainer.activationCheckpointing": (t.checkpointing, [True] * (not t.checkpointing)),
             "trainer.gpusPerPod": (t.gpus_per_pod, more_gpus(t.gpus_per_pod)),
             "trainer.replicas": (t.replicas, range(t.replicas + 1, MAX_REPLICAS + 1)),
             "trainer.cpuOffload": (t.cpu_offload, [True] * (t.gpus_per_pod > 0 and not t.cpu_offload)),
             "generator.memoryUtilization": (g.memory_utilization, [
                 u / 100 for u in range(int(g.memory_utilization * 100) + 1, 101)]),
             "model.dtype": (spec.model.dtype, ["bfloat16"] * (spec.model.dtype == "float32")),
             "generator.maxSeq": (g.max_seq, range((g.max_seq - 1) // 256 * 256, 0, -256)),
             "generator.gpusPerPod": (g.gpus_per_pod, more_gpus(g.gpus_per_pod)),
             "generator.replicas": (g.replicas, range(g.replicas + 1, MAX_REPLICAS + 1)),
             "generator.vllm.gpuMemoryUtilization": (v.gpu_memory_utilization, [
                 u / 100 for u in range(int(v.gpu_memory_utilization * 100) + 1, 101)]),
             "generator.vllm.tensorParallelSize": (v.tensor_parallel_size, [
                 n for n in range(v.tensor_parallel_size + 1, g.ranks + 1) if shape.heads % n == 0])}
    for path in _fix_fields(spec, role):
        now, values = tried[path]
        for value in values:
            # One rank per GPU: a new gpusPerPod takes ranksPerPod with it.
            ranks = {path.replace("gpusPerPod", "ranksPerPod"): None} if path.endswith("gpusPerPod") else {}
            changed = _changed(spec, {path: value, **ranks})
            limits = [] if changed is None else budgets(changed, shape, role, capacity)
            if limits and all(b.fits for b in limits):
                yield path, now, value, limits
                break


def _changed(spec: RLHFJobSpec, changes: dict[str, Any]) -> RLHFJobSpec | None:
    """The spec with these fields (dotted wire names) changed, or None when that is not a valid spec."""
    doc = _document(spec)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = doc
        for part in parents:
            node = node[part]
        node[leaf] = value
    try:
        return RLHFJobSpec.model_validate(doc)
    except ValidationError:
        return None


def _document(spec: RLHFJobSpec) -> dict[str, Any]:
    """The spec as its YAML would be, for a changed copy. Colocated, without the trainer's pod settings: they are
    the generator's, and follow a changed generator."""
    pod = {"trainer": set(COLOCATED_POD_FIELDS) | {"ranks_per_pod"}} if spec.placement == "colocated" else None
    return spec.model_dump(by_alias=True, exclude=pod)


def colocated_equivalent(spec: RLHFJobSpec) -> RLHFJobSpec | None:
    """A separate job's GPUs as one colocated gang: all its GPUs (trainer and generator pods) in pods of the
    generator's shape, on the generator's GPUs; None on CPU, when they do not make whole pods, or when that job is not
    valid (e.g. too few responses for its trainer ranks)."""
    t, g = spec.trainer, spec.generator
    gpus = t.replicas * t.gpus_per_pod + g.replicas * g.gpus_per_pod
    if spec.placement == "colocated" or not (t.gpus_per_pod and g.gpus_per_pod) or gpus % g.gpus_per_pod:
        return None
    doc = _document(spec.model_copy(update={"placement": "colocated"}))
    doc["generator"]["replicas"] = gpus // g.gpus_per_pod
    try:
        return RLHFJobSpec.model_validate(doc)
    except ValidationError:
        return None
