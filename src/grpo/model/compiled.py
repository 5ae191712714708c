"""The packed training block's dense parts, compiled with torch.compile (inductor).

A native training block is: RMSNorm → q/k/v projections (+ q/k norms) → RoPE → attention → o projection
+ residual → RMSNorm → SwiGLU MLP + residual. Everything but the attention acts token by token on the
packed `[S, d]` tokens, and between its GEMMs sit chains of elementwise ops (norms, RoPE, SiLU·up,
residual adds) that eager PyTorch runs as separate passes over memory, each with its dispatch cost.
inductor fuses each chain into one loop (C++/OpenMP on a CPU, Triton on CUDA) and leaves the GEMMs to
the BLAS; its AOT-autograd partitioner also picks what to save for backward and recomputes cheap
elementwise results instead (what `linear.swiglu_down` does by hand in eager mode).

Shapes: S, the packed token count, changes with every micro-batch (ragged completions). The two pieces
are compiled with S as a dynamic dimension, so one graph per piece (forward, backward, and a no-grad
forward for the reference pass) serves every micro-batch instead of one compilation per step. The
attention (shared-prompt layout, query chunks over ragged rows) stays eager: its shapes are Python
numbers that change every micro-batch.

Compilation costs seconds to minutes on a CPU, once per process; inductor's on-disk caches (FX graph
and AOT-autograd caches, on by default under `TORCHINDUCTOR_CACHE_DIR`, default
/tmp/torchinductor_$USER) make later runs load the compiled kernels instead. `compile_report()` gives
the compile time and graphs compiled so far.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.nn.functional as F

# A CPU run compiles by default from this many optimizer steps on. The compile costs 20-35 s on a
# 2-core CPU (cold cache, quiet machine: 35 s for the matrix model) and saves ~15% of the reference and
# update passes (docs/performance.md): 0.1-0.6 s a step on the matrix cells, so it is repaid within
# 60-300 steps; short runs (tests, a quick demo) skip it.
AMORTISE_STEPS = 200


def cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would call, if one is installed."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def compile_by_default(device: torch.device, optimizer_steps: int) -> bool:
    return device.type == "cpu" and optimizer_steps >= AMORTISE_STEPS and cpp_compiler() is not None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def pre_attention(
    h, norm, wq, bq, wk, bk, wv, bv, q_norm, k_norm, cos, sin, eps: float, heads: int, kv_heads: int
):
    """h [S, d] → q [S, H, D], k, v [S, Hkv, D]: input norm, projections, q/k norms (Qwen3), RoPE."""
    x = _rms_norm(h, norm, eps)
    s = x.shape[0]
    q = F.linear(x, wq, bq).view(s, heads, -1)
    k = F.linear(x, wk, bk).view(s, kv_heads, -1)
    v = F.linear(x, wv, bv).view(s, kv_heads, -1)
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    cos, sin = cos[:, None], sin[:, None]  # [S, 1, D]
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def post_attention(h, attn, wo, bo, norm, gate, up, down, eps: float):
    """h, attn [S, d] → the block's output [S, d]: o projection + residual, norm, SwiGLU MLP + residual."""
    h = h + F.linear(attn, wo, bo)
    x = _rms_norm(h, norm, eps)
    return h + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class CompiledBlock:
    """The two pieces, compiled once per process on first use (S dynamic)."""

    def __init__(self):
        self.pre = torch.compile(pre_attention, dynamic=True)
        self.post = torch.compile(post_attention, dynamic=True)


_BLOCK: CompiledBlock | None = None


def compiled_block() -> CompiledBlock:
    global _BLOCK
    if _BLOCK is None:
        _BLOCK = CompiledBlock()
    return _BLOCK


def compile_report() -> dict[str, float]:
    """Seconds spent compiling in this process so far (dynamo's frame compiles, which include the
    forward's inductor work, plus the backward graphs compiled at their first backward) and the number
    of graphs compiled."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(
        sum(values)
        for name, values in compilation_time_metrics.items()
        if name == "_compile.compile_inner" or "bw_compiler" in name or "backward" in name
    )
    return {
        "compile_s": round(seconds, 2),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "fx_cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_cache_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_cache_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
    }
