"""Issue 31's semantics of an agent's episodes: a forked episode (several rows) counts once in its group, and
the "turn" estimator credits per-turn rewards with reward-to-go. Hand-worked numbers in the comments."""

import math

import torch

from grpo.algorithm import advantages as adv
from grpo.config import GRPOConfig
from grpo.records import Episode, PromptBatch, RewardScores, Rollouts, ScoredRollouts
from grpo.run.metrics import episode_metrics, reward_metrics, step_metrics


def scored_of(episodes, rewards, group_ids, turn_ids=None, loss_mask=None, width=5):
    n = len(episodes)
    mask = torch.ones(n, width) if loss_mask is None else (loss_mask > 0).float()
    rollouts = Rollouts(
        group_ids=torch.tensor(group_ids),
        completion_ids=torch.ones(n, width, dtype=torch.long),
        completion_mask=torch.ones(n, width),
        sampling_logprobs=torch.zeros(n, width),
        truncated=torch.zeros(n, dtype=torch.bool),
        loss_mask=mask,
        turn_ids=turn_ids,
        episodes=episodes,
    )
    total = torch.tensor(rewards)
    scores = RewardScores(per_function=total[:, None], names=["agent"], total=total, none_applicable=0)
    prompts = PromptBatch(prompts=["p", "q"], prompt_token_ids=[[7], [8]])
    return ScoredRollouts(prompts, rollouts, ["t"] * n, scores, total)


def algorithm(estimator="group", scale="group", eps=1e-4):
    a = GRPOConfig().algorithm
    a.advantage_estimator, a.advantage_scale, a.advantage_eps = estimator, scale, eps
    return a


# -- a forked episode is one member of its group ------------------------------------------------------------
def forked():
    """Group 0: episode A forked into 3 rows (reward 1), episode B one row (reward 0); group 1: C 2, D 4."""
    a, b, c, d = (Episode(messages=[]) for _ in range(4))
    return scored_of([a, a, b, a, c, d], [1.0, 1.0, 0.0, 1.0, 2.0, 4.0], [0, 0, 0, 0, 1, 1])


def test_a_forked_episode_counts_once_in_its_groups_mean_and_std():
    # group 0 by episode: [1, 0] -> mean 0.5, unbiased std sqrt(0.5) -> A: 0.5 / sqrt(0.5) = sqrt(0.5), B -it.
    # (by row it was [1, 1, 0, 1]: mean 0.75, std 0.5 -> A 0.5, B -1.5.)
    # group 1: [2, 4] -> -1/sqrt(2), +1/sqrt(2)
    got = adv.estimate_advantages(forked(), algorithm(eps=0.0))
    h = math.sqrt(0.5)
    torch.testing.assert_close(got, torch.tensor([h, h, -h, h, -h, h]))
    # the batch std counts episodes once too: episodes [1, 0, 2, 4], mean 1.75, var (0.5625 + 3.0625 + 0.0625
    # + 5.0625) / 3 = 8.75 / 3; centred within groups [0.5, -0.5, -1, 1]
    std = math.sqrt(8.75 / 3)
    batch = adv.estimate_advantages(forked(), algorithm(scale="batch", eps=0.0))
    torch.testing.assert_close(batch, torch.tensor([0.5, 0.5, -0.5, 0.5, -1.0, 1.0]) / std)


def test_equal_episodes_of_a_forked_group_get_exactly_zero():
    a, b = Episode(messages=[]), Episode(messages=[])
    scored = scored_of([a, a, a, b], [0.9, 0.9, 0.9, 0.9], [0, 0, 0, 0])
    assert adv.estimate_advantages(scored, algorithm()).tolist() == [0.0] * 4


def test_without_forks_the_group_estimator_is_todays_bitwise():
    episodes = [Episode(messages=[]) for _ in range(4)]
    scored = scored_of(episodes, [0.1, 0.7, 0.3, 0.3], [0, 0, 1, 1])
    assert adv.episode_rows(scored.rollouts) is None
    expected = adv.group_advantages(scored.rewards, scored.rollouts.group_ids)
    assert torch.equal(adv.estimate_advantages(scored, algorithm()), expected)


def test_step_metrics_count_each_episode_once():
    scored = forked()
    scored.rollouts.episodes[2].ended_by = "timeout"  # episode B; A (3 rows), C and D end by "answer"
    rewards = reward_metrics(scored)
    # by episode [1, 0, 2, 4] -> mean 1.75 (by row it was 1.5)
    assert rewards["reward"] == 1.75 and rewards["reward/agent"] == 1.75
    assert rewards["reward_std"] == torch.tensor([1.0, 0.0, 2.0, 4.0]).std().item()
    episodes = episode_metrics(scored.rollouts)
    assert episodes["episode/ended_by/answer"] == 0.75  # 3 of 4 episodes (by row: 5 of 6)
    # 6 rows of 5 sampled tokens over 4 episodes
    assert episodes["episode/sampled_tokens"] == 30 / 4
    stats = step_metrics(scored, adv.estimate_advantages(scored, algorithm()), {}, {})
    # group 0 by episode [1, 0]: std sqrt(0.5); group 1 [2, 4]: std sqrt(2)
    assert math.isclose(
        stats["reward_std_within_group_mean"], (math.sqrt(0.5) + math.sqrt(2)) / 2, rel_tol=1e-6
    )


# -- the "turn" estimator: per-turn rewards, reward-to-go ---------------------------------------------------
# Group 0, two episodes of two turns; columns of a row: turn ids (0 = injected or padding).
#   E1 row: turns [1, 1, 0, 2, 2]; turn reward {1: 2.0}; its episode reward 0.0 (given) at its last turn, 2.
#   E2 row: turns [1, 0, 2, 2, 0];  no turn reward;      its episode reward 1.0 at turn 2.
# The group's rewards [2, 0, 1]: mean 1, unbiased std 1 -> normalised (scale none: centred) [1, -1, 0].
# Reward-to-go: E1 turn 1 gets 1 + (-1) = 0, turn 2 gets -1; E2's turns get 0.
TURNS = torch.tensor([[1, 1, 0, 2, 2], [1, 0, 2, 2, 0]])


def two_turn_episodes():
    e1, e2 = Episode(messages=[], turn_rewards={1: 2.0}), Episode(messages=[])
    return scored_of([e1, e2], [0.0, 1.0], [0, 0], turn_ids=TURNS, loss_mask=(TURNS > 0).float())


def test_turn_rewards_are_credited_from_their_turn_on_against_the_group():
    got = adv.estimate_advantages(two_turn_episodes(), algorithm("turn", scale="none"))
    expected = torch.tensor([[0.0, 0.0, 0.0, -1.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(got, expected)
    # scale group divides by the pool's std (1) + eps
    grouped = adv.estimate_advantages(two_turn_episodes(), algorithm("turn"))
    torch.testing.assert_close(grouped, expected / 1.0001)


def test_an_episode_reward_that_is_the_sum_of_its_turn_rewards_is_not_counted_twice():
    # E1's reward is only the sum of its turn rewards {1: 2.0, 2: -1.0}: the pool is [2, -1, 1] (E2 at
    # turn 2), mean 2/3; centred [4/3, -5/3, 1/3]. E1 turn 1: 4/3 - 5/3 = -1/3, turn 2: -5/3;
    # E2: 1/3 on its turns.
    scored = two_turn_episodes()
    e1 = scored.rollouts.episodes[0]
    e1.turn_rewards, e1.reward_is_turn_sum = {1: 2.0, 2: -1.0}, True
    scored.rewards[0] = 1.0
    got = adv.estimate_advantages(scored, algorithm("turn", scale="none"))
    t = 1 / 3
    expected = torch.tensor([[-t, -t, 0.0, -5 * t, -5 * t], [t, 0.0, t, t, 0.0]])
    torch.testing.assert_close(got, expected)


def test_a_forked_episodes_turns_are_credited_across_its_rows_and_counted_once():
    # E1 forked after turn 1: row a holds turn 1, row b holds turn 2 (its prompt re-rendered: turn 0).
    e1, e2 = Episode(messages=[], turn_rewards={1: 2.0}), Episode(messages=[])
    turns = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 2, 2], [1, 0, 2, 2, 0]])
    scored = scored_of(
        [e1, e1, e2], [0.0, 0.0, 1.0], [0, 0, 0], turn_ids=turns, loss_mask=(turns > 0).float()
    )
    got = adv.estimate_advantages(scored, algorithm("turn", scale="none"))
    expected = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0, -1.0], [0.0] * 5])
    assert torch.equal(got, expected)


def test_without_turn_rewards_the_turn_estimator_is_the_group_estimator():
    episodes = [Episode(messages=[]) for _ in range(4)]
    turns = torch.tensor([[1, 1, 0, 2, 2], [1, 0, 2, 0, 0], [1, 1, 1, 0, 0], [1, 0, 2, 0, 3]])
    scored = scored_of(
        episodes, [0.1, 0.7, 0.3, 0.5], [0, 0, 1, 1], turn_ids=turns, loss_mask=(turns > 0).float()
    )
    group = adv.estimate_advantages(scored, algorithm("group"))  # [N]
    got = adv.estimate_advantages(scored, algorithm("turn"))  # [N, T]
    assert torch.equal(got, group[:, None] * (turns > 0))
    # and without per-turn data (any runner but the gateway) it returns the group estimator's [N] itself
    plain = scored_of(episodes, [0.1, 0.7, 0.3, 0.5], [0, 0, 1, 1])
    assert torch.equal(adv.estimate_advantages(plain, algorithm("turn")), group)


def test_a_dropped_episode_gets_no_credit_and_stays_out_of_the_pool():
    scored = two_turn_episodes()
    dropped = Episode(messages=[], final_reward=math.nan)
    turns = torch.cat([TURNS, torch.tensor([[1, 1, 1, 0, 0]])])
    scored = scored_of([*scored.rollouts.episodes, dropped], [0.0, 1.0, math.nan], [0, 0, 0], turn_ids=turns,
                       loss_mask=(turns > 0).float())  # fmt: skip
    got = adv.estimate_advantages(scored, algorithm("turn", scale="none"))
    expected = torch.tensor([[0.0, 0.0, 0.0, -1.0, -1.0], [0.0] * 5, [0.0] * 5])
    assert torch.equal(got, expected)
