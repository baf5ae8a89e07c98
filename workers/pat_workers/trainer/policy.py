"""The trained policy: a model directory's weights as torch Parameters, computed with the engine's layer maths.

One model implementation serves generation and training: each transformer block here runs engine/model.py's
functions (attention inputs, SwiGLU) over its own Parameters, with causal attention over the sequences instead of
the engine's KV cache, so what the trainer optimises is what the generator samples.

The sequences of a micro-batch are packed into one row, no padding: each attends to itself only, its positions
restart at 0 (`packed_attention`).

For training at scale the policy is sharded with FSDP2 (`sharded_policy`): `fully_shard` per block and at the
root, each block optionally recomputing its activations in the backward pass; the log-probabilities are
computed a chunk of tokens at a time (`token_logprobs`), so no [tokens, vocab] logits tensor ever exists.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from pat_operator.fit import LOSS_CHUNK_TOKENS

from ..engine.config import ModelConfig
from ..engine.loader import load_weights, weight_shapes
from ..engine.model import attention_inputs, mlp, rms_norm, rope_tables, unfused_layer


class ResponseLogprobs(NamedTuple):
    logprobs: torch.Tensor  # [B, R]: log p(token | prefix) of each response token; 0 past a response's end
    mask: torch.Tensor  # [B, R] bool: True at response tokens
    entropy: torch.Tensor  # [B, R]: next-token entropy at each response token (detached, for logging); 0 past


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# FlexAttention runs compiled or not at all (uncompiled it materialises every score). Compiled once per shape;
# torch marks the packed row's length dynamic when it first changes, so a second compile serves every length.
_flex_attention = torch.compile(flex_attention)
_block_mask = torch.compile(create_block_mask)
FLEX_BLOCK = 128  # FlexAttention's block: the packed row is padded to a multiple of it for the kernel


def packed_attention(lengths: list[int], device: torch.device, flex: bool) -> Attention:
    """Causal attention within each of the sequences of `lengths` packed into one row: q [1, heads, T, d], k and v
    [1, kv_heads, T, d], T = sum(lengths) -> [1, heads, T, d].

    flex (on CUDA): one FlexAttention kernel over the row with a document mask, fully masked blocks skipped. On
    CPU: causal scaled_dot_product_attention over each sequence's slice, since FlexAttention has no CPU backward
    ("does not support backward on CPU", torch 2.13), and SDPA over the whole row with a block-diagonal mask
    computes every score of the row: 8x the time on 4230 tokens of 16 sequences here (docs/benchmarks.md)."""
    if not flex:
        def per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.cat([F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
                              for qkv in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))], 2)
        return per_sequence
    total = sum(lengths)
    padding = -total % FLEX_BLOCK  # a sequence of its own: every query attends to something
    sequence = torch.repeat_interleave(torch.tensor(lengths + [padding], device=device))

    def same_sequence(b, h, q_idx, kv_idx):
        return (sequence[q_idx] == sequence[kv_idx]) & (kv_idx <= q_idx)

    mask = _block_mask(same_sequence, None, None, total + padding, total + padding, device=device)

    def document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (F.pad(t, (0, 0, 0, padding)) for t in (q, k, v))
        return _flex_attention(q, k, v, block_mask=mask, enable_gqa=True)[:, :, :total]
    return document


class Block(torch.nn.Module):
    """model.layers.N: its Parameters are the Hugging Face ones under that prefix (self_attn.q_proj.weight, ...).
    An FSDP2 unit: its parameters are gathered only while it runs."""

    def __init__(self, cfg: ModelConfig, checkpointing: bool):
        super().__init__()
        self.cfg, self.checkpointing = cfg, checkpointing

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attention) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():  # keep the input only; recompute the rest backward
            return checkpoint(self._layer, x, cos, sin, attend, use_reentrant=False)
        return self._layer(x, cos, sin, attend)

    def _layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attention) -> torch.Tensor:
        cfg, (b, t, _) = self.cfg, x.shape
        layer = unfused_layer(dict(self.named_parameters()), "")  # read here: FSDP swaps in the gathered weights
        q, k, v = attention_inputs(cfg, layer, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin,
                                   cfg.num_heads, cfg.num_kv_heads)
        attn = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, -1), layer.wo, layer.bo)
        out = mlp(layer, rms_norm(x, layer.post_norm, cfg.rms_norm_eps))
        return x + out if layer.b_down is None else x + out + layer.b_down


class Policy(torch.nn.Module):
    """Parameters named as Hugging Face names them: each dotted name is a path of submodules, so that
    named_parameters() and state_dict() give the Hugging Face names (model.layers.0.mlp.up_proj.weight).

    device="meta" builds the structure without reading the weights (for FSDP2: shard first, then load).
    A frozen reference policy is Policy(path).requires_grad_(False).
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", checkpointing: bool = False):
        super().__init__()
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(model_dir)
        if torch.device(device).type == "meta":
            weights = {name: torch.empty(shape, dtype=dtype, device="meta")
                       for name, shape in weight_shapes(model_dir).items()}
        else:
            weights = load_weights(model_dir, dtype, device)
        for name in sorted(weights):
            *path, leaf = name.split(".")
            module: torch.nn.Module = self
            for i, part in enumerate(path):
                if part not in module._modules:
                    is_block = path[:i] == ["model", "layers"]
                    module.add_module(part, Block(self.config, checkpointing) if is_block else torch.nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, torch.nn.Parameter(weights[name]))
        self.blocks = [self.model.layers._modules[str(i)] for i in range(self.config.num_layers)]

    def forward(self, tokens: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor
                ) -> ResponseLogprobs:
        """Scores B sequences of prompt + response tokens packed into one row, tokens [T] with T the sum of their
        lengths; R = max(response_lens). The log-probabilities are of the raw logits (temperature 1), as the engine
        reports them for sampled tokens."""
        cfg, device = self.config, tokens.device
        if tokens.dim() != 1 or prompt_lens.dim() != 1 or prompt_lens.shape != response_lens.shape:
            raise ValueError(f"tokens must be one packed row [T] and prompt_lens, response_lens one entry per "
                             f"sequence each; got {tuple(tokens.shape)}, {tuple(prompt_lens.shape)} and "
                             f"{tuple(response_lens.shape)}")
        lengths = prompt_lens + response_lens
        if (prompt_lens < 1).any() or (response_lens < 0).any() or int(lengths.sum()) != len(tokens):
            raise ValueError(f"each sequence needs prompt_len >= 1 (a token to predict the first response token "
                             f"from) and response_len >= 0, and the lengths must add up to the row ({len(tokens)})")
        starts = lengths.cumsum(0) - lengths
        positions = torch.arange(len(tokens), device=device) - starts.repeat_interleave(lengths)  # 0 per sequence
        x = self.model.embed_tokens.weight[tokens][None]
        cos, sin = rope_tables(cfg, int(lengths.max()), device, x.dtype)
        cos, sin = cos[positions, None], sin[positions, None]  # [T, 1, d] against [1, T, heads, d]
        attend = packed_attention(lengths.tolist(), device, flex=device.type == "cuda")
        for block in self.blocks:
            x = block(x, cos, sin, attend)
        hidden = rms_norm(x[0], self.model.norm.weight, cfg.rms_norm_eps)
        offsets = torch.arange(int(response_lens.max()), device=device)
        mask = offsets < response_lens[:, None]
        where = (starts + prompt_lens)[:, None] + offsets  # [B, R]: each response token's place in the row
        # Each response token is predicted one position earlier; only real response tokens reach the lm_head.
        head = self.model.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight
        chosen, entropy = token_logprobs(hidden[where[mask] - 1], head, tokens[where[mask]])
        logprobs = torch.zeros(mask.shape, dtype=chosen.dtype, device=device).masked_scatter(mask, chosen)
        return ResponseLogprobs(logprobs, mask, torch.zeros_like(logprobs).masked_scatter(mask, entropy))


def token_logprobs(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
                   chunk: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) [N] (float32 at least) and the entropy [N] of each token's next-token distribution, from
    hidden states [N, hidden] and the lm_head [vocab, hidden], `chunk` tokens at a time. Each chunk is
    checkpointed: its logits are recomputed in the backward pass, not kept, so peak memory holds one chunk's
    logits, not [N, vocab] (~1 TB for 256 responses of 8K tokens over a 128K vocabulary)."""
    def one(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(h, w)
        # At least float32: bfloat16 log-probabilities are too coarse for the PPO ratio.
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, t[:, None])[:, 0], entropy

    run = (lambda *a: checkpoint(one, *a, use_reentrant=False)) if torch.is_grad_enabled() else one
    parts = [run(hidden[i:i + chunk], head, targets[i:i + chunk]) for i in range(0, max(len(hidden), 1), chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def sharded_policy(model_dir: str | Path, mesh: DeviceMesh, *, checkpointing: bool, bf16: bool,
                   cpu_offload: bool, trainable: bool = True) -> Policy:
    """The policy under FSDP2 over `mesh` (every rank of the trainer): fully_shard per block and at the root,
    float32 master weights (bf16 compute with float32 gradient reduction when `bf16`), parameters, gradients
    and optimizer states in host memory with `cpu_offload`. Built on the meta device and loaded through
    set_model_state_dict from rank 0's copy, so no rank ever holds a second full model on its device."""
    policy = Policy(model_dir, device="meta", checkpointing=checkpointing)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    # Pinned host memory speeds the copies to a GPU; without one there is nothing to pin (and torch refuses).
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    for block in policy.blocks:
        fully_shard(block, **options)
    fully_shard(policy, **options)
    policy.to_empty(device="cpu" if cpu_offload else mesh.device_type)
    full = load_weights(model_dir, torch.float32) if dist.get_rank() == 0 else {}
    set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return policy.requires_grad_(trainable)


def full_weights(policy: Policy):
    """(name, full tensor) of every weight in sorted-name order, gathered one at a time from the shards: a
    collective, every rank of the mesh iterates it. A plain (unsharded) policy yields its own detached tensors."""
    for name, p in sorted(policy.named_parameters()):
        yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()
