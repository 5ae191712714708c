"""The GRPO objective against hand-worked numbers (arithmetic in the comments)."""

import math

import pytest
import torch

from grpo.algorithm.loss import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    LossNorm,
    apply_truncation_mask,
    grpo_loss,
    kl_penalty,
    per_token_policy_loss,
)


def _surrogate(ratio: float, advantage: float, clip_low: float = 0.2, clip_high: float = 0.2):
    """One token: old_logp = 0, logp = log ρ."""
    logp = torch.tensor([[math.log(ratio)]])
    loss, stats = per_token_policy_loss(
        logp, torch.zeros(1, 1), torch.tensor([[advantage]]), clip_low, clip_high
    )
    return loss.item(), stats.clipped_low.item(), stats.clipped_high.item()


# ---------------------------------------------------------------------------------------------
# Clipped surrogate, one token at a time.


def test_unclipped_ratio():
    # ρ = 1.1 inside [0.8, 1.2], Â = 2: -min(1.1·2, 1.1·2) = -2.2
    assert _surrogate(1.1, 2.0) == pytest.approx((-2.2, False, False))


def test_clipped_high_with_positive_advantage():
    # ρ = 1.5, Â = 1: -min(1.5·1, clip(1.5, 0.8, 1.2)·1) = -min(1.5, 1.2) = -1.2
    assert _surrogate(1.5, 1.0) == pytest.approx((-1.2, False, True))


def test_clipped_low_with_negative_advantage():
    # ρ = 0.5, Â = -1: -min(0.5·(-1), 0.8·(-1)) = -min(-0.5, -0.8) = 0.8
    assert _surrogate(0.5, -1.0) == pytest.approx((0.8, True, False))


def test_low_ratio_with_positive_advantage_is_not_clipped():
    # ρ = 0.5, Â = 1: -min(0.5, 0.8) = -0.5; the pessimistic min keeps the unclipped term
    assert _surrogate(0.5, 1.0) == pytest.approx((-0.5, False, False))


def test_asymmetric_clip_higher():
    # DAPO ε_low = 0.2, ε_high = 0.28: range [0.8, 1.28]
    # ρ = 1.25, Â = 1: inside -> -1.25 (symmetric 0.2 would give -1.2)
    assert _surrogate(1.25, 1.0, 0.2, 0.28) == pytest.approx((-1.25, False, False))
    # ρ = 1.4, Â = 1: -min(1.4, 1.28) = -1.28
    assert _surrogate(1.4, 1.0, 0.2, 0.28) == pytest.approx((-1.28, False, True))
    # ρ = 0.7, Â = -1: lower side still 0.8: -min(-0.7, -0.8) = 0.8
    assert _surrogate(0.7, -1.0, 0.2, 0.28) == pytest.approx((0.8, True, False))


def test_clipped_token_gets_no_gradient():
    # ρ = 1.5 > 1.2 with Â > 0: the loss is the constant -1.2·Â, so d/dlogp = 0;
    # ρ = 1.1 unclipped: d/dlogp (-ρÂ) = -ρÂ = -1.1·2 = -2.2
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = per_token_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 2.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -2.2]]))


# ---------------------------------------------------------------------------------------------
# KL estimators at Δ = log π_ref - log π_θ = ±ln 2.


@pytest.mark.parametrize(
    ("estimator", "at_plus", "at_minus"),
    [
        # k1 is -Δ
        ("k1", -math.log(2), math.log(2)),
        # k2 = ½Δ² = ½(ln 2)² = 0.240227 on both sides
        ("k2", 0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2),
        # k3 = e^Δ - Δ - 1: Δ = +ln 2 -> 2 - 0.693147 - 1 = 0.306853;
        # Δ = -ln 2 -> 0.5 + 0.693147 - 1 = 0.193147
        ("k3", 1 - math.log(2), math.log(2) - 0.5),
    ],
)
def test_kl_estimators(estimator, at_plus, at_minus):
    logp = torch.tensor([[-1.0, -1.0]])
    ref_logp = logp + torch.tensor([[math.log(2), -math.log(2)]])  # Δ = [+ln 2, -ln 2]
    torch.testing.assert_close(kl_penalty(logp, ref_logp, estimator), torch.tensor([[at_plus, at_minus]]))


def test_k3_is_exact_near_zero():
    # Δ = 1e-4: e^Δ - Δ - 1 = Δ²/2 + Δ³/6 ≈ 5.00017e-9; exp(Δ) - 1 in float32 would lose all digits
    delta = 1e-4
    out = kl_penalty(torch.zeros(1, 1), torch.full((1, 1), delta), "k3")
    assert out.item() == pytest.approx(delta**2 / 2 + delta**3 / 6, rel=1e-3)


# ---------------------------------------------------------------------------------------------
# Aggregations on unequal lengths.

# Row 0 has 3 tokens with loss [1, 2, 3]; row 1 has 1 token with loss 4 (its padding holds garbage
# that must not count); row 2 is fully masked (e.g. a truncated completion).
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
NORM = LossNorm(num_sequences=3, num_tokens=4, max_completion_length=4)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # (6/3 + 4/1 + 0) / 3 sequences = 6/3 = 2.0
        ("sequence_mean", 2.0),
        # (1 + 2 + 3 + 4) / 4 tokens = 2.5
        ("token_mean", 2.5),
        # 10 / (3 sequences · 4 max length) = 10/12
        ("constant", 10 / 12),
    ],
)
def test_aggregations(aggregation, expected):
    out = LOSS_AGGREGATIONS[aggregation](PER_TOKEN, MASK, NORM)
    assert out.item() == pytest.approx(expected)


def test_loss_norm_from_mask():
    assert LossNorm.from_mask(MASK) == LossNorm(3, 4, 3)
    assert LossNorm.from_mask(MASK, max_completion_length=8).max_completion_length == 8


# ---------------------------------------------------------------------------------------------
# The whole objective.


def test_grpo_loss_worked_example():
    # Two completions, ratio 1 everywhere (first pass, μ = 1), Δ = ln 2 on every token, β = 0.1:
    #   row 0: Â = +1 on 2 tokens -> ℓ = -1 + 0.1·k3 = -1 + 0.1·0.306853 = -0.969315
    #   row 1: Â = -1 on 1 token  -> ℓ = +1 + 0.030685 = 1.030685
    #   sequence_mean: (-0.969315 + 1.030685) / 2 = 0.030685 (the policy terms cancel)
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    ref_logp = logp.detach() + math.log(2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = grpo_loss(logp, logp.detach(), ref_logp, adv, mask, beta=0.1, norm=LossNorm.from_mask(mask))
    k3 = 1 - math.log(2)
    assert out.loss.item() == pytest.approx(0.1 * k3)
    assert out.kl_sum.item() == pytest.approx(3 * k3)
    assert out.ratio_sum.item() == pytest.approx(3.0)
    assert (out.clipped_low_sum.item(), out.clipped_high_sum.item(), out.num_tokens.item()) == (0, 0, 3)
    assert out.loss.requires_grad and not out.kl_sum.requires_grad


def test_clip_counts_are_masked_sums():
    # tokens: ρ = 1.5, Â > 0 (high); ρ = 0.5, Â < 0 (low); ρ = 1.5 on padding (ignored)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = grpo_loss(logp, torch.zeros(1, 3), None, adv, mask, norm=LossNorm.from_mask(mask))
    assert (out.clipped_low_sum.item(), out.clipped_high_sum.item()) == (1, 1)
    assert out.ratio_sum.item() == pytest.approx(2.0)
    assert out.kl_sum.item() == 0.0


def test_beta_zero_ignores_reference():
    logp, old_logp, ref_logp, adv, mask = _random_batch(2)
    norm = LossNorm.from_mask(mask)
    with_ref = grpo_loss(logp, old_logp, ref_logp, adv, mask, norm=norm)
    without_ref = grpo_loss(logp, old_logp, None, adv, mask, norm=norm)
    assert with_ref.loss.item() == without_ref.loss.item()
    assert with_ref.kl_sum.item() > 0  # still reported, for monitoring
    assert without_ref.kl_sum.item() == 0.0


def _random_batch(seed: int, dtype=torch.float32, batch: int = 6, length: int = 7):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, length, generator=gen, dtype=dtype) * 3  # [B, T]
    old_logp = logp + torch.randn(batch, length, generator=gen, dtype=dtype) * 0.3  # [B, T] some clipped
    ref_logp = logp + torch.randn(batch, length, generator=gen, dtype=dtype) * 0.3  # [B, T]
    adv = torch.randn(batch, 1, generator=gen, dtype=dtype).expand(batch, length)  # [B, T]
    lengths = torch.tensor([7, 1, 4, 0, 6, 3])[:batch]  # [B] unequal, one empty
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)  # [B, T]
    return logp, old_logp, ref_logp, adv, mask


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gradcheck(aggregation, beta):
    logp, old_logp, ref_logp, adv, mask = _random_batch(0, torch.float64, batch=3, length=4)
    norm = LossNorm.from_mask(mask, max_completion_length=5)

    def loss_of(lp):
        return grpo_loss(
            lp, old_logp, ref_logp, adv, mask, clip_low=0.2, clip_high=0.28, beta=beta,
            aggregation=aggregation, norm=norm,
        ).loss  # fmt: skip

    ratio = torch.exp(logp - old_logp)
    # finite differences are only meaningful away from the clip's kinks
    assert ((ratio - 0.8).abs().min() > 1e-3) and ((ratio - 1.28).abs().min() > 1e-3)
    assert torch.autograd.gradcheck(loss_of, (logp.clone().requires_grad_(),))


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
def test_micro_batch_invariance(aggregation):
    logp, old_logp, ref_logp, adv, mask = _random_batch(1)
    norm = LossNorm.from_mask(mask, max_completion_length=9)  # global, computed once
    kwargs = {"clip_low": 0.2, "clip_high": 0.28, "beta": 0.04, "aggregation": aggregation, "norm": norm}

    results = []
    for split in ([6], [2, 2, 2], [1, 5], [3, 3]):
        lp = logp.clone().requires_grad_()
        total = torch.zeros(())
        stats = torch.zeros(5)
        for rows in torch.arange(6).split(split):
            out = grpo_loss(lp[rows], old_logp[rows], ref_logp[rows], adv[rows], mask[rows], **kwargs)
            out.loss.backward()
            total = total + out.loss.detach()
            stats += torch.stack(
                [out.kl_sum, out.ratio_sum, out.clipped_low_sum, out.clipped_high_sum, out.num_tokens]
            )
        results.append((total, lp.grad, stats))

    full_loss, full_grad, full_stats = results[0]
    assert full_stats[2] + full_stats[3] > 0, "the batch should exercise the clip"
    for total, grad, stats in results[1:]:
        torch.testing.assert_close(total, full_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(stats, full_stats, atol=1e-5, rtol=0)


def test_empty_rows_give_no_nan():
    mask = torch.zeros(2, 3)
    norm = LossNorm(num_sequences=2, num_tokens=0, max_completion_length=3)
    for aggregation in LOSS_AGGREGATIONS:
        out = grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), None, torch.ones(2, 3), mask,
                        aggregation=aggregation, norm=norm)  # fmt: skip
        assert out.loss.item() == 0.0


# ---------------------------------------------------------------------------------------------
# Errors and masking.


@pytest.mark.parametrize(
    ("kwargs", "listed"),
    [
        ({"variant": "ppo"}, POLICY_LOSSES),
        ({"aggregation": "mean"}, LOSS_AGGREGATIONS),
        ({"kl_estimator": "k4"}, KL_ESTIMATORS),
    ],
)
def test_unknown_names_list_valid_ones(kwargs, listed):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="valid") as err:
        grpo_loss(x, x, None, x, x, norm=LossNorm(1, 0, 2), **kwargs)
    for name in listed:
        assert repr(name) in str(err.value)


def test_kl_penalty_unknown_estimator():
    with pytest.raises(ValueError, match=r"'k1', 'k2', 'k3'"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k5")


def test_beta_without_reference_is_an_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(x, x, None, x, torch.ones(1, 2), beta=0.1, norm=LossNorm(1, 2, 2))


def test_sequence_level_advantage_shape_is_rejected():
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(x, x, None, torch.zeros(2), torch.ones(2, 2), norm=LossNorm(2, 4, 2))


def test_apply_truncation_mask():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    truncated = torch.tensor([False, True, False])
    expected = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert torch.equal(apply_truncation_mask(mask, truncated), expected)
    assert torch.equal(apply_truncation_mask(mask.bool(), truncated), expected.bool())
