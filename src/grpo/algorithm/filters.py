"""DAPO's two batch-level tricks (Yu et al., arXiv 2503.14476), as pure functions plus one record.

- Overlong reward shaping (§3.4, eq. 13): a soft length penalty in the last `buffer` tokens before the
  generation limit, added to the reward.
- Dynamic sampling (§3.2): a group whose rewards are all equal has advantage 0 on every completion and
  adds nothing to the policy gradient; drop such groups and roll out more prompts until the batch holds
  P informative groups (bounded number of rounds). `ScoredRollouts`, `select_groups` and
  `concat_rounds` let the loop keep some groups of one rollout round and join several rounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.records import PromptBatch, Rollouts
from grpo.rewards import RewardScores

__all__ = ["ScoredRollouts", "concat_rounds", "informative_prompts", "overlong_penalty", "select_groups"]


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


def informative_prompts(rewards: Tensor, prompt_index: Tensor, num_prompts: int) -> Tensor:
    """[P] bool: whether the completions of each prompt have any reward spread (max > min).

    rewards [N], prompt_index [N] in 0..P-1. A prompt with fewer than two completions is not informative.
    NaN rewards (not scored) are ignored.
    """
    scored = ~rewards.isnan()  # [N]
    lo = torch.full((num_prompts,), float("inf")).scatter_reduce(
        0, prompt_index, rewards.float().where(scored, float("inf")), "amin"
    )  # [P]
    hi = torch.full((num_prompts,), float("-inf")).scatter_reduce(
        0, prompt_index, rewards.float().where(scored, float("-inf")), "amax"
    )  # [P]
    return hi > lo  # [P]


@dataclass
class ScoredRollouts:
    """One or more rollout rounds with their rewards: P prompts, N completions."""

    prompts: PromptBatch
    rollouts: Rollouts  # prompt_index points into prompts
    texts: list[str]  # [N] decoded completions
    scores: RewardScores  # per function, [N, F]
    rewards: Tensor  # [N] total reward after shaping: what advantages are computed from
    lag: int = 0  # learner steps between the weights that sampled these and now (Ray async rollout)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)


def select_groups(part: ScoredRollouts, keep: Tensor) -> ScoredRollouts:
    """The prompts where keep [P] is True, with their completions; prompt indices renumbered 0..K-1."""
    kept = keep.nonzero().flatten().tolist()
    new_index = torch.full((part.num_prompts,), -1, dtype=torch.long)
    new_index[kept] = torch.arange(len(kept))
    rows = keep[part.rollouts.prompt_index].nonzero().flatten()  # [M] completions of kept prompts
    p = part.prompts
    prompts = PromptBatch(
        prompts=[p.prompts[i] for i in kept],
        prompt_token_ids=[p.prompt_token_ids[i] for i in kept],
        columns={k: [v[i] for i in kept] for k, v in p.columns.items()},
        indices=[p.indices[i] for i in kept] if p.indices else [],
    )
    fields = {f.name: getattr(part.rollouts, f.name) for f in dataclasses.fields(part.rollouts)}
    picked = {name: value[rows] if isinstance(value, Tensor) else value for name, value in fields.items()}
    picked["prompt_index"] = new_index[part.rollouts.prompt_index[rows]]
    scores = part.scores
    return ScoredRollouts(
        prompts=prompts,
        rollouts=type(part.rollouts)(**picked),
        texts=[part.texts[i] for i in rows.tolist()],
        scores=RewardScores(
            per_function=scores.per_function[rows],
            names=scores.names,
            total=scores.total[rows],
            none_applicable=scores.none_applicable,
            skipped=scores.skipped,
        ),
        rewards=part.rewards[rows],
        lag=part.lag,
    )


def concat_rounds(parts: list[ScoredRollouts], pad_id: int) -> ScoredRollouts:
    """Join rounds into one batch: prompt indices offset, [N, T] tensors right-padded to the longest T
    (token ids with pad_id, masks and log-probs with 0)."""
    if len(parts) == 1:
        return parts[0]
    offsets = torch.tensor([0] + [q.num_prompts for q in parts[:-1]]).cumsum(0).tolist()
    columns = {k: [v for q in parts for v in q.prompts.columns[k]] for k in parts[0].prompts.columns}
    prompts = PromptBatch(
        prompts=[x for q in parts for x in q.prompts.prompts],
        prompt_token_ids=[x for q in parts for x in q.prompts.prompt_token_ids],
        columns=columns,
        indices=[x for q in parts for x in q.prompts.indices],
    )
    joined = {}
    for f in dataclasses.fields(parts[0].rollouts):
        values = [getattr(q.rollouts, f.name) for q in parts]
        if f.name == "prompt_index":
            joined[f.name] = torch.cat([v + off for v, off in zip(values, offsets, strict=True)])
        elif isinstance(values[0], Tensor) and values[0].dim() == 2:
            width = max(v.shape[1] for v in values)
            fill = pad_id if f.name == "completion_ids" else 0
            joined[f.name] = torch.cat(
                [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill) for v in values]
            )
        elif isinstance(values[0], Tensor):
            joined[f.name] = torch.cat(values)
        else:
            joined[f.name] = values[0]
    per_function = torch.cat([q.scores.per_function for q in parts])
    scores = RewardScores(
        per_function=per_function,
        names=parts[0].scores.names,
        total=torch.cat([q.scores.total for q in parts]),
        none_applicable=sum(q.scores.none_applicable for q in parts),
        skipped=sum(q.scores.skipped for q in parts),
    )
    return ScoredRollouts(
        prompts=prompts,
        rollouts=type(parts[0].rollouts)(**joined),
        texts=[t for q in parts for t in q.texts],
        scores=scores,
        rewards=torch.cat([q.rewards for q in parts]),
        lag=max(q.lag for q in parts),
    )


def truncate_prompts(part: ScoredRollouts, num_prompts: int) -> ScoredRollouts:
    """The first num_prompts prompts (DAPO fills the batch to exactly P groups)."""
    if part.num_prompts <= num_prompts:
        return part
    keep = torch.zeros(part.num_prompts, dtype=torch.bool)
    keep[:num_prompts] = True
    return select_groups(part, keep)
