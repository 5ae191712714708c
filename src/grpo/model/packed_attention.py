"""Shared-prompt attention over the packed tokens, forward and backward, without padded grids (CPU).

The training pass packs a micro-batch's tokens as [the P prompts | each group's completions, row by row]
(model/shared_prompt.py). A prompt token attends causally to its prompt; a completion token attends to
all of its group's prompt and causally to its own row. Those key sets split into three kinds of piece,
each one a plain fused-attention call on views of the packed tensors (no copy, no mask):

- prompt: each prompt's queries over its own keys, causal;
- cross: all completion queries of a group over its prompt's keys, no mask (one prompt KV for the G
  rows: no G× copy);
- own: each row's queries over its own keys, causal (the kernel skips the upper triangle: no query
  chunks, no padding after short rows).

A completion query's two pieces are merged through their log-sum-exps: with L = logaddexp(L₁, L₂),
O = O₁·e^(L₁−L) + O₂·e^(L₂−L), which is the softmax over the union of both key sets. Backward runs
each piece's fused backward with the merged O and L: the kernel rebuilds the piece's probabilities as
exp(s − L) and the softmax correction from dO·O, both of which are then the whole softmax's, so the
pieces' gradients sum to the exact gradient (the split-KV identity of ring attention).

Consecutive segments of equal shape go into one call as a batch ([count, heads, length, D] views of
the packed tensors): a micro-batch whose rows all run to the limit is three calls per layer.

The pieces are PyTorch's CPU flash-attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu`
and its backward), which takes grouped-query heads natively, strided inputs, and returns the
log-sum-exp. It exists on every CPU build and every floating dtype; other devices use the grid route
(shared_prompt.attention_route).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass(frozen=True)
class Run:
    """`count` consecutive segments of `length` packed tokens each, from packed token `start`."""

    start: int
    count: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.count * self.length

    def of(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, heads, ...] → a view [count, heads, length, ...] of this run's tokens."""
        return x[self.start : self.end].unflatten(0, (self.count, self.length)).transpose(1, 2)


def runs(starts: list[int], lengths: list[int]) -> list[Run]:
    """Adjacent segments (each starting where the previous ends) of one length, as runs."""
    out: list[Run] = []
    for start, length in zip(starts, lengths, strict=True):
        last = out[-1] if out else None
        if last is not None and last.length == length and last.end == start:
            out[-1] = Run(last.start, last.count + 1, length)
        elif length > 0:
            out.append(Run(start, 1, length))
    return out


@dataclass(frozen=True)
class PackedLayout:
    """Where the pieces are in the packed token order (built by pack_shared_prompts)."""

    prompt: list[Run]  # the prompts
    cross: list[tuple[Run, Run]]  # (a group's completion tokens as one segment, its prompt)
    own: list[Run]  # the completion rows
    num_prompt_tokens: int


def _lse(like: torch.Tensor) -> torch.Tensor:
    """[S, heads] buffer for log-sum-exps in the kernel's accumulation dtype."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return like.new_empty(like.shape[:2], dtype=dtype)


class PackedSharedPromptAttention(torch.autograd.Function):
    """q [S, H, D], k, v [S, Hkv, D] (packed, RoPE applied) → attention output [S, H, D]."""

    @staticmethod
    def forward(ctx, q, k, v, layout: PackedLayout, scale: float):
        out, lse = torch.empty_like(q), _lse(q)  # [S, H, D], [S, H]
        for r in layout.prompt:
            o, m = _forward(r.of(q), r.of(k), r.of(v), 0.0, True, scale=scale)
            r.of(out).copy_(o)
            r.of(lse).copy_(m)
        sp = layout.num_prompt_tokens
        if sp < q.shape[0]:
            own_out, own_lse = torch.empty_like(q[sp:]), _lse(q[sp:])  # [Sc, H, D], [Sc, H]
            for r in layout.own:
                o, m = _forward(r.of(q), r.of(k), r.of(v), 0.0, True, scale=scale)
                Run(r.start - sp, r.count, r.length).of(own_out).copy_(o)
                Run(r.start - sp, r.count, r.length).of(own_lse).copy_(m)
            for queries, keys in layout.cross:
                o, m = _forward(queries.of(q), keys.of(k), keys.of(v), 0.0, False, scale=scale)
                queries.of(out).copy_(o)
                queries.of(lse).copy_(m)
            cross_out, cross_lse = out[sp:], lse[sp:]
            total = torch.logaddexp(cross_lse, own_lse)  # [Sc, H]
            w = (cross_lse - total).exp_().unsqueeze(-1)  # [Sc, H, 1] the cross piece's share
            if q.dtype == w.dtype:  # O = O₁·w + O₂·(1 − w), in place over the cross output
                cross_out.sub_(own_out).mul_(w).add_(own_out)
            else:  # 16-bit: merged in float32, rounded once
                cross_out.copy_(torch.lerp(own_out.float(), cross_out.float(), w))
            cross_lse.copy_(total)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        pieces = [(r, r, True) for r in layout.prompt + layout.own] + [(a, b, False) for a, b in layout.cross]
        for queries, keys, causal in pieces:
            gq, gk, gv = _backward(
                queries.of(grad_out),
                queries.of(q),
                keys.of(k),
                keys.of(v),
                queries.of(out),
                queries.of(lse),
                0.0,
                causal,
                scale=scale,
            )
            queries.of(dq).add_(gq)
            keys.of(dk).add_(gk)
            keys.of(dv).add_(gv)
        return dq, dk, dv, None, None


class _ReplayedAttention(PackedSharedPromptAttention):
    """PackedSharedPromptAttention whose forward returns an output computed before (replay: the rollout's
    decode computed it, with each query's log-sum-exp); backward as the kernel's, from those two."""

    @staticmethod
    def forward(ctx, q, k, v, layout: PackedLayout, scale: float, out, lse):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return *PackedSharedPromptAttention.backward(ctx, grad_out), None, None


def replayed_attention(q, k, v, layout: PackedLayout, scale: float, out, lse) -> torch.Tensor:
    """q [S, H, D], k, v [S, Hkv, D]; out [S, H·D] and lse [S, H] recorded: out, with the attention's
    backward (q, k, v's gradients as `packed_attention`'s)."""
    s, h, d = q.shape
    return _ReplayedAttention.apply(q, k, v, layout, scale, out.view(s, h, d), lse).flatten(1)


def packed_attention(q, k, v, layout: PackedLayout, scale: float) -> torch.Tensor:
    """q [S, H, D], k, v [S, Hkv, D] → [S, H·D]: see the module docstring."""
    return PackedSharedPromptAttention.apply(q, k, v, layout, scale).flatten(1)
