"""DAPO dynamic sampling and overlong shaping, GSPO's sequence ratio and the entropy bonus, on worked
numbers."""

import math

import pytest
import torch

from grpo.algorithm.filters import informative_prompts, overlong_penalty
from grpo.algorithm.loss import LossNorm, grpo_loss
from grpo.records import PromptBatch, Rollouts, ScoredRollouts, concat_rounds, first_groups, select_groups
from grpo.rewards import RewardScores


def test_overlong_penalty_worked_numbers():
    # max 16 tokens, buffer 4: free up to 12, then −1/4 per token, −1 at (and past) the limit.
    lengths = torch.tensor([10, 12, 13, 14, 16, 20])
    assert overlong_penalty(lengths, 16, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 16, 4, penalty=2.0).tolist() == [0.0, 0.0, -0.5, -1.0, -2.0, -2.0]
    assert overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 6  # off
    with pytest.raises(ValueError, match="smaller than the length limit"):
        overlong_penalty(lengths, 16, 16)


def test_informative_prompts_are_those_with_reward_spread():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # prompt 3 has a single completion
    assert informative_prompts(rewards, group_ids, 4).tolist() == [False, True, False, False]


def _round(rewards: list[list[float]], width: int, tag: str) -> ScoredRollouts:
    """A hand-made round: one list of rewards per prompt, completions of `width` tokens."""
    n_prompts, g = len(rewards), len(rewards[0])
    n = n_prompts * g
    flat = torch.tensor([r for group in rewards for r in group])
    prompts = PromptBatch(
        prompts=[f"{tag}{i}" for i in range(n_prompts)],
        prompt_token_ids=[[i] for i in range(n_prompts)],
        columns={"answer": [f"a{tag}{i}" for i in range(n_prompts)]},
        indices=list(range(n_prompts)),
    )
    rollouts = Rollouts(
        group_ids=torch.arange(n_prompts).repeat_interleave(g),
        completion_ids=torch.arange(n * width).reshape(n, width) + 10,
        completion_mask=torch.ones(n, width),
        sampling_logprobs=torch.zeros(n, width),
        truncated=torch.zeros(n, dtype=torch.bool),
    )
    scores = RewardScores(per_function=flat[:, None], names=["r"], total=flat, none_applicable=0)
    return ScoredRollouts(prompts, rollouts, [f"{tag}c{i}" for i in range(n)], scores, flat.clone())


def test_select_then_concat_keeps_groups_together_and_renumbers_them():
    first = _round([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], width=2, tag="A")  # only prompt 1 is informative
    second = _round([[1.0, 0.0], [0.5, 0.5]], width=3, tag="B")  # only prompt 0
    kept = [
        select_groups(q, informative_prompts(q.rewards, q.rollouts.group_ids, q.num_prompts))
        for q in (first, second)
    ]
    batch = concat_rounds(kept, pad_id=0)
    assert batch.prompts.prompts == ["A1", "B0"]
    assert batch.prompts.columns == {"answer": ["aA1", "aB0"]}
    assert batch.rollouts.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.texts == ["Ac2", "Ac3", "Bc0", "Bc1"]
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert batch.rollouts.completion_ids.shape == (4, 3)  # padded to the longer round
    assert batch.rollouts.completion_ids[0].tolist() == [14, 15, 0]  # A's row 2, right-padded with pad_id
    assert batch.rollouts.completion_mask[:, 2].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert first_groups(batch, 1).prompts.prompts == ["A1"]


def _loss(logp, old, adv, variant="grpo", **kw):
    mask = torch.ones_like(logp)
    return grpo_loss(logp, old, None, adv, mask, variant=variant, norm=LossNorm.from_mask(mask), **kw)


def test_gspo_clips_one_length_normalised_ratio_per_sequence():
    old = torch.zeros(3, 2)
    logp = torch.tensor(
        [
            [math.log(1.2), math.log(0.9)],  # s = sqrt(1.2·0.9) = 1.03923: inside the clip
            [math.log(1.5), math.log(1.5)],  # s = 1.5 > 1.2 with Â > 0: clipped high
            [math.log(0.5), math.log(0.5)],
        ],  # s = 0.5 < 0.8 with Â < 0: clipped low
        requires_grad=True,
    )
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]])
    out = _loss(logp, old, adv, "gspo", clip_low=0.2, clip_high=0.2)
    s0 = math.sqrt(1.2 * 0.9)
    # sequence_mean: (−s0 − 1.2 + 0.8) / 3
    assert out.loss.item() == pytest.approx((-s0 - 1.2 + 0.8) / 3, abs=1e-6)
    assert out.clipped_high_sum.item() == 2 and out.clipped_low_sum.item() == 2  # tokens of rows 1 and 2
    out.loss.backward()
    # Row 0: d(−s·Â)/d logp_t = −Â·s/|o| / N = −s0/2/3 on each token; clipped rows get no gradient.
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 6, -s0 / 6], abs=1e-6)
    assert logp.grad[1:].abs().sum().item() == 0.0


def test_gspo_equals_grpo_when_the_policy_has_not_moved():
    logp = torch.randn(4, 5)
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0])[:, None].expand(4, 5)
    assert _loss(logp, logp, adv, "gspo").loss.item() == pytest.approx(_loss(logp, logp, adv).loss.item())


def test_entropy_bonus_lowers_the_loss_by_coef_times_mean_entropy():
    logp = torch.zeros(1, 2, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0]], requires_grad=True)
    adv = torch.zeros(1, 2)  # no policy-gradient term: only the bonus is left
    out = _loss(logp, logp.detach(), adv, entropy=entropy, entropy_coef=0.1, aggregation="token_mean")
    assert out.loss.item() == pytest.approx(-0.1 * 1.5)
    out.loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.05, -0.05])  # −c / num_tokens
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        _loss(logp, logp, adv, entropy_coef=0.1)
