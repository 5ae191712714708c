"""DAPO's two batch-level tricks (Yu et al., arXiv 2503.14476), as pure functions plus one record.

- Overlong reward shaping (§3.4, eq. 13): a soft length penalty in the last `buffer` tokens before the
  generation limit, added to the reward.
- Dynamic sampling (§3.2): a group whose rewards are all equal has advantage 0 on every completion and
  adds nothing to the policy gradient; drop such groups and roll out more prompts until the batch holds
  P informative groups (bounded number of rounds). `informative_prompts` says which groups to keep;
  records.select_groups and records.concat_rounds keep them and join the rounds (train.collect).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["informative_prompts", "overlong_penalty"]


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, in tokens; lengths [N] → reward offsets [N] (≤ 0).

        0                                  if L ≤ max_length − buffer
        penalty · ((max_length − buffer) − L) / buffer   if max_length − buffer < L ≤ max_length
        −penalty                            if L > max_length

    A completion cut off at the limit (L = max_length) gets the full −penalty; buffer = 0 switches it off.
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer >= max_length:
        raise ValueError(f"overlong buffer ({buffer}) must be smaller than the length limit ({max_length})")
    expected = max_length - buffer
    over = (expected - lengths.float()) / buffer  # [N] 0 at the start of the buffer, −1 at the limit
    shaped = torch.where(lengths.float() <= expected, torch.zeros_like(over), over)  # [N]
    return penalty * shaped.clamp(min=-1.0)  # [N]


def informative_prompts(rewards: Tensor, group_ids: Tensor, num_prompts: int) -> Tensor:
    """[P] bool: whether the completions of each prompt have any reward spread (max > min).

    rewards [N], group_ids [N] in 0..P-1. A prompt with fewer than two completions is not informative.
    NaN rewards (not scored) are ignored.
    """
    scored = ~rewards.isnan()  # [N]
    lo = torch.full((num_prompts,), float("inf")).scatter_reduce(
        0, group_ids, rewards.float().where(scored, float("inf")), "amin"
    )  # [P]
    hi = torch.full((num_prompts,), float("-inf")).scatter_reduce(
        0, group_ids, rewards.float().where(scored, float("-inf")), "amax"
    )  # [P]
    return hi > lo  # [P]
