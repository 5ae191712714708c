"""oneDNN linear layers equal F.linear (values and gradients), fused decode variants included.

oneDNN is the default on AVX-512 CPUs only; the fixture forces it on so it is checked on any x86 machine."""

import pytest
import torch
import torch.nn.functional as F

from grpo.model import linear as native_linear
from grpo.model.linear import DecodeLinear, linear

needs_onednn = pytest.mark.skipif(
    not native_linear.ONEDNN_AVAILABLE, reason="this PyTorch build has no oneDNN"
)


@pytest.fixture
def onednn_on(monkeypatch):
    """The oneDNN path, also on CPUs where MKL is the default (it must stay correct where it is chosen)."""
    monkeypatch.setattr(native_linear, "ONEDNN", True)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # Two GEMM libraries sum in different orders: equal up to float32 rounding of the sums.
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_gradients_match_f_linear(bias, onednn_on):
    torch.manual_seed(0)
    x = torch.randn(37, 24, requires_grad=True)
    w = torch.randn(40, 24, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if bias else None
    upstream = torch.randn(37, 40)
    out = linear(x, w, b)
    assert out.grad_fn is not None and "OneDNN" in type(out.grad_fn).__name__  # really the oneDNN path
    grads = torch.autograd.grad((out * upstream).sum(), [x, w] + ([b] if bias else []))
    ref = F.linear(x, w, b)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), [x, w] + ([b] if bias else []))
    _close(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        _close(g, r)


@needs_onednn
def test_linear_without_grad_and_on_a_strided_input(onednn_on):
    torch.manual_seed(1)
    x = torch.randn(16, 50)[:, 3:35]  # a column slice: not contiguous
    w = torch.randn(8, 32)
    with torch.no_grad():
        _close(linear(x, w), F.linear(x, w))


def test_linear_falls_back_to_f_linear_exactly(monkeypatch):
    monkeypatch.setattr(native_linear, "ONEDNN", False)
    torch.manual_seed(2)
    x, w, b = torch.randn(5, 7), torch.randn(3, 7), torch.randn(3)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    xd = x.double()  # other dtypes never take the oneDNN path
    assert torch.equal(linear(xd, w.double()), F.linear(xd, w.double()))


@needs_onednn
@pytest.mark.parametrize("onednn", [True, False])
def test_decode_linear_fused_ops(onednn, onednn_on):
    torch.manual_seed(3)
    x, other = torch.randn(9, 16), torch.randn(9, 12)
    w, b = torch.randn(12, 16), torch.randn(12)
    layer = DecodeLinear(w, b, onednn=onednn)
    assert layer.onednn == onednn
    y = F.linear(x, w, b)
    _close(layer(x), y)
    _close(layer.silu(x), F.silu(y))
    _close(layer.times(x, other), y * other)
    _close(layer.plus(x, other), y + other)


@needs_onednn
def test_decode_library_follows_model_width(monkeypatch):
    from grpo.model.decoder import NativeDecoder
    from tests.conftest import tiny_llama

    dec = NativeDecoder(tiny_llama())  # 32 wide
    monkeypatch.setattr(native_linear, "ONEDNN", False)  # an AVX2 CPU
    assert not dec.decode_weights(fuse=True).layers[0].down.onednn  # narrow: MKL, lower per-call cost
    monkeypatch.setattr(native_linear, "DECODE_ONEDNN_MIN_WIDTH", 32)
    weights = dec.decode_weights(fuse=True)  # as wide as the threshold: oneDNN streams the weights
    assert weights.layers[0].down.onednn and weights.lm_head.onednn


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_inference_epilogues_equal_the_separate_ops(bias, onednn_on):
    """Without a gradient (the reference pass, a prefill) the residual adds, SiLU and the gate product are
    oneDNN epilogues: the same values as the separate ops; with a gradient the separate ops run."""
    torch.manual_seed(0)
    x, h = torch.randn(37, 24), torch.randn(37, 24)
    w_o, b_o = torch.randn(24, 24), (torch.randn(24) if bias else None)
    w_g, w_u, w_d = torch.randn(40, 24), torch.randn(40, 24), torch.randn(24, 40)
    want_plus = h + F.linear(x, w_o, b_o)
    want_mlp = h + F.linear(F.silu(F.linear(x, w_g)) * F.linear(x, w_u), w_d)
    with torch.no_grad():
        _close(native_linear.linear_plus(x, w_o, b_o, h), want_plus)
        _close(native_linear.swiglu(x, w_g, w_u, w_d, h), want_mlp)
    w_d.requires_grad_(True)
    out = native_linear.swiglu(x, w_g, w_u, w_d, h)
    assert out.grad_fn is not None
    _close(out, want_mlp)
