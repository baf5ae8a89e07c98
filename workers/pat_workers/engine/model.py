"""A decoder-only transformer (Llama-3 / Qwen2 / Qwen3) with tensor parallelism by weight views.

Every rank holds the full replica. A TP=t shard is a set of views into it: attention heads and MLP columns
are sliced (rows of q/k/v/gate/up, columns of o/down), so switching TP copies and transfers nothing.
Two all-reduces per layer (after o_proj and down_proj) and one all-gather of vocab-sharded logits per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

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
    wqkv: torch.Tensor  # [chunks x (q + k + v rows of a chunk), hidden]: one GEMM
    wo: torch.Tensor
    w_gate_up: torch.Tensor  # [chunks x (gate + up rows of a chunk), hidden]: one GEMM
    w_down: torch.Tensor
    chunks: int  # head chunks (and MLP chunks) this shard holds
    bqkv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    packed: Mapping[str, torch.Tensor] | None = None  # CPU: the GEMM weights prepacked for oneDNN (prepacked())

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ the weight `name`.T (+ bias): F.linear, or oneDNN's GEMM on its prepacked copy. On a 2-core x86 CPU that
        is 1.2-2.4x faster at 4-64 rows and slower at one row, where F.linear (a GEMV) runs."""
        packed = self.packed.get(name) if self.packed else None
        if packed is None or x.numel() == x.shape[-1]:
            return F.linear(x, getattr(self, name), bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


GEMMS = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's weights that prepacked() packs


def prepacked(layer: LayerShard) -> LayerShard:
    """The layer with its GEMM weights also prepacked for oneDNN (copies in its blocked layout: as much memory again
    as the shard's weights), as inductor's freezing and vLLM's CPU backend pack them. Eager CPU steps only: a
    compiled step fuses its own GEMMs, and a weight sync packs them again (Transformer.weights_changed).
    Written here because torch.compile's freezing packs weights only as constants of one compiled graph, which a
    weight sync every iteration would have to recompile (~30 s per TP size per rank on this CPU)."""
    rows = 16  # the batch the blocked layout is chosen for: a tail's
    return replace(layer, packed={name: torch.ops.mkldnn._reorder_linear_weight(getattr(layer, name), rows)
                                  for name in GEMMS})


def fuse_layer(cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, chunks: int) -> dict[str, torch.Tensor]:
    """Replaces q/k/v and gate/up of one layer by one tensor each, interleaved by chunk: chunk c holds the q, k and v
    rows of heads c/chunks (and the gate and up rows of MLP columns c/chunks), so the rows of any TP size's shard are
    one contiguous slice, and one GEMM computes them. The Hugging Face names stay, as strided views into the fused
    tensor, so a weight update writes through them (weightsync copies into views). Returns the fused tensors."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads // chunks, cfg.num_kv_heads // chunks
    fused = {}
    for name, parts in (("self_attn.qkv", (("self_attn.q_proj", hq * d), ("self_attn.k_proj", hkv * d),
                                           ("self_attn.v_proj", hkv * d))),
                        ("mlp.gate_up", (("mlp.gate_proj", cfg.intermediate_size // chunks),
                                         ("mlp.up_proj", cfg.intermediate_size // chunks)))):
        width = sum(rows for _, rows in parts)
        for kind in ("weight", "bias"):
            tensors = [w.get(f"{prefix}{part}.{kind}") for part, _ in parts]
            if tensors[0] is None:
                continue
            out = torch.empty(chunks, width, *tensors[0].shape[1:], dtype=tensors[0].dtype, device=tensors[0].device)
            at = 0
            for (part, rows), t in zip(parts, tensors):
                view = out[:, at:at + rows]
                view.copy_(t.view(chunks, rows, *t.shape[1:]))
                w[f"{prefix}{part}.{kind}"] = view  # the separate tensor is freed: one copy of the weights
                at += rows
            fused[f"{name}.{kind}"] = out.flatten(0, 1)
    return fused


def _whole(w: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor | None]:
    """What every rank holds whole of a layer at any TP: the norms, and the biases added after an all-reduce."""
    return dict(input_norm=w[prefix + "input_layernorm.weight"],
                post_norm=w[prefix + "post_attention_layernorm.weight"],
                bo=w.get(prefix + "self_attn.o_proj.bias"), b_down=w.get(prefix + "mlp.down_proj.bias"),
                q_norm=w.get(prefix + "self_attn.q_norm.weight"), k_norm=w.get(prefix + "self_attn.k_norm.weight"))


def layer_shard(w: Mapping[str, torch.Tensor], fused: Mapping[str, torch.Tensor], prefix: str, chunks: int, tp: int,
                index: int, q_cols: slice, mlp_cols: slice) -> LayerShard:
    """One layer's weights, sliced to a TP shard: views, no copies (fused rows of its chunks, o/down columns)."""
    per_rank = chunks // tp

    def rows(name: str) -> torch.Tensor | None:
        t = fused.get(name)
        if t is None:
            return None
        width = t.shape[0] // chunks
        return t[index * per_rank * width:(index + 1) * per_rank * width]

    return LayerShard(
        wqkv=rows("self_attn.qkv.weight"), wo=w[prefix + "self_attn.o_proj.weight"][:, q_cols],
        w_gate_up=rows("mlp.gate_up.weight"), w_down=w[prefix + "mlp.down_proj.weight"][:, mlp_cols],
        chunks=per_rank, bqkv=rows("self_attn.qkv.bias"), b_gate_up=rows("mlp.gate_up.bias"), **_whole(w, prefix))


def unfused_layer(w: Mapping[str, torch.Tensor], prefix: str) -> LayerShard:
    """One whole layer from separate Hugging Face weights (the trainer's parameters, which FSDP2 shards by name):
    q/k/v and gate/up concatenated at each call, through autograd, into the fused shapes the functions below take."""
    def cat(names: tuple[str, ...], kind: str) -> torch.Tensor | None:
        parts = [w.get(f"{prefix}{n}.{kind}") for n in names]
        return None if parts[0] is None else torch.cat(parts)
    qkv, gate_up = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")
    return LayerShard(
        wqkv=cat(qkv, "weight"), wo=w[prefix + "self_attn.o_proj.weight"], w_gate_up=cat(gate_up, "weight"),
        w_down=w[prefix + "mlp.down_proj.weight"], chunks=1, bqkv=cat(qkv, "bias"), b_gate_up=cat(gate_up, "bias"),
        **_whole(w, prefix))


def attention_inputs(cfg: ModelConfig, layer: LayerShard, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, heads, d], k and v [B, T, kv_heads, d] of normed hidden states h [B, T, hidden], RoPE applied
    (cos and sin broadcast to [B, T, 1, d])."""
    b, t, _ = h.shape
    d, c = cfg.head_dim, layer.chunks
    qkv = layer.linear("wqkv", h, layer.bqkv).view(b, t, c, -1)
    nq, nkv = heads // c * d, kv_heads // c * d
    q = qkv[..., :nq].reshape(b, t, heads, d)
    k = qkv[..., nq:nq + nkv].reshape(b, t, kv_heads, d)
    v = qkv[..., nq + nkv:].reshape(b, t, kv_heads, d)
    if layer.q_norm is not None:
        q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


def mlp(layer: LayerShard, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU without the down projection's bias (added once, after a TP all-reduce)."""
    b, t, _ = h.shape
    gate_up = layer.linear("w_gate_up", h, layer.b_gate_up).view(b, t, layer.chunks, 2, -1)
    return layer.linear("w_down", (F.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]).reshape(b, t, -1))


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


@torch.library.custom_op("pat::write_kv", mutates_args=("cache",))
def write_kv(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[:, slots] = values, in place. An op of its own, opaque to torch.compile: written as an index_put inside a
    compiled step, inductor copies the whole pool to keep the write functional (5x the step's time measured here)."""
    cache.index_copy_(1, slots, values)


@write_kv.register_fake
def _(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    return None


# FlexAttention runs compiled or not at all: uncompiled, it materialises every score of the whole pool and asks the
# mask function about every block (paged_decode_attention's answers only for the last). One compile per pool serves
# every batch and TP size: the rows are dynamic (paged_decode_attention marks them), a row's heads are the same at
# every TP size, and the pool's length and head size stay static (inductor's CPU template miscompiles a symbolic KV
# length: "cur_kvSplitSize1 was not declared"). Past the recompile limit torch would run it uncompiled: that must
# fail instead, and the limit allows a process many pools (tests, benchmarks; a serving rank has one).
torch._dynamo.config.fail_on_recompile_limit_hit = True
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
_flex_attention = torch.compile(flex_attention)


@dataclass
class DecodeMask:
    """The block mask of a decode step as plain tensors (see decode_mask), so that it crosses the op boundary."""

    partial: torch.Tensor  # [R, 1, 1, >= pool blocks] int32: the row's last block first
    full_counts: torch.Tensor  # [R, 1, 1] int32: whole blocks before it
    full: torch.Tensor  # [R, 1, 1, >= pool blocks] int32: the row's table first
    offsets: torch.Tensor  # [R]: the last position's offset in the last block
    block_size: int


def decode_mask(kv: PagedKV, tables: torch.Tensor, positions: torch.Tensor) -> DecodeMask:
    """The block mask of a decode step over tables [B, g, W] (padding: block 0, scratch) and positions [B]: each
    (request, head group) is a row r of the attention, which attends to its blocks tables[r, :n] whole but the last,
    and in the last to the positions up to its request's. Each row costs its own length."""
    positions = positions.repeat_interleave(tables.shape[1])
    tables = tables.flatten(0, 1)
    rows, width = tables.shape
    bs = kv.block_size
    last = torch.div(positions, bs, rounding_mode="floor")  # index of the last block in each table
    # CPU's kernel wants the index tensors as wide as the pool; it reads only each row's first entries.
    full, partial = kv.mask_indices(rows, width)
    full[:, 0, 0, :width] = tables
    partial[:, 0, 0, :1] = tables.gather(1, last[:, None])
    return DecodeMask(partial, last.to(torch.int32).view(rows, 1, 1), full, positions % bs, bs)


@torch.library.custom_op("pat::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, partial: torch.Tensor,
                           full_counts: torch.Tensor, full: torch.Tensor, offsets: torch.Tensor, block_size: int
                           ) -> torch.Tensor:
    """Attention of one new token per row over its own KV blocks, read in place: q [R, heads, 1, d] (R = rows x head
    groups), keys and values [heads_per_block, slots, d] (the pool of one layer), the mask's tensors (DecodeMask).

    An op of its own: a compiled step calls the compiled kernel as one extern call (inductor's CPU template fails to
    build inside larger graphs), and a CUDA graph captures its kernels. The compiled kernel asks the mask function
    only about each row's last block (the others are listed full), which is all it answers for: FlexAttention's
    uncompiled path would ask it about every block, so it must never run (see _flex_attention). An exact function
    would index a table by kv_idx, which inductor's CPU template miscompiles with dynamic rows ("cur_kvSplitSize9 was
    not declared")."""
    def within(b, h, q_idx, kv_idx):
        return kv_idx % block_size <= offsets[b]
    for rows in (q, partial, full_counts, full, offsets):
        torch._dynamo.maybe_mark_dynamic(rows, 0)
    for t in (keys, values):  # a symbolic pool length or head size miscompiles on CPU: recompile instead
        torch._dynamo.mark_static(t)
    mask = BlockMask.from_kv_blocks(torch.ones_like(full_counts), partial, full_counts, full,
                                    BLOCK_SIZE=(128, block_size), mask_mod=within,
                                    seq_lengths=(1, keys.shape[1]), compute_q_blocks=False)
    try:
        return _flex_attention(q, keys[None], values[None], block_mask=mask, enable_gqa=True)
    except Exception as e:  # a device or block size without a FlexAttention kernel: never a silent fallback
        raise RuntimeError(f"FlexAttention's paged decode failed on device {q.device.type} with the KV block size "
                           f"{block_size} (engine option block_size): {e}") from e


@paged_decode_attention.register_fake
def _(q, keys, values, partial, full_counts, full, offsets, block_size):
    return torch.empty_like(q)


def fuse_chunks(cfg: ModelConfig) -> int:
    """Chunks of the fused weights: the largest power of two dividing the KV heads and the MLP width, so that every TP
    size the model allows takes whole chunks."""
    n = math.gcd(cfg.num_kv_heads, cfg.intermediate_size)
    return n & -n


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        """Takes `weights` over: its q/k/v and gate/up entries become views of the fused tensors (fuse_layer), so
        that the separate tensors are freed. A caller that uses the dict afterwards passes a copy."""
        self.cfg = cfg
        self.w = weights
        self.device = weights["model.embed_tokens.weight"].device
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        self.cos, self.sin = rope_tables(cfg, cfg.max_position_embeddings, self.device, self.dtype)
        self.hf_shapes = {name: tuple(t.shape) for name, t in weights.items()}  # as a checkpoint or a sync has them
        self.chunks = fuse_chunks(cfg)
        self.fused = [fuse_layer(cfg, weights, f"model.layers.{i}.", self.chunks) for i in range(cfg.num_layers)]
        self._packed: dict[tuple[int, int], list[LayerShard]] = {}  # (tp, index) -> its prepacked layers
        self._released: list[tuple[torch.UntypedStorage, int]] = []  # the weights' storages and their sizes

    def weights_changed(self) -> None:
        """The weights were written in place (a sync): the prepacked shards are stale. Each is packed again now,
        between batches, so that a regroup into its TP size later does not wait for it."""
        stale, self._packed = list(self._packed), {}
        for tp, index in stale:
            self.shard(tp, index, prepack=True)

    def drop_packed(self) -> None:
        """Gives back every prepacked shard (an engine that releases its memory); shard() packs again."""
        self._packed = {}

    def release_weights(self) -> None:
        """Gives back the weights' memory and keeps every tensor (and view) of them, with its shape, for
        reserve_weights; their values are lost. FSDP2 frees and refills its unsharded parameters the same way
        (resizing their storages). Shards taken before are left pointing at nothing: take them again after."""
        if self._released:
            return
        storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for t in [*self.w.values(), *(f for layer in self.fused for f in layer.values())]:
            if not t.untyped_storage().resizable():
                # The loader's tensors are views of safetensors' buffer, which cannot be resized: each gets a storage
                # of its own first (allocated, never written, so it takes no memory before it is freed).
                t.set_(torch.UntypedStorage(t.numel() * t.element_size(), device=t.device), 0, t.shape, t.stride())
            s = t.untyped_storage()
            storages.setdefault(s.data_ptr(), (s, s.nbytes()))
        for s, _ in storages.values():
            s.resize_(0)
        self._released = list(storages.values())

    def reserve_weights(self) -> None:
        """Takes the released weights' memory again, their values undefined until a weight update writes them."""
        for s, nbytes in self._released:
            s.resize_(nbytes)
        self._released = []

    def check_tp(self, tp: int) -> None:
        cfg = self.cfg
        for name, n in (("num_key_value_heads", cfg.num_kv_heads), ("intermediate_size", cfg.intermediate_size)):
            if n % tp:
                raise ValueError(f"TP={tp} does not divide {name}={n}; use a TP size that divides it")

    def shard(self, tp: int, index: int, prepack: bool = False) -> Shard:
        """The weights rank `index` of a TP=tp group computes with: views of the replica; with `prepack` (CPU) the
        layers' GEMM weights also prepacked (kept per TP shard until weights_changed())."""
        self.check_tp(tp)
        cfg, d = self.cfg, self.cfg.head_dim
        hq, hkv, inter = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
        q_cols = slice(index * hq * d, (index + 1) * hq * d)
        mlp_cols = slice(index * inter, (index + 1) * inter)
        if prepack and (tp, index) in self._packed:
            layers = self._packed[tp, index]
        else:
            layers = [layer_shard(self.w, fused, f"model.layers.{i}.", self.chunks, tp, index, q_cols, mlp_cols)
                      for i, fused in enumerate(self.fused)]
            if prepack:
                layers = self._packed[tp, index] = [prepacked(layer) for layer in layers]
        sharded = cfg.vocab_size % tp == 0
        vocab = cfg.vocab_size // tp
        lm_head = self.lm_head[index * vocab:(index + 1) * vocab] if sharded else self.lm_head
        return Shard(tp, index, hq, hkv, index * hkv, layers, lm_head, sharded)

    def forward(self, shard: Shard, comm: Communicator, kv: PagedKV, tokens: torch.Tensor, start: torch.Tensor,
                tables: torch.Tensor, last: torch.Tensor | None = None, all_positions: bool = False) -> torch.Tensor:
        """Runs tokens [B, T] whose first position is start [B]; returns logits [B, vocab] at index `last` [B]
        of each row (default T-1: rows of a batched prefill are right-padded to T), or [B, T, vocab] at every
        position with `all_positions`.

        T = 1 is a decode step: the token at position start is written into the cache, then attends to its row's
        blocks in place (paged FlexAttention). T > 1 is a prefill from position 0 (start must be 0): its keys and
        values are written, and it attends causally to them as computed, reading nothing from the cache.
        tables [B, g, blocks] are the rows' block tables on this rank (g head groups; padding entries are block 0,
        scratch). Shapes depend only on B, T and the table's width, so a CUDA graph can capture the step.
        """
        cfg, d = self.cfg, self.cfg.head_dim
        b, t = tokens.shape
        g, bs = tables.shape[1], kv.block_size
        if t > 1 and start.any():
            raise ValueError("a forward of several tokens is a prefill from position 0: use start 0, or decode the "
                             "tokens one at a time")
        positions = start[:, None] + torch.arange(t, device=tokens.device)  # [B, T]
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, T, 1, d]
        # The slot of each (row, head group, position): [B, g, T].
        slots = (torch.gather(tables, 2, (positions // bs)[:, None].expand(b, g, t)) * bs
                 + (positions % bs)[:, None]).flatten()
        mask = decode_mask(kv, tables, start) if t == 1 else None
        hpb, rep = shard.num_kv_heads // g, shard.num_heads // shard.num_kv_heads
        rows = torch.arange(b, device=tokens.device)[:, None]
        x = self.w["model.embed_tokens.weight"][tokens]
        for i, layer in enumerate(shard.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = attention_inputs(cfg, layer, h, cos, sin, shard.num_heads, shard.num_kv_heads)
            keys, values = kv.layer(i)  # [heads_per_block, slots, d]
            # [B, T, g x hpb, d] -> [hpb, B x g x T, d], the order of `slots`
            write_kv(keys, slots, k.view(b, t, g, hpb, d).permute(3, 0, 2, 1, 4).reshape(hpb, -1, d))
            write_kv(values, slots, v.view(b, t, g, hpb, d).permute(3, 0, 2, 1, 4).reshape(hpb, -1, d))
            if mask is not None:  # each (row, head group) is a row of the paged attention
                attn = paged_decode_attention(q.view(b * g, hpb * rep, 1, d), keys, values, *vars(mask).values())
            else:
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True)
            out = layer.linear("wo", attn.reshape(b, shard.num_heads, t, d).transpose(1, 2).reshape(b, t, -1))
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
