"""Group-relative advantages: pure functions on tensors, no model, no I/O.

A rollout batch holds N completions; completions answering the same prompt share a `group_id`.
GRPO (DeepSeekMath, arXiv 2402.03300) replaces PPO's value baseline with the group's mean reward:

    Â_i = (r_i - mean_{g(i)}) / (scale_i + eps)

Groups are found by id, never by position: ids may be non-contiguous, unsorted or interleaved
(after shuffling, dynamic sampling or a gather across processes), so nothing here assumes that
group members sit next to each other. See docs/algorithm.md for the sources of every default.

The loop asks `ADVANTAGE_ESTIMATORS` for advantages: an estimator takes the scored batch and the algorithm
settings and returns one value per completion [N] (spread over the tokens with γ credit when the learner's
batch is built) or one per completion token [N, T] (its own credit, e.g. per-turn rewards; taken as is on
the sampled tokens). Today's path is the "group" entry; `algorithm.advantage_estimator` picks another ("turn":
per-turn rewards with reward-to-go, docs/agents.md).

An episode is one member of its group however many rows it has: an agent that rewrote its history through
the gateway (a fork) leaves several rows of one episode (the same `Episode` object), which count once in
the group's mean and std and share the episode's advantage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from grpo.plugins import Registry
from grpo.records import Rollouts, ScoredRollouts

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALINGS",
    "discounted_token_advantages",
    "episode_rows",
    "estimate_advantages",
    "group_advantages",
    "group_reward_stats",
    "per_episode",
    "per_row_advantages",
]


class _GroupMoments(NamedTuple):
    inverse: Tensor  # [N] long: index of each sample's group in 0..G-1
    centered: Tensor  # [N] r - mean of its group
    std: Tensor  # [G] unbiased per-group std (0 for a group of one)
    zero_spread: Tensor  # [G] bool: every reward in the group is the same


def _group_moments(rewards: Tensor, group_ids: Tensor) -> _GroupMoments:
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be 1-D of the same length, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [N]
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    # NaN = not scored (every reward function returned None): such a sample is left out of its group's
    # count, mean and std, and its centred reward is 0, as in TRL (nanmean/nanstd, advantage 0).
    scored = ~rewards.isnan()  # [N]
    zeros = rewards.new_zeros(num_groups)  # [G]
    counts = zeros.index_add(0, inverse, scored.to(rewards.dtype))  # [G]
    inf = torch.full_like(rewards, float("inf"))  # [N]
    group_min = zeros.scatter_reduce(
        0, inverse, torch.where(scored, rewards, inf), "amin", include_self=False
    )
    group_max = zeros.scatter_reduce(
        0, inverse, torch.where(scored, rewards, -inf), "amax", include_self=False
    )
    group_min = torch.where(counts > 0, group_min, 0.0)  # [G] a group with nothing scored: 0, not inf
    group_max = torch.where(counts > 0, group_max, 0.0)  # [G]
    # Averaging rewards shifted by the group minimum makes a group of equal rewards centre to
    # exactly 0: a plain mean can round the common value (0.9 x 3 in float32 leaves 6e-8), and
    # dividing that by std + eps = ~1e-7 + 1e-4 would turn it into a spurious advantage.
    shifted = torch.where(scored, rewards - group_min[inverse], 0.0)  # [N]
    shifted_mean = zeros.index_add(0, inverse, shifted) / counts.clamp(min=1)  # [G]
    centered = torch.where(scored, shifted - shifted_mean[inverse], 0.0)  # [N]
    sum_sq = zeros.index_add(0, inverse, centered.square())  # [G]
    # Unbiased (n - 1) variance, torch's default and what DeepSeekMath's reference code and TRL use.
    # A group of one has no spread to estimate: clamping n - 1 to 1 gives std 0 (its centred
    # reward is 0, so its advantage is 0, not 0/0).
    std = (sum_sq / (counts - 1).clamp(min=1)).sqrt()  # [G]
    return _GroupMoments(inverse, centered, std, group_max == group_min)


def _scale_by_group_std(rewards: Tensor, moments: _GroupMoments, eps: float) -> Tensor:
    del rewards  # the per-group std is already in the moments
    return moments.std[moments.inverse] + eps  # [N]


def _scale_by_batch_std(rewards: Tensor, moments: _GroupMoments, eps: float) -> Tensor:
    del moments  # the batch std is taken over the raw rewards, not the group moments
    # One std for every sample keeps the relative weight of easy and hard prompts, which a
    # per-group std distorts (Dr. GRPO, arXiv 2503.20783). It is the std of the raw rewards, as in
    # TRL's scale_rewards="batch"; REINFORCE++-baseline (arXiv 2501.03262) uses the std of the
    # centred rewards instead. torch.std of one element is NaN, hence the guard.
    scored = rewards[~rewards.isnan()]  # [M] samples some reward function scored
    batch_std = scored.std() if scored.numel() > 1 else rewards.new_zeros(())  # []
    return batch_std + eps  # []


def _no_scaling(rewards: Tensor, moments: _GroupMoments, eps: float) -> Tensor:
    del moments, eps  # no divisor to build: the shared signature of ADVANTAGE_SCALINGS
    return rewards.new_ones(())  # []


# name -> divisor of the centred rewards, broadcastable to [N].
ADVANTAGE_SCALINGS: dict[str, Callable[[Tensor, _GroupMoments, float], Tensor]] = {
    "group": _scale_by_group_std,  # DeepSeekMath GRPO
    "batch": _scale_by_batch_std,  # one batch-wide std (TRL's scale_rewards="batch")
    "none": _no_scaling,  # Dr. GRPO
}


def group_advantages(rewards: Tensor, group_ids: Tensor, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Â = (r - mean of its group) / (divisor + eps), one value per completion.

    rewards:   [N] float, one scalar reward per completion; NaN = not scored (every reward function
               returned None): left out of its group's mean and std, advantage 0 (as TRL).
    group_ids: [N] long, equal ids = same prompt; any order, any values.
    scale:     "group" (per-group std, DeepSeekMath), "batch" (std of all N rewards) or
               "none" (no division, Dr. GRPO). Stds are unbiased (n - 1).
    eps:       keeps groups whose rewards barely differ from blowing up; unused by "none".
    Returns [N], same dtype as rewards. A group of one, or of equal rewards, gets exactly 0.
    """
    if scale not in ADVANTAGE_SCALINGS:
        raise ValueError(f"unknown advantage scale {scale!r}; valid: {sorted(ADVANTAGE_SCALINGS)}")
    moments = _group_moments(rewards, group_ids)
    divisor = ADVANTAGE_SCALINGS[scale](rewards, moments, eps)  # [N] or []
    # A divisor is 0 only with eps = 0 and no spread, where the centred reward is exactly 0:
    # dividing by 1 there gives the 0 such a sample deserves instead of 0/0 = NaN.
    divisor = torch.where(divisor == 0, 1.0, divisor)  # [N] or []
    return moments.centered / divisor  # [N]


def group_reward_stats(rewards: Tensor, group_ids: Tensor) -> dict[str, float]:
    """Per-batch reward-spread statistics for logging.

    frac_zero_std_groups:         fraction of groups whose rewards are all equal; they carry no
                                  learning signal (DAPO's dynamic sampling drops them).
    reward_std_within_group_mean: mean over groups of the unbiased within-group std.
    """
    moments = _group_moments(rewards, group_ids)
    if moments.std.numel() == 0:
        return {"frac_zero_std_groups": 0.0, "reward_std_within_group_mean": 0.0}
    return {
        "frac_zero_std_groups": moments.zero_spread.float().mean().item(),
        "reward_std_within_group_mean": moments.std.mean().item(),
    }


def discounted_token_advantages(advantages: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Spread each completion's terminal advantage over its tokens with discount γ.

    The reward arrives after the last token, so token t of a completion of length L receives
    γ^(L-1-t)·Â: the last token gets Â in full; γ = 1 gives every token Â (plain GRPO).

    advantages: [B] one advantage per completion.
    mask:       [B, T] 1 on completion tokens (bool, int or float), 0 on padding.
    Returns [B, T] in advantages' dtype, 0 where mask is 0.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    mask_f = mask.to(advantages.dtype)  # [B, T]
    # Completion tokens from t to the end, counted right to left: L - t on a contiguous
    # completion, and still "tokens left until the reward" if the mask starts after a prompt.
    tokens_left = mask_f.flip(-1).cumsum(-1).flip(-1)  # [B, T]
    # Clamp so padding gets exponent 0, not -1 (0^-1 = inf would make inf * 0 = NaN).
    exponent = (tokens_left - 1).clamp(min=0)  # [B, T]
    credit = torch.pow(gamma, exponent)  # [B, T]
    return advantages[:, None] * credit * mask_f  # [B, T]


# -- episodes: a forked episode is several rows and one member of its group --------------------------------
class EpisodeRows(NamedTuple):
    index: Tensor  # [N] long: each row's episode, 0..E-1 in the order of their first rows
    first: Tensor  # [E] long: each episode's first row


def episode_rows(rollouts: Rollouts) -> EpisodeRows | None:
    """Which rows are one episode (rows holding the same `Episode` object: an agent's forks through the
    gateway). None when every row is its own episode (single turn, tools=, an agent that never forked): then
    nothing is merged and every caller keeps its per-row path."""
    episodes = rollouts.episodes
    if not episodes:
        return None
    seen: dict[int, int] = {}
    index = [seen.setdefault(id(e), len(seen)) for e in episodes]  # the list holds every object alive
    if len(seen) == len(index):
        return None
    index_t = torch.tensor(index, dtype=torch.long)  # [N]
    rows = torch.arange(len(index))  # [N]
    first = torch.full((len(seen),), len(index), dtype=torch.long)  # [E]
    return EpisodeRows(index_t, first.scatter_reduce(0, index_t, rows, "amin"))


def per_episode(values: Tensor, rows: EpisodeRows) -> Tensor:
    """[N] → [E]: the value an episode's rows share; their mean where they differ (DAPO's overlong shaping
    reads each row's length). A shared value is taken as it is, so that equal episodes stay exactly equal."""
    e = rows.first.numel()
    zeros = values.new_zeros(e)  # [E]
    low = zeros.scatter_reduce(0, rows.index, values, "amin", include_self=False)  # [E]
    high = zeros.scatter_reduce(0, rows.index, values, "amax", include_self=False)  # [E]
    counts = torch.bincount(rows.index, minlength=e).to(values.dtype)  # [E]
    mean = zeros.index_add(0, rows.index, values) / counts  # [E]
    return torch.where(low == high, values[rows.first], mean)  # [E]


# -- estimators: (scored batch, algorithm settings) -> [N] or [N, T] ---------------------------------------
AdvantageEstimator = Callable[[ScoredRollouts, object], Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("group")
def group_estimator(scored: ScoredRollouts, algorithm) -> Tensor:
    """GRPO's: one scalar per completion from its group's rewards (`group_advantages`), each episode counted
    once (a forked episode's rows share its reward and its advantage)."""
    a = algorithm
    rewards, group_ids = scored.rewards, scored.rollouts.group_ids  # [N], [N]
    rows = episode_rows(scored.rollouts)
    if rows is None:
        return group_advantages(rewards, group_ids, a.advantage_scale, a.advantage_eps)  # [N]
    by_episode = group_advantages(
        per_episode(rewards, rows), group_ids[rows.first], a.advantage_scale, a.advantage_eps
    )  # [E]
    return by_episode[rows.index]  # [N]


@ADVANTAGE_ESTIMATORS.register("turn")
def turn_estimator(scored: ScoredRollouts, algorithm) -> Tensor:
    """Per-turn rewards with reward-to-go: DeepSeekMath's process supervision (arXiv 2402.03300 §4.1.3) with
    an agent's assistant turns as its steps. An episode's rewards are its turn rewards r_k (at turn k) and its
    episode reward at its last turn K (unless that reward is only the sum of its turn rewards). Each reward is
    normalised against all the rewards of its group, r̃ = (r - mean) / (std + eps) (algorithm.advantage_scale
    as for "group"); a token of turn k gets Σ r̃ over its episode's rewards at turns ≥ k. Without per-turn
    data (Rollouts.turn_ids unset: any runner but the gateway) this is "group", [N]. Returns [N, T]."""
    a, rollouts = algorithm, scored.rollouts
    if rollouts.turn_ids is None or rollouts.episodes is None:
        return group_estimator(scored, algorithm)  # [N]
    n = rollouts.completion_ids.shape[0]
    rows = episode_rows(rollouts) or EpisodeRows(torch.arange(n), torch.arange(n))
    episodes = [rollouts.episodes[i] for i in rows.first.tolist()]
    rewards = per_episode(scored.rewards, rows)  # [E]
    turns = rollouts.turn_ids * (rollouts.loss_mask > 0)  # [N, T] long: 0 where nothing was sampled
    last = torch.zeros(len(episodes), dtype=torch.long).scatter_reduce(
        0, rows.index, turns.max(-1).values, "amax"
    )  # [E]
    # every reward as (episode, turn, value): the per-turn ones, then the episode's own at its last turn
    events = [(k, t, r) for k, ep in enumerate(episodes) for t, r in sorted(ep.turn_rewards.items())]
    events += [
        (k, max(int(last[k]), 1), rewards[k].item())
        for k, ep in enumerate(episodes)
        if not ep.reward_is_turn_sum
    ]
    which = torch.tensor([k for k, _, _ in events], dtype=torch.long)  # [M]
    at = torch.tensor([t for _, t, _ in events], dtype=torch.long)  # [M]
    normalised = group_advantages(
        torch.tensor([r for _, _, r in events], dtype=rewards.dtype),
        rollouts.group_ids[rows.first][which],
        a.advantage_scale,
        a.advantage_eps,
    )  # [M], 0 for a dropped episode's NaN
    width = max(int(at.max()), int(turns.max())) + 1
    per_turn = rewards.new_zeros(len(episodes), width).index_put_((which, at), normalised, accumulate=True)
    to_go = per_turn.flip(-1).cumsum(-1).flip(-1)  # [E, K + 1]: Σ of the rewards at turns ≥ k
    to_go[:, 0] = 0.0  # turn 0: tokens no turn sampled
    return to_go[rows.index[:, None], turns]  # [N, T]


def estimate_advantages(scored: ScoredRollouts, algorithm, estimator: str | None = None) -> Tensor:
    """The registered estimator's advantages (default: algorithm.advantage_estimator, else "group"): [N], or
    [N, T] aligned with the completion columns."""
    estimator = estimator or getattr(algorithm, "advantage_estimator", "group")
    advantages = ADVANTAGE_ESTIMATORS[estimator](scored, algorithm)
    n, t = scored.rollouts.completion_ids.shape
    if tuple(advantages.shape) not in ((n,), (n, t)):
        raise ValueError(
            f"advantage estimator {estimator!r} returned shape {tuple(advantages.shape)}; it must return "
            f"[N] = ({n},) or [N, T] = ({n}, {t})"
        )
    return advantages


def per_row_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """One number per completion for metrics and samples: [N] as is; [N, T] averaged over the sampled
    tokens (loss_mask [N, T]; a row with none gets 0)."""
    if advantages.dim() == 1:
        return advantages  # [N]
    mask = loss_mask.to(advantages.dtype)  # [N, T]
    return (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
