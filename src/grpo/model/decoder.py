"""A compact Llama-family decoder that runs on a `transformers` model's own parameters.

Llama 2/3.x (incl. 3.1 rope scaling), Mistral (no active sliding window), Qwen2/2.5 (qkv bias) and
Qwen3 (q/k RMSNorm) share one block: RMSNorm → GQA attention with RoPE → RMSNorm → SwiGLU MLP.
`NativeDecoder(hf_model)` reads the weights from the Hugging Face module tree at every call, so the
learner's optimizer updates are visible at once: no copy, no sync step. It adds the two attention
layouts GRPO wants and `transformers` does not have:

- `prefill` + `decode_step`: each group's prompt is prefilled once; its G completions decode against
  that one prompt KV (grouped attention), each with its own completion KV.
- `shared_prompt_hidden` (training): the prompt of a group runs once, its completions attend to it,
  and only real tokens go through the linear layers (pad tokens cost nothing there).

Anything else (another architecture, dynamic RoPE, an active sliding window) is reported by
`unsupported_reason` and the callers fall back to the transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.model.compiled import compiled_block
from grpo.model.linear import DecodeLinear, decode_onednn, linear, swiglu_down
from grpo.model.lora import adapted_linear, is_lora, lora_base, unfoldable_reason

ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inv_freq depends on the config only


def unsupported_reason(model) -> str | None:
    """Why the native decoder cannot run this model exactly, or None when it can. A peft LoRA model is
    run through its base model, whose projections carry the adapters (`adapted_linear`)."""
    if is_lora(model):
        if (reason := unfoldable_reason(model)) is not None:
            return reason
        model = lora_base(model)
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"architecture {kind!r} (native: {', '.join(sorted(ARCHITECTURES))})"
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "no model.layers module tree"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope_type {rope!r}"
    layer_types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    if any(t != "full_attention" for t in layer_types) or (kind == "mistral" and window is not None):
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "MLP bias"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in float32, cast back, then scale (bit-compatible in bf16 too).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention; x [..., S, D], cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class PromptCache:
    """Per-layer KV of P prefilled prompts (right-padded) and the bias masking their padding."""

    keys: list[torch.Tensor]  # L × [P, Hkv, Lp, D]
    values: list[torch.Tensor]  # L × [P, Hkv, Lp, D]
    bias: torch.Tensor  # [P, 1, 1, Lp] 0 on real prompt tokens, −inf on padding
    lengths: torch.Tensor  # [P] long


class NativeDecoder:
    """Forward passes of a Llama-family `transformers` causal LM, on its live parameters."""

    def __init__(self, hf_model, compute_dtype: torch.dtype | None = None):
        reason = unsupported_reason(hf_model)
        if reason is not None:
            raise ValueError(f"The native decoder does not support this model: {reason}.")
        hf_model = lora_base(hf_model)  # LoRA: the base model's projections carry the adapters
        cfg = hf_model.config
        self.hf = hf_model
        self.base = hf_model.model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.model_type == "qwen3"
        self.scale = self.head_dim**-0.5
        self.gradient_checkpointing = False
        # Training blocks' dense parts through torch.compile (model/compiled.py); set by PolicyForward.
        self.compile_blocks = False
        # Mixed precision: float32 master weights are cast to compute_dtype as they are read (the cast
        # is differentiable, so gradients reach the masters in float32); autocast would not reach
        # model/linear.py's oneDNN calls. None: compute in the weights' own dtype.
        self.compute_dtype = compute_dtype
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- weights, read live -----------------------------------------------------------------------
    @property
    def layers(self):
        return self.base.layers

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations, KV caches and the weights as used."""
        return self.compute_dtype or self.base.embed_tokens.weight.dtype

    def w(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A parameter as computed with: cast to the compute dtype (a no-op when it already is)."""
        return t if t is None or t.dtype == self.dtype else t.to(self.dtype)

    def proj(self, module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A projection's (weight, bias) as computed with: LoRA adapters folded in, in the compute dtype."""
        weight, bias = adapted_linear(module)
        return self.w(weight), self.w(bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w(self.base.embed_tokens.weight))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w(self.base.norm.weight), self.eps)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.w(self.hf.get_output_embeddings().weight)  # [V, d] (the embedding itself when tied)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(self.final_norm(h), self.lm_head_weight)

    def rope(self, positions: torch.Tensor, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, D] from a table built by the model's own rotary module. With
        `limit` (> every position) the lookup does not read positions back to the host."""
        need = limit if limit is not None else (int(positions.max().item()) + 1 if positions.numel() else 1)
        key = (positions.device, self.dtype)
        table = self._rope.get(key)
        if table is None or table[0].shape[0] < need:
            size = max(need, 2 * (table[0].shape[0] if table else 0), 512)
            dummy = torch.zeros(1, device=positions.device, dtype=self.dtype)
            cos, sin = self.base.rotary_emb(dummy, torch.arange(size, device=positions.device)[None])
            table = self._rope[key] = (cos[0], sin[0])  # [size, D]
        return table[0][positions], table[1][positions]

    # -- pieces of a block ------------------------------------------------------------------------
    def qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [S, d] (packed tokens) → q [S, H, D], k, v [S, Hkv, D]; RoPE applied (cos/sin [S, D])."""
        a = layer.self_attn
        s, w = x.shape[0], self.w
        q = linear(x, *self.proj(a.q_proj)).view(s, self.num_heads, self.head_dim)
        k = linear(x, *self.proj(a.k_proj)).view(s, self.num_kv_heads, self.head_dim)
        v = linear(x, *self.proj(a.v_proj)).view(s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = rms_norm(q, w(a.q_norm.weight), self.eps)
            k = rms_norm(k, w(a.k_norm.weight), self.eps)
        return rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None]), v

    def mlp(self, layer, x: torch.Tensor) -> torch.Tensor:
        (gate, _), (up, _), (down, _) = (
            self.proj(p) for p in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        )
        return swiglu_down(linear(x, gate), linear(x, up), down)

    def block_tail(self, layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection + residual + MLP; h, attn [S, d]."""
        h = h + linear(attn, *self.proj(layer.self_attn.o_proj))
        return h + self.mlp(layer, rms_norm(h, self.w(layer.post_attention_layernorm.weight), self.eps))

    # -- rollout ------------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], pad_id: int) -> tuple[PromptCache, torch.Tensor]:
        """Run each prompt once (right-padded, causal). Returns its KV and last-token logits [P, V]."""
        p, width = len(prompts), max(len(x) for x in prompts)
        lengths = torch.tensor([len(x) for x in prompts], device=self.device)
        ids = torch.full((p, width), pad_id, dtype=torch.long)
        for i, x in enumerate(prompts):
            ids[i, : len(x)] = torch.tensor(x)
        ids = ids.to(self.device)
        cos, sin = self.rope(torch.arange(width, device=self.device))  # [Lp, D]
        h = self.embed(ids).view(p * width, -1)  # [P·Lp, d]
        cos, sin = cos.repeat(p, 1), sin.repeat(p, 1)
        keys, values = [], []
        for layer in self.layers:
            q, k, v = self.qkv(layer, rms_norm(h, self.w(layer.input_layernorm.weight), self.eps), cos, sin)
            q, k, v = (
                t.view(p, width, -1, self.head_dim).transpose(1, 2) for t in (q, k, v)
            )  # [P, H, Lp, D]
            # Right padding: a real query never sees a pad key under the causal mask.
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
            h = self.block_tail(layer, h, attn.transpose(1, 2).reshape(p * width, -1))
            keys.append(k.contiguous())
            values.append(v.contiguous())
        last = h.view(p, width, -1)[torch.arange(p, device=self.device), lengths - 1]  # [P, d]
        bias = torch.zeros(p, 1, 1, width, device=self.device, dtype=self.dtype)
        bias.masked_fill_(
            torch.arange(width, device=self.device)[None, None, None] >= lengths[:, None, None, None],
            float("-inf"),
        )
        return PromptCache(keys, values, bias, lengths), self.logits(last)

    def decode_weights(self, fuse: bool, onednn: bool | None = None, copy: bool = True) -> DecodeWeights:
        """Weights for decoding, prepared once per generate call. fuse=True (the CPU path) concatenates
        q|k|v into one matmul and folds the attention scale into the q rows (RoPE is linear, so scaling
        before it is the same); onednn (default: fuse, for widths `linear.decode_onednn` sends there) puts
        every projection on oneDNN with its following elementwise op fused (see model/linear.py). On a
        CPU a decode step is bound by per-call overhead and small-GEMM efficiency, not arithmetic.
        Each of these makes a copy of the weights for the call; copy=False makes none (beyond a
        mixed-precision cast or a LoRA fold), decoding with plain F.linear on the live weights."""
        onednn = (fuse and decode_onednn(self.hf.config.hidden_size)) if onednn is None else onednn
        fuse, onednn = fuse and copy, onednn and copy
        layers = []
        fold = fuse and not self.qk_norm  # q/k RMSNorm would undo a scale folded into q
        w = self.w  # mixed precision: the per-generate cast of every weight to the compute dtype
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = [self.proj(a.q_proj), self.proj(a.k_proj), self.proj(a.v_proj)]
            if fuse:
                q_w, q_b = qkv[0]
                if fold:
                    q_w, q_b = q_w * self.scale, None if q_b is None else q_b * self.scale
                qkv = [
                    (
                        torch.cat([q_w] + [w for w, _ in qkv[1:]]),
                        None if q_b is None else torch.cat([q_b] + [b for _, b in qkv[1:]]),
                    )
                ]
            layers.append(
                LayerWeights(
                    input_norm=w(layer.input_layernorm.weight),
                    qkv=[DecodeLinear(wt, b, onednn, copy) for wt, b in qkv],
                    q_norm=w(a.q_norm.weight) if self.qk_norm else None,
                    k_norm=w(a.k_norm.weight) if self.qk_norm else None,
                    o_proj=DecodeLinear(*self.proj(a.o_proj), onednn, copy),
                    post_norm=w(layer.post_attention_layernorm.weight),
                    gate=DecodeLinear(self.proj(m.gate_proj)[0], None, onednn, copy),
                    up=DecodeLinear(self.proj(m.up_proj)[0], None, onednn, copy),
                    down=DecodeLinear(self.proj(m.down_proj)[0], None, onednn, copy),
                    q_scaled=fold,
                )
            )
        return DecodeWeights(
            layers, w(self.base.norm.weight), DecodeLinear(self.lm_head_weight, None, onednn, copy)
        )

    def decode_step(
        self,
        tokens: torch.Tensor,
        prompts: PromptCache,
        layout: GroupLayout,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        weights: DecodeWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position: torch.Tensor | None = None,
        cache_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token for each of n active rows; returns logits [n, V].

        caches: per layer (K, V) views [n, Hkv, t+1, D] of the completion cache up to this step; this
        step's K/V are written into their last column. Prompt attention is grouped: a group's queries
        meet its prompt KV in one matmul. cos, sin: [n, D] RoPE at each row's position.
        Static shapes (the compiled step): `position` [1] long and `cache_bias` [1, 1, 1, T] given, the
        caches are the whole [n, Hkv, T, D] buffers, this step's K/V go to column `position`, and the
        bias (−inf past it) masks the columns not written yet; every step then has the same shapes, and
        one compiled graph serves them all.
        """
        n, h_q, h_kv, d = tokens.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = cos[:, None], sin[:, None]
        h = self.embed(tokens)  # [n, d_model]
        for i, w in enumerate(weights.layers):
            x = rms_norm(h, w.input_norm, self.eps)
            qkv = torch.cat([p(x) for p in w.qkv], dim=-1) if len(w.qkv) > 1 else w.qkv[0](x)
            qkv = qkv.view(n, h_q + 2 * h_kv, d)  # [n, H+2Hkv, D]
            if w.q_norm is not None:
                q, k, v = qkv.split([h_q, h_kv, h_kv], dim=1)
                qk = torch.cat([rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)], dim=1)
            else:
                qk, v = qkv[:, : h_q + h_kv], qkv[:, h_q + h_kv :]
            q, k = rotate(qk, cos, sin).split([h_q, h_kv], dim=1)  # one RoPE for q and k together
            cache_k, cache_v = caches[i]
            if position is None:
                cache_k[:, :, -1] = k
                cache_v[:, :, -1] = v
            else:
                cache_k.index_copy_(2, position, k[:, :, None])
                cache_v.index_copy_(2, position, v[:, :, None])
            attn = self._decode_attention(
                q,
                cache_k,
                cache_v,
                prompts.keys[i],
                prompts.values[i],
                prompts.bias,
                layout,
                scaled=w.q_scaled,
                cache_bias=cache_bias,
            )
            h = w.o_proj.plus(attn, h)
            x = rms_norm(h, w.post_norm, self.eps)
            h = w.down.plus(w.up.times(x, w.gate.silu(x)), h)
        return weights.lm_head(rms_norm(h, weights.final_norm, self.eps))

    def _decode_attention(
        self, q, kc, vc, kp, vp, bias, layout: GroupLayout, scaled: bool, cache_bias=None
    ) -> torch.Tensor:
        # q [n, H, D]; kc, vc [n, Hkv, t, D]; kp, vp [P, Hkv, Lp, D] (prompt KV, shared by a group).
        n, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        rep, lp = self.num_heads // hkv, kp.shape[2]
        qr = q.view(n, hkv, rep, d)
        scores_c = qr @ kc.transpose(-1, -2)  # [n, Hkv, rep, t]
        if cache_bias is not None:  # static shapes: mask the cache columns not written yet
            scores_c = scores_c + cache_bias
        qg = layout.to_groups(qr)  # [P, Hkv, Gm·rep, D]
        scores_p = (qg @ kp.transpose(-1, -2)) + bias  # [P, Hkv, Gm·rep, Lp]
        scores = torch.cat([layout.to_rows(scores_p, rep), scores_c], dim=-1)  # [n, Hkv, rep, Lp+t]
        if not scaled:  # else q arrived scaled (folded into its weights)
            scores = scores * self.scale
        probs = scores.float().softmax(-1).to(q.dtype)  # float32 softmax also under bf16, as SDPA does
        out = probs[..., lp:] @ vc  # [n, Hkv, rep, D]
        out_p = layout.to_groups(probs[..., :lp]) @ vp  # [P, Hkv, Gm·rep, D]
        return (out + layout.to_rows(out_p, rep)).reshape(n, -1)  # [n, H·D]

    # -- training -----------------------------------------------------------------------------------
    def shared_prompt_hidden(self, packed: SharedPromptPack) -> torch.Tensor:
        """Final-normed hidden states that predict each real completion token: [M, d], in `target_slot`
        order."""
        h = self.embed(packed.token_ids)  # [S, d] S = real prompt tokens + real completion inputs
        cos, sin = self.rope(packed.positions)  # [S, D]
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(
                    self._shared_block, layer, h, cos, sin, packed, use_reentrant=False
                )
            else:
                h = self._shared_block(layer, h, cos, sin, packed)
        return self.final_norm(h.index_select(0, packed.predictor_index))  # [M, d]

    def _shared_block(self, layer, h, cos, sin, packed: SharedPromptPack) -> torch.Tensor:
        if self.compile_blocks:
            q, k, v = self._compiled_pre_attention(layer, h, cos, sin)
        else:
            q, k, v = self.qkv(
                layer, rms_norm(h, self.w(layer.input_layernorm.weight), self.eps), cos, sin
            )  # [S, H|Hkv, D]
        p, lp, n, tc = packed.num_groups, packed.prompt_width, packed.num_rows, packed.input_width

        def pad_p(x):  # [S, ·] → [P, heads, Lp, D]
            return _scatter_rows(x, packed.prompt_slot, p * lp).view(p, lp, -1, self.head_dim).transpose(1, 2)

        def pad_c(x):  # [S, ·] → [N, heads, Tc, D]
            return (
                _scatter_rows(x, packed.completion_slot, n * tc)
                .view(n, tc, -1, self.head_dim)
                .transpose(1, 2)
            )

        qp, kp, vp = (
            pad_p(q[: packed.num_prompt_tokens]),
            pad_p(k[: packed.num_prompt_tokens]),
            pad_p(v[: packed.num_prompt_tokens]),
        )
        attn_p = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True, scale=self.scale)
        qc, kc, vc = (pad_c(x[packed.num_prompt_tokens :]) for x in (q, k, v))  # [N, H|Hkv, Tc, D]
        # A completion's keys: its group's prompt (shared; gradients sum back through the index) then itself.
        keys = torch.cat([kp.index_select(0, packed.row_group), kc], dim=2)  # [N, Hkv, Lp+Tc, D]
        vals = torch.cat([vp.index_select(0, packed.row_group), vc], dim=2)
        attn_c = self._completion_attention(
            qc, keys, vals, packed.completion_mask, lp, packed.input_lengths
        )  # [N, H, Tc, D]
        attn = torch.cat(
            [
                attn_p.transpose(1, 2).reshape(p * lp, -1).index_select(0, packed.prompt_slot),
                attn_c.transpose(1, 2).reshape(n * tc, -1).index_select(0, packed.completion_slot),
            ]
        )
        if self.compile_blocks:
            return self._compiled_post_attention(layer, h, attn)
        return self.block_tail(layer, h, attn)

    def _compiled_pre_attention(self, layer, h, cos, sin):
        a, w = layer.self_attn, self.w
        norms = (w(a.q_norm.weight), w(a.k_norm.weight)) if self.qk_norm else (None, None)
        return compiled_block().pre(
            h,
            w(layer.input_layernorm.weight),
            *self.proj(a.q_proj),
            *self.proj(a.k_proj),
            *self.proj(a.v_proj),
            *norms,
            cos,
            sin,
            self.eps,
            self.num_heads,
            self.num_kv_heads,
        )

    def _compiled_post_attention(self, layer, h, attn):
        m = layer.mlp
        return compiled_block().post(
            h,
            attn,
            *self.proj(layer.self_attn.o_proj),
            self.w(layer.post_attention_layernorm.weight),
            *(self.proj(p)[0] for p in (m.gate_proj, m.up_proj, m.down_proj)),
            self.eps,
        )

    def _completion_attention(self, q, keys, vals, mask, lp: int, lengths: list[int]) -> torch.Tensor:
        """Completion queries q [N, H, Tc, D] over their [prompt | completion] keys [N, Hkv, Lp+Tc, D];
        lengths: real queries per row, non-increasing (rows longest first).

        An attention kernel given an explicit mask computes every score, the masked-out ones too. Queries
        run in chunks that see only the keys up to their chunk's last position, which skips most of the
        causal upper triangle (37% fewer scores at 256 completion tokens; the CPU forward takes 27% less
        time, the backward the same). Each chunk also runs only the rows with a real query in it, a prefix
        since rows are longest first: with eos-ended completions of uneven length the padding after a
        short row costs nothing (16 rows of geometric length, mean 32, in a 128 grid: ~2× fewer scores).
        Padding rows of a chunk get zeros, which nothing reads.
        """
        tc = q.shape[2]
        outs = []
        for start in range(0, tc, QUERY_CHUNK):
            end = min(start + QUERY_CHUNK, tc)
            live = sum(length > start for length in lengths)
            out = F.scaled_dot_product_attention(
                q[:live, :, start:end],
                keys[:live, :, : lp + end],
                vals[:live, :, : lp + end],
                attn_mask=mask[:live, :, start:end, : lp + end],
                enable_gqa=True,
                scale=self.scale,
            )
            if live < q.shape[0]:
                out = torch.cat([out, out.new_zeros(q.shape[0] - live, *out.shape[1:])])
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


QUERY_CHUNK = 64  # completion queries per attention call in training (see _completion_attention)


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


@dataclass
class DecodeWeights:
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: DecodeLinear


def _scatter_rows(x: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    """Packed [S, ...] → padded [size, ...] with x[i] at row slots[i], zeros elsewhere (differentiable)."""
    return x.new_zeros(size, *x.shape[1:]).index_copy(0, slots, x)


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


@dataclass
class SharedPromptPack:
    """A micro-batch laid out for shared-prompt training: every real token once, no padding.

    Token order: the P distinct prompts' tokens, then each completion's input tokens (all but its last).
    Slot tensors place packed tokens into the padded [P, Lp] / [N, Tc] grids attention runs on. The
    [N, Tc] grid holds the completions longest first, so the rows still real at a query position are a
    prefix of it (attention skips the rest, see NativeDecoder._completion_attention).
    """

    token_ids: torch.Tensor  # [S] long
    positions: torch.Tensor  # [S] long: position within prompt + completion
    num_prompt_tokens: int
    num_groups: int  # P
    prompt_width: int  # Lp
    num_rows: int  # N
    input_width: int  # Tc = T − 1 (≥ 1)
    completion_width: int  # T
    prompt_slot: torch.Tensor  # [Sp] row in the [P·Lp] grid
    completion_slot: torch.Tensor  # [Sc] row in the [N·Tc] grid
    row_group: torch.Tensor  # [N] which prompt each grid row's completion answers
    completion_mask: torch.Tensor  # [N, 1, Tc, Lp+Tc] bool: keys each grid row's queries may see
    input_lengths: list[int]  # [N] real input tokens of each grid row, non-increasing
    predictor_index: torch.Tensor  # [M] packed token whose output predicts each real completion token
    target_slot: torch.Tensor  # [M] where that prediction goes in the [N·T] grid
    targets: torch.Tensor  # [M] the completion token predicted there


def pack_shared_prompts(
    prompt_ids: list[list[int]],
    row_group: list[int],
    completions: list[list[int]],
    completion_width: int,
    device: torch.device,
) -> SharedPromptPack:
    """Build a SharedPromptPack; completions[i] answers prompt_ids[row_group[i]] (all non-empty)."""
    p, n = len(prompt_ids), len(completions)
    lp = max(len(x) for x in prompt_ids)
    tc = max(max((len(c) - 1 for c in completions), default=1), 1)
    ids, pos, pslot, cslot = [], [], [], []
    for g, x in enumerate(prompt_ids):
        ids += x
        pos += range(len(x))
        pslot += range(g * lp, g * lp + len(x))
    prompt_tokens = len(ids)
    # The token predicting completion j of row i: the prompt's last token (j = 0), else completion input j-1.
    predictor, target, target_ids = [], [], []
    plen = [len(x) for x in prompt_ids]
    pstart = [sum(plen[:g]) for g in range(p)]
    lengths = [max(len(c) - 1, 0) for c in completions]
    order = sorted(range(n), key=lambda i: -lengths[i])  # grid rows: longest completion first
    grid_row = [0] * n
    for r, i in enumerate(order):
        grid_row[i] = r
    for i, c in enumerate(completions):
        g = row_group[i]
        if not c:
            continue
        inputs = c[:-1]
        first = len(ids)
        ids += inputs
        pos += range(plen[g], plen[g] + len(inputs))
        cslot += range(grid_row[i] * tc, grid_row[i] * tc + len(inputs))
        predictor += [pstart[g] + plen[g] - 1, *range(first, first + len(inputs))]
        target += range(i * completion_width, i * completion_width + len(c))
        target_ids += c
    groups = torch.tensor([row_group[i] for i in order], dtype=torch.long)  # [N] grid order
    plens = torch.tensor(plen)[groups]  # [N]
    clens = torch.tensor([lengths[i] for i in order])  # [N]
    prompt_ok = torch.arange(lp)[None, :] < plens[:, None]  # [N, Lp]
    own = torch.arange(tc)  # [Tc]
    causal = (own[None, :] <= own[:, None])[None] & (own[None, None, :] < clens[:, None, None])  # [N, Tc, Tc]
    mask = torch.cat([prompt_ok[:, None, :].expand(n, tc, lp), causal], dim=-1)  # [N, Tc, Lp+Tc]

    def t(v):
        return torch.tensor(v, dtype=torch.long, device=device)

    return SharedPromptPack(
        token_ids=t(ids),
        positions=t(pos),
        num_prompt_tokens=prompt_tokens,
        num_groups=p,
        prompt_width=lp,
        num_rows=n,
        input_width=tc,
        completion_width=completion_width,
        prompt_slot=t(pslot),
        completion_slot=t(cslot),
        row_group=groups.to(device),
        completion_mask=mask[:, None].to(device),
        input_lengths=clens.tolist(),
        predictor_index=t(predictor),
        target_slot=t(target),
        targets=t(target_ids),
    )
