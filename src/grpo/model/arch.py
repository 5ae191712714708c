"""Which models the native decoder runs exactly, and the two elementwise ops every pass shares."""

from __future__ import annotations

import torch

from grpo import kernels
from grpo.model.lora import is_lora, lora_base, unfoldable_reason

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
    if x.dim() == 2 and (ops := kernels.cpu_ops_for(x, weight)) is not None:  # one op each way for ~6 and ~10
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _RMSNorm.apply(x, weight, eps)
        return ops.rms_norm(x, weight, eps)
    # As transformers: normalise in float32, cast back, then scale (bit-compatible in bf16 too).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """rms_norm with grpo's forward and backward ops: they keep x and one float a row (1 / its RMS)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, inv = kernels.cpu_ops().rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, inv)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, inv = ctx.saved_tensors
        dx, dweight = kernels.cpu_ops().rms_norm_backward(grad, x, weight, inv)
        return dx, dweight, None


class _Rope(torch.autograd.Function):
    """RoPE with grpo's op both ways (backward is the rotation's transpose; cos and sin take no gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return kernels.cpu_ops().rope(x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return kernels.cpu_ops().rope(grad, cos, sin, True), None, None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention; x [..., S, D], cos/sin broadcastable to it."""
    ops = kernels.cpu_ops_for(x, cos, sin) if x.dim() == 3 and cos.dim() == 3 and cos.shape[1] == 1 else None
    if ops is not None:  # packed tokens [S, H, D], one cos/sin row a token: one op each way for ~5 and ~6
        cos, sin = cos[:, 0], sin[:, 0]
        if torch.is_grad_enabled() and x.requires_grad:
            return _Rope.apply(x, cos, sin)
        return ops.rope(x, cos, sin, False)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
