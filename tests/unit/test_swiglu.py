"""The MLP tail that recomputes its intermediates: same values and gradients, half the saved activations."""

import pytest
import torch
import torch.nn.functional as F

from grpo.model.linear import linear, swiglu_down


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """fn()'s output and the bytes autograd saves for backward (parameters, which exist anyway, excluded)."""
    total = 0

    def pack(t):
        nonlocal total
        if not isinstance(t, torch.nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_down_matches_autograd_bitwise_and_saves_half(dtype):
    torch.manual_seed(0)
    s, d, ffn = 37, 24, 96
    x = torch.randn(s, d, dtype=dtype, requires_grad=True)
    w_gate, w_up = (torch.nn.Parameter(torch.randn(ffn, d, dtype=dtype) / 5) for _ in range(2))
    w_down = torch.nn.Parameter(torch.randn(d, ffn, dtype=dtype) / 10)
    upstream = torch.randn(s, d, dtype=dtype)

    def run(fused: bool):
        for t in (x, w_gate, w_up, w_down):
            t.grad = None
        gate, up = linear(x, w_gate), linear(x, w_up)
        fn = (lambda: swiglu_down(gate, up, w_down)) if fused else (lambda: linear(F.silu(gate) * up, w_down))
        out, saved = saved_bytes(fn)
        out.backward(upstream)
        return out.detach(), [t.grad.clone() for t in (x, w_gate, w_up, w_down)], saved

    want, want_grads, want_saved = run(fused=False)
    got, got_grads, got_saved = run(fused=True)
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.equal(g, w)
    assert want_grads[0].abs().sum() > 0
    ffn_tensor = s * ffn * want.element_size()
    assert want_saved >= 4 * ffn_tensor  # gate, silu(gate), up, the product (+ W_downᵀ on F.linear)
    assert got_saved == 2 * ffn_tensor  # gate, up


def test_without_grad_it_is_the_plain_expression():
    gate, up, w = torch.randn(5, 8), torch.randn(5, 8), torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(swiglu_down(gate, up, w), linear(F.silu(gate) * up, w))
