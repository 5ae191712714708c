"""The loop's score stage: one round of rollouts → ScoredRollouts (rewards per function, their weighted
total, plus DAPO's overlong shaping). Reward functions are called TRL's way (trl_compat.reward_inputs):
one prompt and completion per sample, the dataset's other columns as keyword arguments."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo import trl_compat
from grpo.algorithm.filters import overlong_penalty
from grpo.records import PromptBatch, Rollouts, ScoredRollouts
from grpo.rewards.scoring import score_completions


def score_rollouts(
    prompts: PromptBatch,
    rollouts: Rollouts,
    texts: list[str],
    lag: int,
    *,
    funcs: list[Callable],
    weights: list[float] | None,
    algorithm,
    max_new_tokens: int,
    trainer_state: trl_compat.RewardState,
) -> ScoredRollouts:
    a = algorithm
    columns = {k: [v[i] for i in rollouts.group_ids] for k, v in prompts.columns.items()}
    # The trainer's values, never a dataset column's (a column by these names is refused at start-up).
    columns["completion_truncated"] = rollouts.truncated.tolist()
    reward_prompts, completions, extra = trl_compat.reward_inputs(prompts, rollouts, texts)
    columns.update(extra)
    scores = score_completions(
        funcs,
        weights,
        reward_prompts,
        completions,
        columns,
        timeout=a.reward_timeout,
        on_error=a.reward_on_error,
        isolation=a.reward_isolation,
        extras={"trainer_state": trainer_state},
    )
    shaping = overlong_penalty(rollouts.lengths, max_new_tokens, a.overlong_buffer, a.overlong_penalty)  # [N]
    rewards = scores.total + shaping
    if rollouts.episodes is not None and any(e.final_reward is not None for e in rollouts.episodes):
        fixed = [e.final_reward for e in rollouts.episodes]  # an agent's own reward replaces the total
        has = torch.tensor([f is not None for f in fixed])
        rewards = torch.where(
            has, torch.tensor([0.0 if f is None else f for f in fixed]).to(rewards), rewards
        )
    return ScoredRollouts(prompts, rollouts, texts, scores, rewards, lag=lag)
