"""The loop's stages that join records, rewards and the algorithm: scoring one round of rollouts and
building the learner's batch. They sit above `records.py` (which imports only torch) and below the loop.

    score_rollouts     PromptBatch + Rollouts + texts → ScoredRollouts (rewards per function, their
                       weighted total, DAPO's overlong shaping)
    build_train_batch  ScoredRollouts' rows + advantages → TrainBatch (padding, masks, per-token credit)

Reward functions are called TRL's way (trl_compat.reward_inputs): one prompt and completion per sample, the
dataset's other columns as keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo import trl_compat
from grpo.algorithm.advantages import discounted_token_advantages
from grpo.algorithm.filters import overlong_penalty
from grpo.algorithm.loss import apply_truncation_mask
from grpo.records import PromptBatch, Rollouts, ScoredRollouts, TrainBatch
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
    rewards = scores.total + shaping
    if rollouts.episodes is not None and any(e.final_reward is not None for e in rollouts.episodes):
        fixed = [e.final_reward for e in rollouts.episodes]  # an agent's own reward replaces the total
        has = torch.tensor([f is not None for f in fixed])
        rewards = torch.where(
            has, torch.tensor([0.0 if f is None else f for f in fixed]).to(rewards), rewards
        )
    return ScoredRollouts(prompts, rollouts, texts, scores, rewards, lag=lag)


def environment_rewards(rollouts: Rollouts, names: list[str], weight: float) -> list:
    """The environments' own rewards as reward columns: one per class that scores (TRL logs it as
    reward/<ClassName>), the episode's reward where it ran in that class, else None; weighted by weight."""
    episodes = rollouts.episodes or []
    return [
        (name, [e.env_reward if e.env_class == name else None for e in episodes], weight) for name in names
    ]


def build_train_batch(
    prompts: PromptBatch,
    rollouts: Rollouts,
    advantages: Tensor,
    pad_id: int,
    *,
    gamma: float = 1.0,
    mask_truncated: bool = False,
    old_logprobs: Tensor | None = None,
    behaviour_logprobs: Tensor | None = None,
) -> TrainBatch:
    """Left-padded prompt | right-padded completion rows, with per-token advantages (`token_advantages`)
    and the completion mask (truncated completions masked out when mask_truncated, DAPO). old_logprobs /
    behaviour_logprobs [N, T]: the sampler's log-probs in the role they can play (see TrainBatch)."""
    group = rollouts.group_ids.tolist()  # [N]
    width = max(len(prompts.prompt_token_ids[i]) for i in group)
    n = rollouts.completion_ids.shape[0]
    prompt_ids = torch.full((n, width), pad_id, dtype=torch.long)  # [N, Lp]
    prompt_mask = torch.zeros((n, width), dtype=torch.long)
    for row, i in enumerate(group):
        ids = prompts.prompt_token_ids[i]
        prompt_ids[row, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, width - len(ids) :] = 1
    mask = rollouts.completion_mask  # [N, T]
    loss_mask = rollouts.loss_mask  # [N, T]
    if mask_truncated:
        mask = apply_truncation_mask(mask, rollouts.truncated)
        loss_mask = mask if rollouts.loss_mask is rollouts.completion_mask else mask * rollouts.loss_mask
    elif rollouts.loss_mask is rollouts.completion_mask:
        loss_mask = mask
    return TrainBatch(
        input_ids=torch.cat([prompt_ids, rollouts.completion_ids], dim=1),  # [N, Lp + T]
        attention_mask=torch.cat([prompt_mask, rollouts.completion_mask.long()], dim=1),
        prompt_width=width,
        completion_mask=mask,
        advantages=token_advantages(advantages, loss_mask, gamma),  # [N, T]
        group_ids=rollouts.group_ids,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        behaviour_logprobs=behaviour_logprobs,
    )


def token_advantages(advantages: Tensor, loss_mask: Tensor, gamma: float) -> Tensor:
    """[N] → [N, T] with γ credit, or a per-token estimator's [N, T] as it is: either way on the sampled
    tokens only (loss_mask [N, T]), since injected ones carry no action to credit."""
    if advantages.dim() == 2:
        return advantages * loss_mask.to(advantages.dtype)  # [N, T]
    return discounted_token_advantages(advantages, loss_mask, gamma)  # [N, T]
