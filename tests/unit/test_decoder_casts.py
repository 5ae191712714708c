"""Mixed precision on the native decoder: each float32 master is cast to the compute dtype once per
optimizer step, not on every micro-batch, with the same forward values and the same float32 gradients."""

import torch

from grpo.model.forward import PolicyForward
from tests.conftest import tiny_llama
from tests.unit.test_learner import random_batch


def micro_batches_then_step(reuse_casts: bool):
    """Two micro-batches' forward/backward, an in-place update, a third forward: (logps, master grads)."""
    model = tiny_llama().train()
    forward = PolicyForward(model, native=True, compute_dtype=torch.bfloat16)
    forward.decoder.reuse_casts = reuse_casts
    batch = random_batch()
    out = []
    for rows in (slice(0, 4), slice(4, 8)):
        logp, _ = forward(batch.rows(rows).trim(), 1.0)
        (logp * batch.rows(rows).trim().completion_mask).sum().backward()
        out.append(logp.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.05)  # in place, as AdamW's step: the casts must follow
    with torch.no_grad():
        out.append(forward(batch, 1.0)[0])
    return out, grads


def test_cached_casts_give_the_same_logprobs_and_float32_gradients():
    logps, grads = micro_batches_then_step(reuse_casts=True)
    ref_logps, ref_grads = micro_batches_then_step(reuse_casts=False)
    for a, b in zip(logps, ref_logps, strict=True):
        assert torch.equal(a, b)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g.dtype == torch.float32 and torch.equal(g, ref_grads[name]), name


def test_a_master_is_cast_once_until_it_changes():
    model = tiny_llama().train()
    dec = PolicyForward(model, native=True, compute_dtype=torch.bfloat16).decoder
    weight = model.model.layers[0].mlp.up_proj.weight
    first = dec.w(weight)
    assert first.dtype == torch.bfloat16
    assert dec.w(weight).data_ptr() == first.data_ptr()  # the second micro-batch: no new cast
    with torch.no_grad():
        weight.mul_(2)  # an in-place write (a weight load)
    again = dec.w(weight)
    assert again.data_ptr() != first.data_ptr() and torch.equal(again, weight.detach().to(torch.bfloat16))
    dec.forget_casts()  # after an optimizer step
    assert dec.w(weight).data_ptr() != again.data_ptr()


def test_the_casts_follow_a_fused_adamw_step():
    """Fused AdamW writes the masters without moving their version counters: the learner's
    forget_casts() after each step is what makes the next forward see the new weights."""
    model = tiny_llama().train()
    forward = PolicyForward(model, native=True, compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    batch = random_batch()
    logp, _ = forward(batch, 1.0)
    (logp * batch.completion_mask).sum().backward()
    optimizer.step()
    forward.forget_casts()
    with torch.no_grad():
        after, _ = forward(batch, 1.0)
        fresh, _ = PolicyForward(model, native=True, compute_dtype=torch.bfloat16)(batch, 1.0)
    assert torch.equal(after, fresh) and not torch.equal(after, logp.detach())
