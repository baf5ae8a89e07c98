"""A decoder-only transformer (Llama-3 / Qwen2 / Qwen3) with tensor parallelism by weight views.

Every rank holds the full replica. A TP=t shard is a set of views into it: attention heads and MLP columns
are sliced (rows of q/k/v/gate/up, columns of o/down), so switching TP copies and transfers nothing.
Two all-reduces per layer (after o_proj and down_proj) and one all-gather of vocab-sharded logits per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .comm import Communicator, SoloCommunicator
from .config import ModelConfig
from .kv import KVCache


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
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1).to(self.device)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def check_tp(self, tp: int) -> None:
        cfg = self.cfg
        for name, n in (("num_key_value_heads", cfg.num_kv_heads), ("intermediate_size", cfg.intermediate_size)):
            if n % tp:
                raise ValueError(f"TP={tp} does not divide {name}={n}; use a TP size that divides it")

    def shard(self, tp: int, index: int) -> Shard:
        self.check_tp(tp)
        cfg, w, d = self.cfg, self.w, self.cfg.head_dim
        hq, hkv, inter = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
        q_rows = slice(index * hq * d, (index + 1) * hq * d)
        kv_rows = slice(index * hkv * d, (index + 1) * hkv * d)
        mlp_rows = slice(index * inter, (index + 1) * inter)

        def get(name: str, rows: slice | None = None) -> torch.Tensor | None:
            t = w.get(name)
            return t if t is None or rows is None else t[rows]

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layers.append(LayerShard(
                input_norm=w[p + "input_layernorm.weight"], post_norm=w[p + "post_attention_layernorm.weight"],
                wq=w[p + "self_attn.q_proj.weight"][q_rows], wk=w[p + "self_attn.k_proj.weight"][kv_rows],
                wv=w[p + "self_attn.v_proj.weight"][kv_rows], wo=w[p + "self_attn.o_proj.weight"][:, q_rows],
                w_gate=w[p + "mlp.gate_proj.weight"][mlp_rows], w_up=w[p + "mlp.up_proj.weight"][mlp_rows],
                w_down=w[p + "mlp.down_proj.weight"][:, mlp_rows],
                bq=get(p + "self_attn.q_proj.bias", q_rows), bk=get(p + "self_attn.k_proj.bias", kv_rows),
                bv=get(p + "self_attn.v_proj.bias", kv_rows), bo=get(p + "self_attn.o_proj.bias"),
                b_gate=get(p + "mlp.gate_proj.bias", mlp_rows), b_up=get(p + "mlp.up_proj.bias", mlp_rows),
                b_down=get(p + "mlp.down_proj.bias"),
                q_norm=get(p + "self_attn.q_norm.weight"), k_norm=get(p + "self_attn.k_norm.weight"),
            ))
        sharded = cfg.vocab_size % tp == 0
        vocab = cfg.vocab_size // tp
        lm_head = self.lm_head[index * vocab:(index + 1) * vocab] if sharded else self.lm_head
        return Shard(tp, index, hq, hkv, index * hkv, layers, lm_head, sharded)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As transformers does it: normalise in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, shard: Shard, comm: Communicator, tokens: torch.Tensor, start: torch.Tensor,
                k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], length: int | None = None,
                last: torch.Tensor | None = None, all_positions: bool = False) -> torch.Tensor:
        """Runs tokens [B, T] whose first position is start [B]; returns logits [B, vocab] at index `last` [B]
        of each row (default T-1: rows of a batched prefill are right-padded to T), or [B, T, vocab] at every
        position with `all_positions`.

        k_cache/v_cache[layer] are [B, local KV heads, max_seq, head_dim] views of the rows these sequences
        own; positions start..start+T-1 are written, 0..start+T-1 attended (causally). `length` fixes how many
        cache positions are attended (default: just enough), so that a CUDA graph can capture the step.
        """
        cfg, d = self.cfg, self.cfg.head_dim
        b, t = tokens.shape
        positions = start[:, None] + torch.arange(t, device=tokens.device)  # [B, T]
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, T, 1, d]
        length = length or int(start.max()) + t
        mask = torch.arange(length, device=tokens.device) <= positions[..., None]  # [B, T, L]
        mask = mask.unsqueeze(1)
        rows = torch.arange(b, device=tokens.device)[:, None]
        x = self.w["model.embed_tokens.weight"][tokens]
        for layer, k_all, v_all in zip(shard.layers, k_cache, v_cache):
            h = self.rms_norm(x, layer.input_norm)
            q = F.linear(h, layer.wq, layer.bq).view(b, t, shard.num_heads, d)
            k = F.linear(h, layer.wk, layer.bk).view(b, t, shard.num_kv_heads, d)
            v = F.linear(h, layer.wv, layer.bv).view(b, t, shard.num_kv_heads, d)
            if layer.q_norm is not None:
                q, k = self.rms_norm(q, layer.q_norm), self.rms_norm(k, layer.k_norm)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            k_all[rows, :, positions] = k  # [B, T, H, d] into [B, H, S, d] at (b, :, pos)
            v_all[rows, :, positions] = v
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_all[:, :, :length], v_all[:, :, :length], attn_mask=mask, enable_gqa=True)
            out = F.linear(attn.transpose(1, 2).reshape(b, t, shard.num_heads * d), layer.wo)
            x = x + self._reduced(comm, out, layer.bo)
            h = self.rms_norm(x, layer.post_norm)
            mlp = F.linear(F.silu(F.linear(h, layer.w_gate, layer.b_gate)) * F.linear(h, layer.w_up, layer.b_up),
                           layer.w_down)
            x = x + self._reduced(comm, mlp, layer.b_down)
        if not all_positions:
            x = x[:, -1] if last is None else x[rows[:, 0], last]
        logits = F.linear(self.rms_norm(x, self.w["model.norm.weight"]), shard.lm_head)
        if shard.lm_head_sharded and comm.size > 1:
            logits = torch.cat(comm.all_gather(logits.contiguous()), dim=-1)
        return logits

    def causal_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] at every position of rows [B, T] run from position 0 at TP=1 (right padding
        cannot reach earlier positions). No cache outlives the call, and the shard's views are built here, so
        the result is differentiable in whatever tensors `weights` holds (the trainer's parameters)."""
        b, t = tokens.shape
        cache = KVCache.allocate(self.cfg, slots=b, kv_heads=self.cfg.num_kv_heads, max_seq=t, dtype=self.dtype,
                                 device=tokens.device)
        start = torch.zeros(b, dtype=torch.long, device=tokens.device)
        return self.forward(self.shard(1, 0), SoloCommunicator(0), tokens, start, cache.k, cache.v,
                            all_positions=True)

    @staticmethod
    def _reduced(comm: Communicator, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if comm.size > 1:
            comm.all_reduce_(partial)
        return partial if bias is None else partial + bias
