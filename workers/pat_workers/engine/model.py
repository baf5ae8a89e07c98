"""A decoder-only transformer (Llama-3 / Qwen2 / Qwen3) with tensor parallelism by weight views.

Every rank holds the full replica. A TP=t shard is a set of views into it: attention heads and MLP columns
are sliced (rows of q/k/v/gate/up, columns of o/down), so switching TP copies and transfers nothing.
Two all-reduces per layer (after o_proj and down_proj) and one all-gather of vocab-sharded logits per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .comm import Communicator
from .config import ModelConfig
from .kv import PagedKV


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def rope_tables(cfg: ModelConfig, length: int, device: torch.device | str, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] of positions 0..length-1."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), rope_inv_freq(cfg))
    emb = torch.cat([freqs, freqs], dim=-1).to(device)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers does it: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class LayerShard:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def layer_shard(w: Mapping[str, torch.Tensor], prefix: str, q_rows: slice = slice(None),
                kv_rows: slice = slice(None), mlp_rows: slice = slice(None)) -> LayerShard:
    """One layer's weights under `prefix` (Hugging Face names), sliced to a TP shard's rows: views, no copies."""
    def get(name: str, rows: slice | None = None) -> torch.Tensor | None:
        t = w.get(prefix + name)
        return t if t is None or rows is None else t[rows]

    return LayerShard(
        input_norm=get("input_layernorm.weight"), post_norm=get("post_attention_layernorm.weight"),
        wq=get("self_attn.q_proj.weight", q_rows), wk=get("self_attn.k_proj.weight", kv_rows),
        wv=get("self_attn.v_proj.weight", kv_rows), wo=w[prefix + "self_attn.o_proj.weight"][:, q_rows],
        w_gate=get("mlp.gate_proj.weight", mlp_rows), w_up=get("mlp.up_proj.weight", mlp_rows),
        w_down=w[prefix + "mlp.down_proj.weight"][:, mlp_rows],
        bq=get("self_attn.q_proj.bias", q_rows), bk=get("self_attn.k_proj.bias", kv_rows),
        bv=get("self_attn.v_proj.bias", kv_rows), bo=get("self_attn.o_proj.bias"),
        b_gate=get("mlp.gate_proj.bias", mlp_rows), b_up=get("mlp.up_proj.bias", mlp_rows),
        b_down=get("mlp.down_proj.bias"), q_norm=get("self_attn.q_norm.weight"), k_norm=get("self_attn.k_norm.weight"))


def attention_inputs(cfg: ModelConfig, layer: LayerShard, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, heads, d], k and v [B, T, kv_heads, d] of normed hidden states h [B, T, hidden], RoPE applied
    (cos and sin broadcast to [B, T, 1, d])."""
    b, t, _ = h.shape
    q = F.linear(h, layer.wq, layer.bq).view(b, t, heads, cfg.head_dim)
    k = F.linear(h, layer.wk, layer.bk).view(b, t, kv_heads, cfg.head_dim)
    v = F.linear(h, layer.wv, layer.bv).view(b, t, kv_heads, cfg.head_dim)
    if layer.q_norm is not None:
        q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


def mlp(layer: LayerShard, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU without the down projection's bias (added once, after a TP all-reduce)."""
    return F.linear(F.silu(F.linear(h, layer.w_gate, layer.b_gate)) * F.linear(h, layer.w_up, layer.b_up),
                    layer.w_down)


@dataclass
class Shard:
    """What one rank of a TP group computes with: views of the replica, never copies."""

    tp: int
    index: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # first global KV head held
    layers: list[LayerShard]
    lm_head: torch.Tensor  # vocab rows of this rank, or all rows when the vocab does not divide by tp
    lm_head_sharded: bool


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights
        self.device = weights["model.embed_tokens.weight"].device
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        self.cos, self.sin = rope_tables(cfg, cfg.max_position_embeddings, self.device, self.dtype)

    def check_tp(self, tp: int) -> None:
        cfg = self.cfg
        for name, n in (("num_key_value_heads", cfg.num_kv_heads), ("intermediate_size", cfg.intermediate_size)):
            if n % tp:
                raise ValueError(f"TP={tp} does not divide {name}={n}; use a TP size that divides it")

    def shard(self, tp: int, index: int) -> Shard:
        self.check_tp(tp)
        cfg, d = self.cfg, self.cfg.head_dim
        hq, hkv, inter = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
        q_rows = slice(index * hq * d, (index + 1) * hq * d)
        kv_rows = slice(index * hkv * d, (index + 1) * hkv * d)
        mlp_rows = slice(index * inter, (index + 1) * inter)
        layers = [layer_shard(self.w, f"model.layers.{i}.", q_rows, kv_rows, mlp_rows) for i in range(cfg.num_layers)]
        sharded = cfg.vocab_size % tp == 0
        vocab = cfg.vocab_size // tp
        lm_head = self.lm_head[index * vocab:(index + 1) * vocab] if sharded else self.lm_head
        return Shard(tp, index, hq, hkv, index * hkv, layers, lm_head, sharded)

    def forward(self, shard: Shard, comm: Communicator, kv: PagedKV, tokens: torch.Tensor, start: torch.Tensor,
                tables: torch.Tensor, last: torch.Tensor | None = None, all_positions: bool = False) -> torch.Tensor:
        """Runs tokens [B, T] whose first position is start [B]; returns logits [B, vocab] at index `last` [B]
        of each row (default T-1: rows of a batched prefill are right-padded to T), or [B, T, vocab] at every
        position with `all_positions`.

        tables [B, g, blocks] are the rows' block tables on this rank (g head groups; padding entries are block 0,
        scratch). Positions start..start+T-1 are written, then blocks * block_size positions are read and masked
        causally: shapes depend only on B, T and the table's width, so a CUDA graph can capture the step.
        """
        cfg, d = self.cfg, self.cfg.head_dim
        b, t = tokens.shape
        g, bs = tables.shape[1], kv.block_size
        positions = start[:, None] + torch.arange(t, device=tokens.device)  # [B, T]
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, T, 1, d]
        offsets = torch.arange(bs, device=tokens.device)
        write = torch.gather(tables, 2, (positions // bs)[:, None].expand(b, g, t)) * bs + (positions % bs)[:, None]
        read = (tables[..., None] * bs + offsets).flatten(2)  # [B, g, L]: every slot of the rows' blocks
        length = read.shape[-1]
        # The query heads that share a KV head attend as rows of one query [B, kv heads, rep x T, d]: K and V are not
        # repeated per query head, and kernels that take a mask but not GQA (memory-efficient attention) apply.
        rep = shard.num_heads // shard.num_kv_heads
        mask = torch.arange(length, device=tokens.device) <= positions[..., None]  # [B, T, L]
        mask = mask[:, None, None].expand(b, 1, rep, t, length).reshape(b, 1, rep * t, length)
        rows = torch.arange(b, device=tokens.device)[:, None]
        x = self.w["model.embed_tokens.weight"][tokens]
        for i, layer in enumerate(shard.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = attention_inputs(cfg, layer, h, cos, sin, shard.num_heads, shard.num_kv_heads)
            keys, values = kv.layer(i)  # [slots, heads_per_block, d]
            keys[write] = k.view(b, t, g, -1, d).transpose(1, 2)  # [B, g, T, hpb, d] at slots [B, g, T]
            values[write] = v.view(b, t, g, -1, d).transpose(1, 2)
            k_all = keys[read].transpose(2, 3).reshape(b, shard.num_kv_heads, length, d)
            v_all = values[read].transpose(2, 3).reshape(b, shard.num_kv_heads, length, d)
            q = q.view(b, t, shard.num_kv_heads, rep, d).permute(0, 2, 3, 1, 4).reshape(b, shard.num_kv_heads, -1, d)
            attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)  # [B, kv heads, rep x T, d]
            attn = attn.view(b, shard.num_kv_heads, rep, t, d).permute(0, 3, 1, 2, 4)
            out = F.linear(attn.reshape(b, t, shard.num_heads * d), layer.wo)
            x = x + self._reduced(comm, out, layer.bo)
            x = x + self._reduced(comm, mlp(layer, rms_norm(x, layer.post_norm, cfg.rms_norm_eps)), layer.b_down)
        if not all_positions:
            x = x[:, -1] if last is None else x[rows[:, 0], last]
        logits = F.linear(rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps), shard.lm_head)
        if shard.lm_head_sharded and comm.size > 1:
            logits = torch.cat(comm.all_gather(logits.contiguous()), dim=-1)
        return logits

    @staticmethod
    def _reduced(comm: Communicator, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if comm.size > 1:
            comm.all_reduce_(partial)
        return partial if bias is None else partial + bias
