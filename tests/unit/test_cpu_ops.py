"""grpo's CPU ops (grpo/kernels) compute what the PyTorch ops they replace compute, and a machine
that cannot build them decodes with PyTorch's ops instead."""

import logging
import types

import pytest
import torch

from grpo import kernels
from grpo.model import decode
from grpo.model.arch import rms_norm, rotate
from grpo.model.decode import GroupLayout
from grpo.records import SamplingParams
from grpo.rollout.native import NativeEngine

OPS = kernels.cpu_ops()
needs_ops = pytest.mark.skipif(
    OPS is None, reason=f"grpo's CPU ops are not built here: {kernels.why_unavailable()}"
)


def _attention_case(d, rep, t, drop, holes, seed=0, groups=3, per_group=4, hkv=2, lp=9, cache_len=40):
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(groups * per_group)
    if drop:  # rows that finished: the layout compacts, groups become uneven
        rows = rows[torch.randperm(rows.numel(), generator=g)[drop:]].sort().values
    row_group = rows // per_group
    n, heads = rows.numel(), hkv * rep
    lengths = torch.randint(1, lp + 1, (groups,), generator=g)
    lengths[0] = lp
    real = torch.arange(lp)[None] < lengths[:, None]
    if holes:  # a later turn's held prompt has masked columns inside it (model/turn_kv.py)
        real[:, 1] = False
    bias = torch.zeros(groups, 1, 1, lp).masked_fill_(~real[:, None, None], float("-inf"))
    qkv = torch.randn(n, heads + 2 * hkv, d, generator=g)
    qk, v = qkv[:, : heads + hkv], qkv[:, heads + hkv :]  # views of one projection, as decode_step has them
    angle = torch.rand(n, d // 2, generator=g) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    kbuf, vbuf = (
        torch.randn(n, hkv, cache_len, d, generator=g),
        torch.randn(n, hkv, cache_len, d, generator=g),
    )
    kp, vp = torch.randn(groups, hkv, lp, d, generator=g), torch.randn(groups, hkv, lp, d, generator=g)
    layout = GroupLayout(row_group, lengths, groups)
    dec = types.SimpleNamespace(num_kv_heads=hkv, num_heads=heads, head_dim=d, scale=d**-0.5)
    return dec, qk, v, cos, sin, kbuf, vbuf, t, kp, vp, bias, layout


def _by_pytorch(dec, qk, v, cos, sin, kbuf, vbuf, t, kp, vp, bias, layout, scaled):
    kc, vc = kbuf[:, :, :t].clone(), vbuf[:, :, :t].clone()
    q, k = rotate(qk, cos[:, None], sin[:, None]).split([dec.num_heads, dec.num_kv_heads], dim=1)
    kc[:, :, -1], vc[:, :, -1] = k, v
    out, lse = decode._decode_attention(dec, q, kc, vc, kp, vp, bias, layout, scaled=scaled, with_lse=True)
    return out, lse, kc, vc


@needs_ops
@pytest.mark.parametrize("d", [64, 128, 24])  # the two compiled-in head sizes and the general loop
@pytest.mark.parametrize(
    ("rep", "t", "drop", "holes", "scaled"),
    [(2, 1, 0, False, True), (1, 17, 5, True, False), (4, 33, 3, False, True)],
)
def test_decode_attention_op_equals_the_pytorch_ops(d, rep, t, drop, holes, scaled):
    dec, qk, v, cos, sin, kbuf, vbuf, t, kp, vp, bias, layout = _attention_case(d, rep, t, drop, holes)
    want, want_lse, want_kc, want_vc = _by_pytorch(
        dec, qk, v, cos, sin, kbuf, vbuf, t, kp, vp, bias, layout, scaled
    )
    kc, vc = kbuf[:, :, :t], vbuf[:, :, :t]  # views of the whole buffers, as the decode loop passes them
    scale = 1.0 if scaled else dec.scale
    out, lse = OPS.decode_attention(qk, v, cos, sin, kc, vc, kp, vp, bias, layout.row_group, scale, True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    # this step's key (rotated) and value went to the caches' last column; the columns before are untouched
    torch.testing.assert_close(kc, want_kc, rtol=1e-6, atol=1e-6)
    assert torch.equal(vc, want_vc)
    out_again, none = OPS.decode_attention(
        qk, v, cos, sin, kc, vc, kp, vp, bias, layout.row_group, scale, False
    )
    assert torch.equal(out_again, out) and none.numel() == 0


@needs_ops
def test_a_masked_prompt_column_gets_no_weight():
    _, qk, v, cos, sin, kbuf, vbuf, t, kp, vp, bias, layout = _attention_case(64, 2, 5, 0, holes=True)
    kc, vc = kbuf[:, :, :t], vbuf[:, :, :t]
    args = (qk, v, cos, sin, kc, vc)
    out, _ = OPS.decode_attention(*args, kp, vp, bias, layout.row_group, 1.0, False)
    vp_changed = vp.clone()
    vp_changed[:, :, 1] = 1e6  # column 1 is masked in every prompt
    out_changed, _ = OPS.decode_attention(*args, kp, vp_changed, bias, layout.row_group, 1.0, False)
    assert torch.equal(out, out_changed)


@needs_ops
@pytest.mark.parametrize("shape", [(64, 256), (3, 40), (700, 96)])
def test_rms_norm_op_equals_pytorch(shape):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[1], generator=g)
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=2e-6, atol=2e-6)


@needs_ops
def test_a_rollout_with_the_ops_samples_what_pytorchs_ops_sample(tiny_model, id_tokenizer, monkeypatch):
    """Same seed, same tokens; log-probs equal to float32 rounding (the tiny model's head size takes the
    general loop; the rollout's log-probs and replay's recording come from these ops)."""
    engine = NativeEngine(tiny_model, id_tokenizer)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0)
    prompts = [[2, 7, 11, 5], [2, 9], [2, 3, 4, 5, 6, 7, 8]]
    runs = {}
    for on in ("1", "0"):
        monkeypatch.setenv("GRPO_CPU_KERNELS", on)
        torch.manual_seed(3)
        runs[on] = engine.generate(prompts, 4, params)
    assert torch.equal(runs["1"].completion_ids, runs["0"].completion_ids)
    torch.testing.assert_close(runs["1"].sampling_logprobs, runs["0"].sampling_logprobs, rtol=0, atol=2e-5)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("GRPO_CPU_KERNELS", "0")
    assert kernels.cpu_ops() is None
    assert decode._cpu_ops(torch.zeros(2, 2)) is None


@pytest.mark.parametrize(
    ("compiler", "why"),
    [
        ("false", "the C++ compiler failed: false exited with status 1"),
        ("/no/such/c++", "no C++ compiler found"),
    ],
)
def test_a_machine_that_cannot_build_them_decodes_with_pytorchs_ops(
    compiler, why, tmp_path, monkeypatch, caplog, tiny_model, id_tokenizer
):
    """No compiler, or a failing one: a warning that says so and how to skip the build, never an error."""
    monkeypatch.setenv("GRPO_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger="grpo"):
        assert kernels.cpu_ops() is None
    assert why in kernels.why_unavailable()
    assert "GRPO_CPU_KERNELS=0" in caplog.text and "PyTorch's ops instead" in caplog.text
    assert list(tmp_path.iterdir()) == []  # no half-written library left to load next time
    out = NativeEngine(tiny_model, id_tokenizer).generate([[2, 7]], 2, SamplingParams(max_new_tokens=3))
    assert out.completion_ids.shape[0] == 2
    # asked again in the same process: no second build, the same answer
    monkeypatch.setenv("CXX", "c++")
    assert kernels.cpu_ops() is None


def test_the_library_name_changes_with_the_source_and_the_torch_build(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPO_KERNELS_DIR", str(tmp_path))
    first = kernels.library_path()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert kernels.library_path() != first and kernels.library_path().parent == tmp_path


@needs_ops
@pytest.mark.parametrize("shape", [(1080, 256), (5, 40)])
def test_rms_norm_gradients_equal_pytorchs(shape, monkeypatch):
    """The training passes' RMSNorm (model/arch.rms_norm) on grpo's ops: forward and both gradients as
    autograd's through PyTorch's ops, to float32 rounding, and the same bits when run again."""
    g = torch.Generator().manual_seed(2)
    x0, w0, up = (
        torch.randn(*shape, generator=g),
        torch.randn(shape[1], generator=g),
        torch.randn(*shape, generator=g),
    )

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = rms_norm(x, w, 1e-6)
        y.backward(up)
        return y.detach(), x.grad, w.grad, y.grad_fn

    y, dx, dw, fn = run()
    assert type(fn).__name__ == "_RMSNormBackward"  # really grpo's op
    assert all(torch.equal(a, b) for a, b in zip((y, dx, dw), run()[:3], strict=True))
    monkeypatch.setenv("GRPO_CPU_KERNELS", "0")
    y_ref, dx_ref, dw_ref, fn_ref = run()
    assert type(fn_ref).__name__ != "_RMSNormBackward"
    torch.testing.assert_close(y, y_ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-4)


@needs_ops
def test_rope_and_its_gradient_equal_pytorchs(monkeypatch):
    """model/arch.rotate on packed tokens [S, H, D] (a strided view, as q and k are) with grpo's op."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(50, 4 + 2 * 2, 64, generator=g)
    angle = torch.rand(50, 32, generator=g) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    up = torch.randn(50, 4, 64, generator=g)

    def run():
        x = qkv.clone().requires_grad_()
        y = rotate(x[:, :4], cos, sin)
        y.backward(up)
        return y.detach(), x.grad, y.grad_fn

    y, dx, fn = run()
    assert type(fn).__name__ == "_RopeBackward"
    monkeypatch.setenv("GRPO_CPU_KERNELS", "0")
    y_ref, dx_ref, _ = run()
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)


@needs_ops
def test_swiglu_ops_equal_pytorchs():
    """SiLU, its product with up, and both gradients (model/replay's MLP backward), with gate and up as the
    two halves of one product as the replayed MLP has them. (model/linear's swiglu_down keeps PyTorch's
    kernels: it promises autograd's bits, tests/unit/test_swiglu.py.)"""
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(70, 2 * 33, generator=g) * 4  # large |gate| too: σ saturates at both ends
    gate, up = gu[:, :33], gu[:, 33:]
    grad = torch.randn(70, 33, generator=g)
    silu, product = torch.empty(70, 33), torch.empty(70, 33)
    OPS.swiglu_forward(gate, up, silu, product)
    torch.testing.assert_close(silu, torch.nn.functional.silu(gate), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(product, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=2e-6)
    d = torch.empty(70, 2 * 33)
    OPS.swiglu_backward(grad, gate, up, silu, d[:, :33], d[:, 33:])
    x = gate.clone().requires_grad_()
    u = up.clone().requires_grad_()
    (torch.nn.functional.silu(x) * u).backward(grad)
    torch.testing.assert_close(d[:, :33], x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d[:, 33:], u.grad, rtol=1e-5, atol=1e-5)
