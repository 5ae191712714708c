"""`linear(x, W, b)` = x Wᵀ + b, on oneDNN for float32 on AVX-512 CPUs, else `F.linear`.

Why: PyTorch sends a CPU float32 `F.linear` to MKL. Which of the two GEMM libraries bundled with every
PyTorch CPU build is faster depends on the CPU, so the choice is made by instruction set, once:

- AVX-512 (a 2-core AMD EPYC, earlier rounds): oneDNN ran the native decoder's GEMMs at 190-215
  GFLOP/s for 4,096 training tokens against MKL's 135-185, and ~125-135 against ~105 for a 64-row
  decode step.
- AVX2 without AVX-512 (the 2-core AMD EPYC of 2026-11-23, docs/performance.md "GEMM library"): MKL
  was faster at every shape measured, 150-179 GFLOP/s against oneDNN's 136-162 for 2,176 training
  tokens, and 10-50% faster for decode's 1-64 rows; a whole rollout of 64 × 128 tokens took 1.58 s on
  MKL against 1.75 s on oneDNN, a 16-row training forward 178 ms against 197.

`benchmarks/matmul_peak.py` measures both libraries. The result is the same product up to float32
rounding (summation order), as between any two GEMM libraries; the choice depends only on the machine,
so a run and its resume on the same machine compute the same numbers.

Training on oneDNN: forward and the input gradient go to oneDNN; the weight gradient (Gᵀ X, a long
reduction over tokens) stays on MKL, which is the faster of the two there.

Decoding: `DecodeLinear` holds a weight converted once per `generate` call to oneDNN's own tensor
type and can fuse the op that follows the product (SiLU, a product with another tensor, a residual
add), saving the separate elementwise pass over the activations.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

# x86-64 only: that is where it was measured. On ARM (e.g. Apple silicon) PyTorch's BLAS is
# Accelerate or OpenBLAS, and oneDNN's AArch64 kernels have not been compared with them here.
ONEDNN_AVAILABLE = (
    platform.machine().lower() in ("x86_64", "amd64")
    and torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
# Used where it was measured faster: AVX-512 CPUs (see the module docstring).
ONEDNN = ONEDNN_AVAILABLE and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
# Decoding a model this wide or wider streams its weights from memory at every step, and oneDNN's
# kernels with their fused epilogues were faster there on AVX2 too: Qwen2.5-0.5B (896 wide), 16 rows,
# rollout 27.0 s per step on oneDNN against 38.6 s on MKL (the down projection at 16 rows: 50 against
# 30 GFLOP/s). A narrow model's decode is bound by per-call overhead, lower on MKL (the 4.9M benchmark
# model, 256 wide: 1.58 s against 1.75 s per generate call).
DECODE_ONEDNN_MIN_WIDTH = 512
# A narrow model on oneDNN (AVX-512) leaves it for MKL below this many rows: with eos-ended rows the
# batch shrinks, and oneDNN's per-call cost at a few rows exceeds MKL's (docs/performance.md).
DECODE_ONEDNN_MIN_ROWS = 32


def decode_onednn(width: int, rows: int | None = None) -> bool:
    """Whether decoding `rows` rows (None: any count) of a model of this hidden width runs its
    projections on oneDNN (on a CPU)."""
    if not ONEDNN_AVAILABLE:
        return False
    if width >= DECODE_ONEDNN_MIN_WIDTH:
        return True
    return ONEDNN and (rows is None or rows >= DECODE_ONEDNN_MIN_ROWS)


def _onednn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str = "none"
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, post, [], "")


def uses_onednn(x: torch.Tensor) -> bool:
    return ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = _onednn(grad, weight.t(), None) if ctx.needs_input_grad[0] else None  # G W
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None  # Gᵀ X (MKL)
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, in] → [S, out]; differentiable in x, weight and bias."""
    if not uses_onednn(x) or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    return _OneDNNLinear.apply(x, weight, bias) if needs_grad else _onednn(x, weight, bias)


class DecodeLinear:
    """An inference-only linear layer for the decode loop, optionally fused with the op after it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool, copy: bool = True):
        cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.onednn = onednn and copy and ONEDNN_AVAILABLE and cpu_fp32
        weight = weight.detach()
        self.weight = weight.to_mkldnn() if self.onednn else weight
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        # MKL on a CPU: x @ Wᵀ from a [in, out] copy made once per generate call. For decode's few rows
        # it ran 5-30% faster than F.linear on the [out, in] weight (1-64 rows, AVX2 EPYC, 2 threads),
        # and `addmm` then folds a residual add into the product. copy=False: F.linear on the live weight.
        cpu_copy = copy and not self.onednn and weight.device.type == "cpu"
        self.weight_t = weight.t().contiguous() if cpu_copy else None
        if cpu_copy:  # only the copy is read: holding `weight` too would keep a concatenation made for it
            self.weight = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x Wᵀ + b; `out` (replay's recording, model/replay.py): written there, on MKL by the GEMM itself."""
        if out is not None and self.weight_t is not None and out.is_contiguous():
            if self.bias is None:
                return torch.mm(x, self.weight_t, out=out)
            return torch.addmm(self.bias, x, self.weight_t, out=out)
        if self.onednn:
            y = _onednn(x, self.weight, self.bias)
        elif self.weight_t is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
        return y if out is None else out.copy_(y)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wᵀ + b)."""
        return _onednn(x, self.weight, self.bias, "swish") if self.onednn else F.silu(self(x))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) · other."""
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "mul")
        return self(x) * other

    def plus(self, x: torch.Tensor, other: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(x Wᵀ + b) + other (a residual add); `out`: as in __call__."""
        if out is not None:
            if self.weight_t is not None and self.bias is None:
                return torch.addmm(other, x, self.weight_t, out=out)
            return out.copy_(self.plus(x, other))
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "add")
        if self.weight_t is not None and self.bias is None:
            return torch.addmm(other, x, self.weight_t)
        return self(x) + other


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) · up), keeping only gate, up and W_down for backward.

    Autograd would keep four [tokens, ffn] tensors per layer (gate for SiLU, silu(gate) and up for the
    product, the product for the down projection); silu(gate) and the product are recomputed here from
    the other two instead. The ffn width is 4-9× the model's, so this halves the MLP's activations: 1.2 GB
    of a 0.5B Qwen's 3.7 GB for a 16 × 64-token update. Backward uses the same kernels autograd would
    (aten.silu_backward, the products, `linear`'s own GEMMs), so gradients are unchanged."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        return linear(F.silu(gate) * up, weight)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        product = silu * up  # [S, ffn]
        onednn = uses_onednn(grad) and weight.dtype == torch.float32
        grad_p = _onednn(grad, weight.t(), None) if onednn else grad @ weight  # G W
        grad_w = grad.t() @ product if ctx.needs_input_grad[2] else None  # Gᵀ P
        grad_up = grad_p * silu if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad_p * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_w


def _inference_onednn(x: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """A product no gradient flows through (the reference pass, a prefill), on oneDNN's path."""
    if not uses_onednn(x):
        return False
    params = [w for w in weights if w is not None]
    if any(w.dtype != torch.float32 for w in params):
        return False
    return not torch.is_grad_enabled() or not (x.requires_grad or any(w.requires_grad for w in params))


def linear_plus(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, other: torch.Tensor):
    """other + x Wᵀ + b; without a gradient on oneDNN the add is the product's epilogue (no second pass
    over the activations; the same sum)."""
    if _inference_onednn(x, weight, bias, other):
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, bias, "add")
    return other + linear(x, weight, bias)


def swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """residual + down(silu(x W_gᵀ) · x W_uᵀ). Without a gradient on oneDNN, SiLU is the gate product's
    epilogue, the product with it the up product's and the residual add the down product's, as in the
    decode (`DecodeLinear`): three passes over the activations fewer (oneDNN's SiLU rounds within an ulp
    of PyTorch's; the products and sums are the same)."""
    if _inference_onednn(x, w_gate, w_up, w_down, residual):
        gate = _onednn(x, w_gate, None, "swish")
        product = torch.ops.mkldnn._linear_pointwise.binary(x, gate, w_up, None, "mul")
        return torch.ops.mkldnn._linear_pointwise.binary(product, residual, w_down, None, "add")
    return residual + swiglu_down(linear(x, w_gate), linear(x, w_up), w_down)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) · up, W): gate, up [S, ffn] → [S, out]; recomputes its intermediates in backward."""
    needs_grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad or weight.requires_grad)
    if not needs_grad or gate.dim() != 2 or torch.is_autocast_enabled(gate.device.type):
        return linear(F.silu(gate) * up, weight)
    return _SwiGLUDown.apply(gate, up, weight)
