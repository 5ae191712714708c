"""CISPO, SAPO and the bias-corrected KL term against hand-worked numbers (arithmetic in the comments)."""

import math

import pytest
import torch

from grpo.algorithm.loss import POLICY_LOSSES, LossNorm, grpo_loss

LN2 = math.log(2.0)


def _loss_and_grad(logp_values, old_values, advantages, *, ref_values=None, **kwargs):
    logp = torch.tensor([logp_values], requires_grad=True)  # [1, T]
    old = torch.tensor([old_values])
    ref = None if ref_values is None else torch.tensor([ref_values])
    adv = torch.tensor([advantages])
    mask = torch.ones_like(old)
    out = grpo_loss(logp, old, ref, adv, mask, norm=LossNorm.from_mask(mask), **kwargs)
    out.loss.backward()
    return out, logp.grad[0]


def test_registered():
    assert {"grpo", "gspo", "cispo", "sapo"} <= set(POLICY_LOSSES)


def test_cispo_caps_the_detached_ratio_and_keeps_every_gradient():
    # log π = ln 0.5 on both tokens; π_old 0.25 and 0.5 -> ρ = [2, 1]; cap 1 + ε_high = 1.5 -> w = [1.5, 1].
    # Â = 2. ℓ_t = -w·Â·log π = [1.5·2·ln2, 1·2·ln2] = [3 ln2, 2 ln2]; sequence mean = 2.5 ln2.
    # ∂ℓ_t/∂log π = -w·Â = [-3, -2], halved by the mean over 2 tokens: [-1.5, -1].
    # The capped token still gets a gradient (PPO's clip would give it 0).
    out, grad = _loss_and_grad(
        [math.log(0.5)] * 2, [math.log(0.25), math.log(0.5)], [2.0, 2.0], variant="cispo", clip_high=0.5
    )
    assert out.loss.item() == pytest.approx(2.5 * LN2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-1.5, -1.0]))
    assert out.clipped_high_sum.item() == 1 and out.clipped_low_sum.item() == 0


def test_sapo_soft_gate():
    # token 0: Â = 1 > 0, τ_pos = 1, ρ = 1: f = σ(0)·4/1 = 2, ℓ = -2; ∂ℓ/∂log π = -Â·4σ(1-σ)·ρ = -1.
    # token 1: Â = -1, τ_neg = 2, ρ = 1.5: f = σ(2·0.5)·4/2 = 2σ(1) = 1.4621172, ℓ = +1.4621172;
    #          ∂ℓ/∂log π = -Â·4σ(1)(1-σ(1))·ρ = 4·0.7310586·0.2689414·1.5 = 1.1796716.
    # sequence mean over the 2 tokens halves both.
    sig1 = 1 / (1 + math.exp(-1))
    out, grad = _loss_and_grad(
        [math.log(0.3), math.log(0.3)],
        [math.log(0.3), math.log(0.2)],
        [1.0, -1.0],
        variant="sapo",
        variant_options={"temperature_pos": 1.0, "temperature_neg": 2.0},
    )
    assert out.loss.item() == pytest.approx((-2.0 + 2 * sig1) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-0.5, 4 * sig1 * (1 - sig1) * 1.5 / 2]))
    assert out.clipped_high_sum.item() == 0 and out.clipped_low_sum.item() == 0


def test_bias_corrected_kl_multiplies_by_the_differentiable_ratio():
    # Â = 0 isolates the KL term. log π = ln 0.5, log π_ref = ln 0.25: Δ = ln 0.5,
    # k3 = 0.5 + ln2 - 1 = 0.1931472.
    # On-policy (ρ = 1) the value is unchanged, β·k3 = 0.01931472 with β = 0.1, but the gradient is not:
    #   plain:     β·∂k3/∂log π = β·(1 - e^Δ) = 0.1·0.5 = 0.05
    #   corrected: β·(∂k3/∂log π·ρ + k3·∂ρ/∂log π) = 0.1·(0.5 + 0.1931472) = 0.1·ln2 = 0.0693147
    k3 = 0.5 + LN2 - 1
    args = ([math.log(0.5)], [math.log(0.5)], [0.0])
    plain, grad_plain = _loss_and_grad(*args, ref_values=[math.log(0.25)], beta=0.1)
    fixed, grad_fixed = _loss_and_grad(*args, ref_values=[math.log(0.25)], beta=0.1, kl_bias_correction=True)
    assert plain.loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    assert fixed.loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    assert grad_plain.item() == pytest.approx(0.05, rel=1e-6)
    assert grad_fixed.item() == pytest.approx(0.1 * LN2, rel=1e-6)
    # Off-policy (π_old = 0.25, ρ = 2) the corrected value is β·k3·ρ = 0.0386294.
    off, _ = _loss_and_grad(
        [math.log(0.5)],
        [math.log(0.25)],
        [0.0],
        ref_values=[math.log(0.25)],
        beta=0.1,
        kl_bias_correction=True,
    )
    assert off.loss.item() == pytest.approx(0.1 * k3 * 2, rel=1e-6)
