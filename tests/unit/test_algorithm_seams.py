"""The algorithm's two seams the learner and the loop call: the policy loss bound once from the settings
(`make_policy_loss`) and advantages by a registered estimator ([N] or [N, T])."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo.algorithm import advantages as adv
from grpo.algorithm import loss as L
from grpo.config import GRPOConfig
from grpo.records import PromptBatch, RewardScores, Rollouts, ScoredRollouts
from grpo.stages import build_train_batch


def _tensors(seed: int = 0, b: int = 4, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64)  # [B, T]
    old = logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    advantages = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 3:] = 0
    return logp, old, ref, advantages, mask


@pytest.mark.parametrize("variant", ["grpo", "gspo", "cispo", "sapo"])
def test_bound_loss_equals_the_loss_called_with_every_option(variant):
    cfg = GRPOConfig()
    a = cfg.algorithm
    a.loss_variant, a.beta, a.entropy_coef, a.use_bias_correction_kl = variant, 0.04, 0.01, True
    a.sapo_temperature_pos, a.sapo_temperature_neg, a.epsilon_high = 0.7, 1.3, 0.28
    a.gamma = 1.0
    logp, old, ref, advantages, mask = _tensors()
    if variant == "gspo":  # one advantage per sequence, broadcast
        advantages = advantages[:, :1].expand_as(advantages).clone()
    norm = L.LossNorm.from_mask(mask, 8)
    entropy = torch.rand_like(logp)
    bound = L.make_policy_loss(a)(logp, old, ref, advantages, mask, norm=norm, entropy=entropy)
    by_hand = L.grpo_loss(
        logp, old, ref, advantages, mask, variant=variant, clip_low=a.epsilon_low, clip_high=a.epsilon_high,
        beta=a.beta, kl_estimator=a.kl_estimator, aggregation=a.loss_aggregation, norm=norm, entropy=entropy,
        entropy_coef=a.entropy_coef, kl_bias_correction=a.use_bias_correction_kl,
        variant_options={"temperature_pos": 0.7, "temperature_neg": 1.3},
    )  # fmt: skip
    for field in dataclasses.fields(L.LossOutput):
        assert torch.equal(getattr(bound, field.name), getattr(by_hand, field.name)), field.name


def test_a_new_loss_reads_its_options_from_settings_named_after_it(monkeypatch):
    seen = {}

    def scaled(*, logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, factor: float = 1.0, **_):
        del old_logp, mask, clip_low, clip_high
        seen["factor"] = factor
        loss = -factor * logp * advantages  # [B, T]
        none = torch.zeros_like(logp, dtype=torch.bool)
        return loss, L.RatioStats(torch.ones_like(logp), none, none)

    monkeypatch.setitem(L.POLICY_LOSSES, "scaled", scaled)
    assert L.variant_options(scaled) == ("factor",)
    settings = SimpleNamespace(**{**dataclasses.asdict(GRPOConfig().algorithm), "loss_variant": "scaled"})
    settings.scaled_factor, settings.beta = 3.0, 0.0
    logp, old, _, advantages, mask = _tensors()
    L.make_policy_loss(settings)(logp, old, None, advantages, mask, norm=L.LossNorm.from_mask(mask))
    assert seen == {"factor": 3.0}
    del settings.scaled_factor
    with pytest.raises(ValueError, match="reads settings that do not exist: scaled_factor"):
        L.make_policy_loss(settings)


# -- advantages ------------------------------------------------------------------------------------------
PAD = 0


def _scored(rewards: list[float], loss_mask: torch.Tensor | None = None) -> ScoredRollouts:
    n = len(rewards)
    t = 4
    completion_mask = torch.ones(n, t)
    completion_mask[0, 3:] = 0
    rollouts = Rollouts(
        group_ids=torch.tensor([0, 0, 1, 1][:n]),
        completion_ids=torch.arange(1, n * t + 1).reshape(n, t),
        completion_mask=completion_mask,
        sampling_logprobs=torch.zeros(n, t),
        truncated=torch.zeros(n, dtype=torch.bool),
        loss_mask=loss_mask,
    )
    total = torch.tensor(rewards)
    scores = RewardScores(per_function=total[:, None], names=["r"], total=total, none_applicable=0)
    prompts = PromptBatch(prompts=["p", "q"], prompt_token_ids=[[7, 8], [9]])
    return ScoredRollouts(prompts, rollouts, ["t"] * n, scores, total)


def test_the_group_estimator_is_todays_group_advantages():
    scored = _scored([1.0, 3.0, 0.0, 4.0])
    a = GRPOConfig().algorithm
    expected = adv.group_advantages(
        scored.rewards, scored.rollouts.group_ids, a.advantage_scale, a.advantage_eps
    )
    assert torch.equal(adv.estimate_advantages(scored, a), expected)
    assert "group" in adv.ADVANTAGE_ESTIMATORS


def test_a_per_token_estimator_reaches_the_batch_on_the_sampled_tokens_without_discount(monkeypatch):
    # Row 1 has an injected token at column 1 (loss mask 0): it gets no advantage.
    loss_mask = torch.ones(4, 4)
    loss_mask[0, 3:] = 0
    loss_mask[1, 1] = 0
    scored = _scored([1.0, 3.0, 0.0, 4.0], loss_mask=loss_mask)
    per_token = torch.arange(16, dtype=torch.float32).reshape(4, 4) + 1  # [N, T]
    monkeypatch.setattr(adv, "ADVANTAGE_ESTIMATORS", adv.Registry("advantage estimator"))
    adv.ADVANTAGE_ESTIMATORS.register("turns", lambda scored, settings: per_token)
    got = adv.estimate_advantages(scored, GRPOConfig().algorithm, "turns")
    batch = build_train_batch(scored.prompts, scored.rollouts, got, PAD, gamma=0.5)
    assert torch.equal(batch.advantages, per_token * loss_mask)  # γ applies to [N] only
    # metrics read one number per row: the mean over the sampled tokens
    # row 0: (1 + 2 + 3) / 3 = 2; row 1: (5 + 7 + 8) / 3 = 20/3
    rows = adv.per_row_advantages(batch.advantages, batch.loss_mask)
    torch.testing.assert_close(rows[:2], torch.tensor([2.0, 20 / 3]))


def test_an_estimator_of_the_wrong_shape_is_refused(monkeypatch):
    monkeypatch.setattr(adv, "ADVANTAGE_ESTIMATORS", adv.Registry("advantage estimator"))
    adv.ADVANTAGE_ESTIMATORS.register("bad", lambda scored, settings: torch.zeros(3))
    with pytest.raises(ValueError, match=r"returned shape \(3,\); it must return \[N\] = \(4,\)"):
        adv.estimate_advantages(_scored([1.0, 3.0, 0.0, 4.0]), GRPOConfig().algorithm, "bad")
    with pytest.raises(ValueError, match="Unknown advantage estimator 'grop'"):
        adv.estimate_advantages(_scored([1.0, 3.0, 0.0, 4.0]), GRPOConfig().algorithm, "grop")
