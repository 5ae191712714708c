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

The passes live beside this file: the rollout's in model/decode.py, training's in model/shared_prompt.py,
the supported-model check and the shared elementwise ops in model/arch.py. This class holds the weights
as read live and the block pieces both passes use.

Anything else (another architecture, dynamic RoPE, an active sliding window) is reported by
`unsupported_reason` and the callers fall back to the transformers model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.model import decode, shared_prompt
from grpo.model.arch import ARCHITECTURES, STATIC_ROPE, rms_norm, rotate, unsupported_reason
from grpo.model.decode import DecodeWeights, GroupLayout, LayerWeights, PromptCache
from grpo.model.linear import linear, linear_plus, swiglu
from grpo.model.lora import adapted_linear, lora_base
from grpo.model.shared_prompt import QUERY_CHUNK, SharedPromptPack, pack_shared_prompts

__all__ = [
    "ARCHITECTURES",
    "QUERY_CHUNK",
    "STATIC_ROPE",
    "DecodeWeights",
    "GroupLayout",
    "LayerWeights",
    "NativeDecoder",
    "PromptCache",
    "SharedPromptPack",
    "pack_shared_prompts",
    "rms_norm",
    "rotate",
    "unsupported_reason",
]


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
        self.reuse_casts = False  # see `w`; off where the weights change under the decoder (rollout)
        self._casts: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

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
        """A parameter as computed with: cast to the compute dtype (a no-op when it already is).

        Mixed precision, with `reuse_casts` (the learner's training forward): a master's cast is made once
        per optimizer step, not on every micro-batch and pass (on a 0.5B model ~3 GB of traffic per
        micro-batch on a GPU). It is kept until `forget_casts()` (the learner calls it after each
        optimizer step: fused AdamW does not move the version counter) or the master's version counter
        moves (an in-place write: a weight load). Each read still goes through autograd as a cast
        (`_CachedCast`): the gradient reaches the master in float32, through the master's own hooks."""
        if t is None or t.dtype == self.dtype:
            return t
        if not (self.reuse_casts and isinstance(t, torch.nn.Parameter)):  # a LoRA-folded weight: computed
            return t.to(self.dtype)
        hit = self._casts.get(id(t))
        if hit is None or hit[0] is not t or hit[1] != t._version:
            hit = self._casts[id(t)] = (t, t._version, t.detach().to(self.dtype))
        return _CachedCast.apply(t, hit[2])

    def forget_casts(self) -> None:
        self._casts.clear()

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

    def block_tail(self, layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection + residual + MLP + residual; h, attn [S, d]."""
        h = linear_plus(attn, *self.proj(layer.self_attn.o_proj), h)
        x = rms_norm(h, self.w(layer.post_attention_layernorm.weight), self.eps)
        m = layer.mlp
        return swiglu(x, *(self.proj(p)[0] for p in (m.gate_proj, m.up_proj, m.down_proj)), h)

    # -- the passes: rollout in model/decode.py, training in model/shared_prompt.py ----------------
    def prefill(self, prompts: list[list[int]], pad_id: int, record=None) -> tuple[PromptCache, torch.Tensor]:
        return decode.prefill(self, prompts, pad_id, record)

    def decode_weights(self, fuse: bool, onednn: bool | None = None, copy: bool = True) -> DecodeWeights:
        return decode.decode_weights(self, fuse, onednn, copy)

    def decode_step(self, *args, **kwargs) -> torch.Tensor:
        return decode.decode_step(self, *args, **kwargs)

    def shared_prompt_hidden(self, packed: SharedPromptPack) -> torch.Tensor:
        return shared_prompt.shared_prompt_hidden(self, packed)


class _CachedCast(torch.autograd.Function):
    """`master.to(dtype)` whose forward returns a cast made earlier (NativeDecoder.w); backward as the
    cast's: the gradient in the master's dtype."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = master.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None
