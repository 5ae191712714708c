"""The rollout passes of the native decoder: prompt prefill, per-generate decode weights, one decode step.

Each group's prompt is prefilled once; its G completions decode against that one prompt KV (grouped
attention, `GroupLayout`), each with its own completion KV. The functions take the `NativeDecoder`
whose live weights and block pieces they use (model/decoder.py; `dec` below, untyped here because
that module imports this one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo import kernels
from grpo.model.arch import rms_norm, rotate
from grpo.model.linear import DecodeLinear, decode_onednn, linear


@dataclass
class PromptCache:
    """Per-layer KV of P prefilled prompts (right-padded) and the bias masking their padding."""

    keys: list[torch.Tensor]  # L × [P, Hkv, Lp, D]
    values: list[torch.Tensor]  # L × [P, Hkv, Lp, D]
    bias: torch.Tensor  # [P, 1, 1, Lp] 0 on real prompt tokens, −inf on padding
    lengths: torch.Tensor  # [P] long


@dataclass
class LayerWeights:
    """One block's weights as decoding uses them."""

    input_norm: torch.Tensor
    qkv: list[DecodeLinear]  # one fused q|k|v projection or three
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: DecodeLinear
    post_norm: torch.Tensor
    gate: DecodeLinear
    up: DecodeLinear
    down: DecodeLinear
    q_scaled: bool = False  # the attention scale is folded into the q projection
    # gate|up as one projection [W_g; W_u] (MKL's path, which has no fused epilogues to lose): one GEMM of
    # twice the width instead of two, the same numbers (each output is the same dot product)
    gate_up: DecodeLinear | None = None


@dataclass
class DecodeWeights:
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: DecodeLinear


class GroupLayout:
    """Which prompt each active decode row belongs to, and the padded [P, Gm] slot of each row.

    Rows are kept sorted by group; when rows finish and are dropped the layout is rebuilt, so the
    grouped prompt attention only ever touches live rows (plus padding up to the fullest group).
    """

    def __init__(self, row_group: torch.Tensor, prompt_lengths: torch.Tensor, num_groups: int):
        self.row_group = row_group  # [n] long, sorted
        counts = torch.bincount(row_group, minlength=num_groups)  # [P]
        self.num_groups, self.width = num_groups, max(int(counts.max().item()), 1)
        start = torch.cumsum(counts, 0) - counts  # [P]
        rank = torch.arange(row_group.numel(), device=row_group.device) - start[row_group]
        self.slot = row_group * self.width + rank  # [n]
        self.dense = bool((counts == self.width).all())  # every group full: slots are 0..n-1
        self.prompt_len_per_row = prompt_lengths[row_group]  # [n]

    def to_groups(self, x: torch.Tensor) -> torch.Tensor:
        """[n, Hkv, rep, X] per row → [P, Hkv, Gm·rep, X] per group."""
        _, hkv, rep, d = x.shape
        if not self.dense:
            x = x.new_zeros(self.num_groups * self.width, hkv, rep, d).index_copy(0, self.slot, x)
        return (
            x.view(self.num_groups, self.width, hkv, rep, d)
            .transpose(1, 2)
            .reshape(self.num_groups, hkv, self.width * rep, d)
        )

    def to_rows(self, x: torch.Tensor, rep: int) -> torch.Tensor:
        """[P, Hkv, Gm·rep, X] per group → [n, Hkv, rep, X] per row."""
        p, hkv, _, d = x.shape
        x = x.view(p, hkv, self.width, rep, d).transpose(1, 2).reshape(p * self.width, hkv, rep, d)
        return x if self.dense else x.index_select(0, self.slot)


def _causal_attention_with_lse(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention q [B, H, L, D] over k, v [B, Hkv, L, D]: the output and each query's log-sum-exp of
    its scaled scores [B, H, L]. On a CPU the fused kernel SDPA runs there (it returns both); elsewhere (a
    recording on a GPU, asked for explicitly) the plain formula."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[:2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return scores.softmax(-1).to(q.dtype) @ v, scores.logsumexp(-1)


# -- rollout ------------------------------------------------------------------------------------
def prefill(dec, prompts: list[list[int]], pad_id: int, record=None) -> tuple[PromptCache, torch.Tensor]:
    """Run each prompt once (right-padded, causal). Returns its KV and last-token logits [P, V].
    record: a model/replay.py `Recording` that keeps each layer's products (the same ops, the same bits)."""
    p, width = len(prompts), max(len(x) for x in prompts)
    lengths = torch.tensor([len(x) for x in prompts], device=dec.device)
    ids = torch.full((p, width), pad_id, dtype=torch.long)
    for i, x in enumerate(prompts):
        ids[i, : len(x)] = torch.tensor(x)
    ids = ids.to(dec.device)
    cos, sin = dec.rope(torch.arange(width, device=dec.device))  # [Lp, D]
    h = dec.embed(ids).view(p * width, -1)  # [P·Lp, d]
    cos, sin = cos.repeat(p, 1), sin.repeat(p, 1)
    keys, values = [], []
    for i, layer in enumerate(dec.layers):
        x = rms_norm(h, dec.w(layer.input_layernorm.weight), dec.eps)
        q, k, v = (
            dec.qkv(layer, x, cos, sin)
            if record is None
            else _recorded_qkv(dec, layer, x, cos, sin, record, i)
        )
        q, k, v = (t.view(p, width, -1, dec.head_dim).transpose(1, 2) for t in (q, k, v))  # [P, H, Lp, D]
        # Right padding: a real query never sees a pad key under the causal mask.
        if record is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=dec.scale)
        else:  # the log-sum-exps are kept too (the update's attention backward takes them)
            attn, lse = _causal_attention_with_lse(q, k, v, dec.scale)  # [P, H, Lp, D], [P, H, Lp]
            record.put(i, "lse", lse.transpose(1, 2).reshape(p * width, -1))
        attn = attn.transpose(1, 2).reshape(p * width, -1)
        if record is not None:
            record.put(i, "attn", attn)
        h = (
            dec.block_tail(layer, h, attn)
            if record is None
            else _recorded_tail(dec, layer, h, attn, record, i)
        )
        keys.append(k.contiguous())
        values.append(v.contiguous())
    last = h.view(p, width, -1)[torch.arange(p, device=dec.device), lengths - 1]  # [P, d]
    bias = torch.zeros(p, 1, 1, width, device=dec.device, dtype=dec.dtype)
    bias.masked_fill_(
        torch.arange(width, device=dec.device)[None, None, None] >= lengths[:, None, None, None],
        float("-inf"),
    )
    return PromptCache(keys, values, bias, lengths), dec.logits(last)


def _recorded_qkv(dec, layer, x, cos, sin, record, i):
    """`dec.qkv` (the same ops), keeping the q|k|v products."""
    a, s, w = layer.self_attn, x.shape[0], dec.w
    q, k, v = (linear(x, *dec.proj(m)) for m in (a.q_proj, a.k_proj, a.v_proj))
    record.put(i, "qkv", torch.cat([q, k, v], dim=-1))
    q, k = q.view(s, dec.num_heads, dec.head_dim), k.view(s, dec.num_kv_heads, dec.head_dim)
    if dec.qk_norm:
        q = rms_norm(q, w(a.q_norm.weight), dec.eps)
        k = rms_norm(k, w(a.k_norm.weight), dec.eps)
    v = v.view(s, dec.num_kv_heads, dec.head_dim)
    return rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None]), v


def _recorded_tail(dec, layer, h, attn, record, i):
    """`dec.block_tail` without a gradient (the same ops), keeping its products."""
    m = layer.mlp
    h = h + linear(attn, *dec.proj(layer.self_attn.o_proj))
    x = rms_norm(h, dec.w(layer.post_attention_layernorm.weight), dec.eps)
    gate, up = linear(x, dec.proj(m.gate_proj)[0]), linear(x, dec.proj(m.up_proj)[0])
    record.put(i, "gu", torch.cat([gate, up], dim=-1))
    h = h + linear(F.silu(gate) * up, dec.proj(m.down_proj)[0])
    record.put(i, "out", h)
    return h


def decode_weights(dec, fuse: bool, onednn: bool | None = None, copy: bool = True) -> DecodeWeights:
    """Weights for decoding, prepared once per generate call. fuse=True (the CPU path) concatenates
    q|k|v into one matmul and folds the attention scale into the q rows (RoPE is linear, so scaling
    before it is the same); onednn (default: fuse, for widths `linear.decode_onednn` sends there) puts
    every projection on oneDNN with its following elementwise op fused (see model/linear.py). On a
    CPU a decode step is bound by per-call overhead and small-GEMM efficiency, not arithmetic.
    Each of these makes a copy of the weights for the call; copy=False makes none (beyond a
    mixed-precision cast or a LoRA fold), decoding with plain F.linear on the live weights."""
    onednn = (fuse and decode_onednn(dec.hf.config.hidden_size)) if onednn is None else onednn
    fuse, onednn = fuse and copy, onednn and copy
    layers = []
    fold = fuse and not dec.qk_norm  # q/k RMSNorm would undo a scale folded into q
    w = dec.w  # mixed precision: the per-generate cast of every weight to the compute dtype
    for layer in dec.layers:
        a, m = layer.self_attn, layer.mlp
        qkv = [dec.proj(a.q_proj), dec.proj(a.k_proj), dec.proj(a.v_proj)]
        if fuse:
            q_w, q_b = qkv[0]
            if fold:
                q_w, q_b = q_w * dec.scale, None if q_b is None else q_b * dec.scale
            qkv = [
                (
                    torch.cat([q_w] + [w for w, _ in qkv[1:]]),
                    None if q_b is None else torch.cat([q_b] + [b for _, b in qkv[1:]]),
                )
            ]
        # gate|up stacked where there are no oneDNN epilogues to lose; the two alone then copy nothing
        (gate, _), (up, _), stack = dec.proj(m.gate_proj), dec.proj(m.up_proj), copy and not onednn
        layers.append(
            LayerWeights(
                input_norm=w(layer.input_layernorm.weight),
                qkv=[DecodeLinear(wt, b, onednn, copy) for wt, b in qkv],
                q_norm=w(a.q_norm.weight) if dec.qk_norm else None,
                k_norm=w(a.k_norm.weight) if dec.qk_norm else None,
                o_proj=DecodeLinear(*dec.proj(a.o_proj), onednn, copy),
                post_norm=w(layer.post_attention_layernorm.weight),
                gate=DecodeLinear(gate, None, onednn, copy and not stack),
                up=DecodeLinear(up, None, onednn, copy and not stack),
                down=DecodeLinear(dec.proj(m.down_proj)[0], None, onednn, copy),
                q_scaled=fold,
                gate_up=DecodeLinear(torch.cat([gate, up]), None, False) if stack else None,
            )
        )
    return DecodeWeights(
        layers, w(dec.base.norm.weight), DecodeLinear(dec.lm_head_weight, None, onednn, copy)
    )


def decode_step(
    dec,
    tokens: torch.Tensor,
    prompts: PromptCache,
    layout: GroupLayout,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    weights: DecodeWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position: torch.Tensor | None = None,
    cache_bias: torch.Tensor | None = None,
    record=None,
) -> torch.Tensor:
    """One token for each of n active rows; returns logits [n, V].

    caches: per layer (K, V) views [n, Hkv, t+1, D] of the completion cache up to this step; this
    step's K/V are written into their last column. Prompt attention is grouped: a group's queries
    meet its prompt KV in one matmul. cos, sin: [n, D] RoPE at each row's position.
    Static shapes (the compiled step): `position` [1] long and `cache_bias` [1, 1, 1, T] given, the
    caches are the whole [n, Hkv, T, D] buffers, this step's K/V go to column `position`, and the
    bias (−inf past it) masks the columns not written yet; every step then has the same shapes, and
    one compiled graph serves them all.
    record: a model/replay.py `Recording` set to this step's rows (or, in the compiled full-batch step,
    rollout/native.py's `_GraphRecord`), which keeps each layer's products; the step's numbers are the
    same with or without it.
    """
    n, h_q, h_kv, d = tokens.shape[0], dec.num_heads, dec.num_kv_heads, dec.head_dim
    cos2, sin2, cos, sin = cos, sin, cos[:, None], sin[:, None]
    h = dec.embed(tokens)  # [n, d_model]
    # grpo's CPU ops (grpo/kernels): ~25 of PyTorch's small ops a layer fewer, where they are built; the
    # static-shape step (compiled) keeps PyTorch's ops, which inductor fuses itself
    ops = _cpu_ops(h) if position is None else None
    norm = ops.rms_norm if ops is not None else rms_norm
    for i, w in enumerate(weights.layers):
        x = norm(h, w.input_norm, dec.eps)
        qkv = torch.cat([p(x) for p in w.qkv], dim=-1) if len(w.qkv) > 1 else w.qkv[0](x)
        if record is not None:
            record.put(i, "qkv", qkv, scaled_q=w.q_scaled)
        qkv = qkv.view(n, h_q + 2 * h_kv, d)  # [n, H+2Hkv, D]
        if w.q_norm is not None:
            q, k, v = qkv.split([h_q, h_kv, h_kv], dim=1)
            qk = torch.cat([rms_norm(q, w.q_norm, dec.eps), rms_norm(k, w.k_norm, dec.eps)], dim=1)
        else:
            qk, v = qkv[:, : h_q + h_kv], qkv[:, h_q + h_kv :]
        cache_k, cache_v = caches[i]
        if ops is not None:  # RoPE, the cache write and the attention as one op
            attn, lse = ops.decode_attention(
                qk, v, cos2, sin2, cache_k, cache_v, prompts.keys[i], prompts.values[i], prompts.bias,
                layout.row_group, 1.0 if w.q_scaled else dec.scale, record is not None,
            )  # fmt: skip
        else:
            q, k = rotate(qk, cos, sin).split([h_q, h_kv], dim=1)  # one RoPE for q and k together
            if position is None:
                cache_k[:, :, -1] = k
                cache_v[:, :, -1] = v
            else:
                cache_k.index_copy_(2, position, k[:, :, None])
                cache_v.index_copy_(2, position, v[:, :, None])
            attn, lse = _decode_attention(
                dec,
                q,
                cache_k,
                cache_v,
                prompts.keys[i],
                prompts.values[i],
                prompts.bias,
                layout,
                scaled=w.q_scaled,
                cache_bias=cache_bias,
                with_lse=record is not None,
            )
        if record is not None:  # the update's attention backward takes these instead of a forward
            record.put(i, "attn", attn)
            record.put(i, "lse", lse)
        if record is None:
            h = w.o_proj.plus(attn, h)
            x = norm(h, w.post_norm, dec.eps)
            if w.gate_up is None:
                h = w.down.plus(w.up.times(x, w.gate.silu(x)), h)
            else:
                gate, up = w.gate_up(x).chunk(2, dim=-1)
                h = w.down.plus(F.silu(gate).mul_(up), h)
            continue
        # Recording: each product goes straight into the recording (on MKL the GEMM writes it there); the
        # MLP unfused (oneDNN would fuse SiLU and the product), since gate and up are both kept.
        # `kept` tells a recording without blocks (the compiled step's) the value.
        h = w.o_proj.plus(attn, h)
        x = norm(h, w.post_norm, dec.eps)
        block = record.block(i, "gu")
        if w.gate_up is not None:
            gu = w.gate_up(x, out=block)
        elif block is None:
            gu = torch.cat([w.gate(x), w.up(x)], dim=-1)
        else:  # each half written in place (oneDNN, or decoding on the live weights)
            f = block.shape[1] // 2
            w.gate(x, out=block[:, :f])
            w.up(x, out=block[:, f:])
            gu = block
        gate, up = record.kept(i, "gu", gu).chunk(2, dim=-1)
        h = record.kept(i, "out", w.down.plus(F.silu(gate) * up, h, out=record.block(i, "out")))
    return weights.lm_head(norm(h, weights.final_norm, dec.eps))


def _cpu_ops(x: torch.Tensor):
    """`torch.ops.grpo_cpu` for a float32 CPU decode where grpo's ops are built (grpo/kernels), else None."""
    return kernels.cpu_ops_for(x)


def _decode_attention(
    dec, q, kc, vc, kp, vp, bias, layout: GroupLayout, scaled: bool, cache_bias=None, with_lse=False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention output [n, H·D] and, with_lse, each query's log-sum-exp of its scaled scores [n, H]
    (what the fused attention kernels keep for backward)."""
    # q [n, H, D]; kc, vc [n, Hkv, t, D]; kp, vp [P, Hkv, Lp, D] (prompt KV, shared by a group).
    n, hkv, d = q.shape[0], dec.num_kv_heads, dec.head_dim
    rep, lp = dec.num_heads // hkv, kp.shape[2]
    qr = q.view(n, hkv, rep, d)
    scores_c = qr @ kc.transpose(-1, -2)  # [n, Hkv, rep, t]
    if cache_bias is not None:  # static shapes: mask the cache columns not written yet
        scores_c = scores_c + cache_bias
    qg = layout.to_groups(qr)  # [P, Hkv, Gm·rep, D]
    scores_p = (qg @ kp.transpose(-1, -2)) + bias  # [P, Hkv, Gm·rep, Lp]
    scores = torch.cat([layout.to_rows(scores_p, rep), scores_c], dim=-1)  # [n, Hkv, rep, Lp+t]
    if not scaled:  # else q arrived scaled (folded into its weights)
        scores = scores * dec.scale
    probs = scores.float().softmax(-1).to(q.dtype)  # float32 softmax also under bf16, as SDPA does
    out = probs[..., lp:] @ vc  # [n, Hkv, rep, D]
    out_p = layout.to_groups(probs[..., :lp]) @ vp  # [P, Hkv, Gm·rep, D]
    lse = scores.float().logsumexp(-1).view(n, -1) if with_lse else None  # [n, H]
    return (out + layout.to_rows(out_p, rep)).reshape(n, -1), lse  # [n, H·D]
