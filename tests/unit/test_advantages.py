"""Group advantages against hand-worked numbers (arithmetic in the comments)."""

import math

import pytest
import torch

from grpo.algorithm.advantages import (
    ADVANTAGE_SCALINGS,
    discounted_token_advantages,
    group_advantages,
    group_reward_stats,
)

# Two groups, interleaved, with non-contiguous ids 5 and 2:
#   group 5: rewards [1, 3, 2] at positions 0, 2, 4 -> mean 2, centred [-1, 1, 0],
#            unbiased var (1 + 1 + 0) / 2 = 1, std 1
#   group 2: rewards [0, 4, 2] at positions 1, 3, 5 -> mean 2, centred [-2, 2, 0],
#            unbiased var (4 + 4 + 0) / 2 = 4, std 2
IDS = torch.tensor([5, 2, 5, 2, 5, 2])
REWARDS = torch.tensor([1.0, 0.0, 3.0, 4.0, 2.0, 2.0])
CENTRED = torch.tensor([-1.0, -2.0, 1.0, 2.0, 0.0, 0.0])


def test_scale_none_is_centring_only():
    # Dr. GRPO: no division, eps unused.
    torch.testing.assert_close(group_advantages(REWARDS, IDS, scale="none"), CENTRED)


def test_scale_group_divides_by_each_groups_std():
    # group 5: [-1, 1, 0] / 1; group 2: [-2, 2, 0] / 2 -> all of [-1, 1, 0]
    expected = torch.tensor([-1.0, -1.0, 1.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, IDS, scale="group", eps=0.0), expected)
    # default eps = 1e-4: group 5 divides by 1.0001, group 2 by 2.0001
    with_eps = torch.tensor([-1 / 1.0001, -2 / 2.0001, 1 / 1.0001, 2 / 2.0001, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, IDS), with_eps)


def test_scale_batch_divides_by_std_of_all_rewards():
    # all rewards [1, 0, 3, 4, 2, 2]: mean 2, squared deviations 1+4+1+4+0+0 = 10,
    # unbiased var 10 / 5 = 2, std sqrt(2); the group-centred rewards are divided by it.
    expected = CENTRED / math.sqrt(2)
    torch.testing.assert_close(group_advantages(REWARDS, IDS, scale="batch", eps=0.0), expected)


def test_groups_are_found_by_id_not_position():
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    for scale in ADVANTAGE_SCALINGS:
        full = group_advantages(REWARDS, IDS, scale=scale)
        permuted = group_advantages(REWARDS[perm], IDS[perm], scale=scale)
        torch.testing.assert_close(permuted, full[perm])


@pytest.mark.parametrize("scale", sorted(ADVANTAGE_SCALINGS))
def test_group_of_one_gets_zero(scale):
    # ids [0, 0, 1]: group 0 = [1, 3] (mean 2, std sqrt(2)); group 1 = [5] alone -> 0, not NaN
    adv = group_advantages(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), scale=scale, eps=0.0)
    assert torch.isfinite(adv).all()
    assert adv[2].item() == 0.0
    if scale == "group":
        torch.testing.assert_close(adv[:2], torch.tensor([-1.0, 1.0]) / math.sqrt(2))


def test_single_sample_batch_is_zero():
    for scale in ADVANTAGE_SCALINGS:
        assert group_advantages(torch.tensor([0.7]), torch.tensor([3]), scale=scale).tolist() == [0.0]


@pytest.mark.parametrize("scale", sorted(ADVANTAGE_SCALINGS))
def test_identical_rewards_give_exactly_zero(scale):
    # 0.9 * 3 / 3 != 0.9 in float32; a naive mean would leave ~6e-8, which std + eps would turn into
    # an advantage of ~6e-4. The group-minimum shift makes it exactly 0.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.0, 1.0, 0.5])
    ids = torch.tensor([1, 1, 1, 2, 2, 2])
    adv = group_advantages(rewards, ids, scale=scale)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]


def test_unknown_scale_lists_valid_names():
    with pytest.raises(ValueError, match=r"'batch', 'group', 'none'"):
        group_advantages(REWARDS, IDS, scale="grouped")


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="same length"):
        group_advantages(REWARDS, IDS[:5])


def test_group_reward_stats():
    # groups: 0 = [1, 1] (equal), 1 = [0, 2] (std sqrt(2)), 2 = [5] (alone: equal, std 0)
    stats = group_reward_stats(torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0]), torch.tensor([0, 0, 1, 1, 2]))
    assert stats["frac_zero_std_groups"] == pytest.approx(2 / 3)
    assert stats["reward_std_within_group_mean"] == pytest.approx(math.sqrt(2) / 3)


def test_discount_half_on_three_tokens():
    # L = 3, gamma = 0.5: token t gets 0.5^(L-1-t) * A = [0.25A, 0.5A, A]; padding gets 0.
    adv = torch.tensor([2.0, -4.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = discounted_token_advantages(adv, mask, gamma=0.5)
    expected = torch.tensor([[0.5, 1.0, 2.0, 0.0], [-4.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_discount_one_broadcasts_and_zero_keeps_only_last_token():
    adv = torch.tensor([3.0])
    mask = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(
        discounted_token_advantages(adv, mask, 1.0), torch.tensor([[3.0, 3.0, 3.0, 0.0]])
    )
    torch.testing.assert_close(
        discounted_token_advantages(adv, mask, 0.0), torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    )


def test_discount_rejects_gamma_outside_unit_interval():
    with pytest.raises(ValueError, match="gamma"):
        discounted_token_advantages(torch.ones(1), torch.ones(1, 2), gamma=1.5)


def test_discount_counts_tokens_left_when_mask_starts_after_a_prompt():
    # completion at positions 2..4 (L = 3) after a 2-token prompt: [0, 0, 0.25A, 0.5A, A]
    out = discounted_token_advantages(torch.tensor([4.0]), torch.tensor([[0, 0, 1, 1, 1]]), gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.0, 2.0, 4.0]]))


def test_unscored_completions_are_left_out_of_the_group_baseline():
    # Group 0: rewards [1, NaN, 3, 5] -> the NaN (every reward function returned None) is left out:
    #   scored [1, 3, 5], mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> [-1, 0, 0, 1] with eps 0.
    #   Counted as 0 instead, the mean would be 2.25 and the NaN row's advantage negative.
    # Group 1: [NaN, NaN] -> nothing scored, advantages 0.
    # Group 2: [2, NaN] -> one scored sample: centred 0, advantage 0.
    rewards = torch.tensor([1.0, math.nan, 3.0, 5.0, math.nan, math.nan, 2.0, math.nan])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    expected = torch.tensor([-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, ids, scale="group", eps=0.0), expected)
    torch.testing.assert_close(
        group_advantages(rewards, ids, scale="none"), torch.tensor([-2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    )
    # batch: std of the scored rewards [1, 3, 5, 2]: mean 2.75, squared deviations
    # 3.0625 + 0.0625 + 5.0625 + 0.5625 = 8.75, var 8.75 / 3, std 1.7078
    batch_std = math.sqrt(8.75 / 3)
    torch.testing.assert_close(
        group_advantages(rewards, ids, scale="batch", eps=0.0),
        torch.tensor([-2 / batch_std, 0.0, 0.0, 2 / batch_std, 0.0, 0.0, 0.0, 0.0]),
    )
    stats = group_reward_stats(rewards, ids)
    # zero-spread groups: group 1 (nothing scored) and group 2 (one scored) -> 2 of 3
    assert stats["frac_zero_std_groups"] == pytest.approx(2 / 3)
    assert stats["reward_std_within_group_mean"] == pytest.approx(2 / 3)  # (2 + 0 + 0) / 3
