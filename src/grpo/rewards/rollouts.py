"""The loop's score stage: one round of rollouts → ScoredRollouts (rewards per function, their weighted
total, plus DAPO's overlong shaping). Reward functions are called TRL's way (trl_compat.reward_inputs):
one prompt and completion per sample, the dataset's other columns as keyword arguments."""

from __future__ import annotations

from collections.abc import Callable

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
    env_rewards: tuple[list[str], float] = ([], 1.0),
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
        given=environment_rewards(rollouts, *env_rewards),
    )
    shaping = overlong_penalty(rollouts.lengths, max_new_tokens, a.overlong_buffer, a.overlong_penalty)  # [N]
    return ScoredRollouts(prompts, rollouts, texts, scores, scores.total + shaping, lag=lag)


def environment_rewards(rollouts: Rollouts, names: list[str], weight: float) -> list:
    """The environments' own rewards as reward columns: one per class that scores (TRL logs it as
    reward/<ClassName>), the episode's reward where it ran in that class, else None; weighted by weight."""
    episodes = rollouts.episodes or []
    return [
        (name, [e.env_reward if e.env_class == name else None for e in episodes], weight) for name in names
    ]
