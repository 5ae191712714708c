"""Issue 31 through the gateway (a scripted policy on Qwen2.5's template, the real `openai` client): per-turn
rewards posted to /v1/reward reach the episode and the "turn" estimator with each token's turn; an episode
that forked into 3 rows counts once in its group."""

from __future__ import annotations

import itertools
import math

import httpx
import pytest
import torch

from grpo import trl_compat
from grpo.algorithm.advantages import estimate_advantages, group_advantages
from grpo.config import GRPOConfig
from grpo.stages import score_rollouts
from tests import gateway_agents as agents
from tests.chat_templates import family_tokenizer
from tests.unit.test_episodes import ScriptedEngine, calls_then_answers
from tests.unit.test_gateway import SAMPLING, batch, runner


@pytest.fixture(scope="module")
def qwen():
    return family_tokenizer("qwen2.5")


def post_reward(client, body: dict) -> None:
    url = str(client.base_url).rstrip("/") + "/reward"
    httpx.post(url, json=body, headers={"Authorization": f"Bearer {client.api_key}"}).raise_for_status()


def turn_rewarding_agent(episode_reward: bool):
    """Two turns (a call, then the answer); rewards 1, 2, 3, ... for the episodes' first turns, 10× for
    their second; with episode_reward also an episode reward of -1 (which then wins for "group")."""
    counter = itertools.count(1)

    def run(client, row):
        agents.calculator_agent(client, row)
        k = next(counter)
        post_reward(client, {"reward": float(k), "turn": 1})
        post_reward(client, {"reward": 10.0 * k, "turn": 2})
        if episode_reward:
            post_reward(client, {"reward": -1.0})

    return run


def drive(tokenizer, agent, n: int):
    run = runner(tokenizer, agent)
    try:
        prompts, r = run.run(
            ScriptedEngine(tokenizer, calls_then_answers), batch(["What is 12 * 34?"]), n, SAMPLING
        )
        return prompts, r, run.metrics()
    finally:
        run.close()


def zero(prompts, completions, **_):
    return [0.0] * len(completions)  # the agent's own rewards replace it


def scored_of(prompts, rollouts, estimator: str = "group"):
    a = GRPOConfig(advantage_estimator=estimator).algorithm
    state = trl_compat.RewardState(global_step=1, epoch=0.0, max_steps=1)
    scored = score_rollouts(prompts, rollouts, ["x"] * len(rollouts.episodes), 0, funcs=[zero], weights=None,
                            algorithm=a, max_new_tokens=200, trainer_state=state)  # fmt: skip
    return scored, a


def test_per_turn_rewards_reach_the_episode_and_each_token_knows_its_turn(qwen):
    _, r, _ = drive(qwen, turn_rewarding_agent(episode_reward=False), 2)
    posted = sorted(tuple(e.turn_rewards.items()) for e in r.episodes)
    assert posted == [((1, 1.0), (2, 10.0)), ((1, 2.0), (2, 20.0))]
    # no episode reward given: the episode's reward is the sum of its turns' (what "group" trains on)
    assert all(e.reward_is_turn_sum and e.final_reward == sum(e.turn_rewards.values()) for e in r.episodes)
    assert torch.equal(r.turn_ids > 0, r.loss_mask > 0)  # every sampled token has its turn, nothing else
    for row in r.turn_ids:
        sampled = row[row > 0].tolist()
        assert sampled == sorted(sampled) and set(sampled) == {1, 2}  # turn 1's tokens, then turn 2's


def test_an_episode_reward_wins_over_the_sum_of_turn_rewards_and_turn_credit_reads_both(qwen):
    prompts, r, _ = drive(qwen, turn_rewarding_agent(episode_reward=True), 2)
    assert [e.final_reward for e in r.episodes] == [-1.0, -1.0]
    assert not any(e.reward_is_turn_sum for e in r.episodes)
    scored, a = scored_of(prompts, r, "turn")
    assert scored.rewards.tolist() == [-1.0, -1.0]  # "group" would see no spread
    assert torch.equal(estimate_advantages(scored, GRPOConfig().algorithm), torch.zeros(2))
    got = estimate_advantages(scored, a)  # [N, T]
    # The group's rewards: turn 1 {k}, turn 2 {10k}, episode -1 at turn 2, for k in the two episodes.
    k = [e.turn_rewards[1] for e in r.episodes]
    pool = torch.tensor([k[0], k[1], 10 * k[0], 10 * k[1], -1.0, -1.0])
    z = group_advantages(pool, torch.zeros(6, dtype=torch.long))  # normalised against the group
    for i in range(2):
        turn1, turn2 = got[i][r.turn_ids[i] == 1], got[i][r.turn_ids[i] == 2]
        torch.testing.assert_close(turn2, (z[2 + i] + z[4 + i]).expand_as(turn2))
        torch.testing.assert_close(turn1, (z[i] + z[2 + i] + z[4 + i]).expand_as(turn1))
    assert (got[r.turn_ids == 0] == 0).all()


def rewriting_twice_agent():
    """Three calls, each with a history of its own: three rows of one episode. Returns 1 for the first
    episode to end, 0 for the second."""
    counter = itertools.count()

    def run(client, row):
        for k in range(3):
            messages = [{"role": "user", "content": f"{row['prompt']} (attempt {k})"}]
            client.chat.completions.create(model="policy", messages=messages, tools=agents.TOOLS)
        return 1.0 if next(counter) == 0 else 0.0

    return run


def test_an_episode_of_three_rows_counts_once_in_its_group(qwen):
    prompts, r, metrics = drive(qwen, rewriting_twice_agent(), 2)
    assert metrics["gateway/rows_per_episode"] == 3.0 and r.completion_ids.shape[0] == 6
    assert r.episodes[0] is r.episodes[1] is r.episodes[2] and r.episodes[3] is r.episodes[5]
    scored, a = scored_of(prompts, r)
    advantages = estimate_advantages(scored, a)
    # by episode [1, 0]: mean 0.5, std sqrt(0.5) -> ±0.5 / (sqrt(0.5) + eps), all rows of an episode alike
    h = 0.5 / (math.sqrt(0.5) + 1e-4)
    winner = 1.0 if scored.rewards[0] == 1.0 else -1.0
    torch.testing.assert_close(advantages, torch.tensor([h] * 3 + [-h] * 3) * winner)


@pytest.mark.parametrize("estimator", ["group", "turn"])
def test_the_configured_estimator_is_the_one_the_loop_uses(estimator):
    a = GRPOConfig(advantage_estimator=estimator).algorithm
    assert a.advantage_estimator == estimator
