"""Typed records handed from one stage of the loop to the next, and the few ways they are cut and joined.

    PromptBatch ──engine──▶ Rollouts ──rewards──▶ ScoredRollouts ──advantages──▶ TrainBatch ──▶ learner

P = prompts in the batch, G = completions per prompt, N = P × G completions, T = longest completion,
Lp = longest prompt. A group is the G completions of one prompt; `group_ids` [N] names it everywhere by
the index of its prompt in the PromptBatch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.algorithm.advantages import discounted_token_advantages
from grpo.algorithm.loss import apply_truncation_mask

if TYPE_CHECKING:  # grpo.rewards imports the model code, which reads these records
    from grpo.rewards import RewardScores


@dataclass
class PromptBatch:
    """P prompts drawn from the dataset for one step."""

    # the dataset's prompts as it gave them (text or chat messages), as reward functions receive them
    prompts: list
    prompt_token_ids: list[list[int]]  # chat-templated and tokenized, no padding
    columns: dict[str, list] = field(default_factory=dict)  # other dataset fields, e.g. answer
    indices: list[int] = field(default_factory=list)  # dataset rows, for logs and resume checks

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False
    stop_strings: list[str] = field(default_factory=list)

    @property
    def filtered(self) -> bool:
        """The sampling distribution is not the model's own (greedy, top-k or top-p cut it)."""
        return self.greedy or self.top_k > 0 or self.top_p < 1.0


@dataclass
class Rollouts:
    """What a RolloutEngine returns: N = P × G completions, grouped by prompt."""

    group_ids: Tensor  # [N] long: which prompt of the batch (0..P-1) each completion answers
    completion_ids: Tensor  # [N, T] long, right-padded with pad_token_id
    completion_mask: Tensor  # [N, T] float: 1 on generated tokens (eos/stop included)
    sampling_logprobs: Tensor  # [N, T] float: log-prob of each token under the sampling distribution
    truncated: Tensor  # [N] bool: hit max_new_tokens before eos or a stop string

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(-1).long()  # [N]


@dataclass
class ScoredRollouts:
    """One or more rollout rounds with their rewards: P prompts, N completions."""

    prompts: PromptBatch
    rollouts: Rollouts  # group_ids index prompts
    texts: list[str]  # [N] decoded completions
    scores: RewardScores  # per function, [N, F]
    rewards: Tensor  # [N] total reward after shaping: what advantages are computed from
    lag: int = 0  # learner steps between the weights that sampled these and now (async rollout)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)


@dataclass
class TrainBatch:
    """Everything the learner needs for one optimisation step; rows are completions."""

    input_ids: Tensor  # [N, Lp + T] left-padded prompt then right-padded completion
    attention_mask: Tensor  # [N, Lp + T]
    prompt_width: int  # Lp: completion tokens start at this column
    completion_mask: Tensor  # [N, T] float, after mask_truncated_completions
    advantages: Tensor  # [N, T] float, per-token (γ credit applied)
    group_ids: Tensor  # [N] long
    ref_logprobs: Tensor | None = None  # [N, T] when β > 0
    # [N, T] π_old: the sampler's log-probs when they are the learner's own, else the learner's first pass
    old_logprobs: Tensor | None = None
    # [N, T] log-probs of the sampler when it is not the learner (older weights or other kernels); set,
    # they turn on the importance correction
    behaviour_logprobs: Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def position_ids(self) -> Tensor:
        # Left padding shifts prompts; positions count real tokens only, as generate() did.
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, L]

    def rows(self, index: slice) -> TrainBatch:
        """A micro-batch: the same record restricted to some rows."""

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index]

        return TrainBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            prompt_width=self.prompt_width,
            completion_mask=self.completion_mask[index],
            advantages=self.advantages[index],
            group_ids=self.group_ids[index],
            ref_logprobs=pick(self.ref_logprobs),
            old_logprobs=pick(self.old_logprobs),
            behaviour_logprobs=pick(self.behaviour_logprobs),
        )


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
    """Left-padded prompt | right-padded completion rows, with per-token advantages ([N] → [N, T], discount
    γ) and the completion mask (truncated completions masked out when mask_truncated, DAPO). old_logprobs /
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
    if mask_truncated:
        mask = apply_truncation_mask(mask, rollouts.truncated)
    return TrainBatch(
        input_ids=torch.cat([prompt_ids, rollouts.completion_ids], dim=1),  # [N, Lp + T]
        attention_mask=torch.cat([prompt_mask, rollouts.completion_mask.long()], dim=1),
        prompt_width=width,
        completion_mask=mask,
        advantages=discounted_token_advantages(advantages, mask, gamma),  # [N, T]
        group_ids=rollouts.group_ids,
        old_logprobs=old_logprobs,
        behaviour_logprobs=behaviour_logprobs,
    )


# -- cutting and joining -------------------------------------------------------------------------------
def concat_rollouts(parts: list[Rollouts], num_prompts: list[int], pad_id: int) -> Rollouts:
    """Rollouts of consecutive prompt ranges (num_prompts[i] prompts in part i) → one record: group ids
    offset to the whole batch, [N, T] tensors right-padded to the longest T (ids with pad_id, the rest 0)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)
    offsets = torch.tensor([0, *num_prompts[:-1]]).cumsum(0).tolist()

    def cat(name: str, fill: float = 0.0) -> Tensor:
        return torch.cat(
            [F.pad(getattr(p, name), (0, width - p.completion_ids.shape[1]), value=fill) for p in parts]
        )

    return Rollouts(
        group_ids=torch.cat([p.group_ids + o for p, o in zip(parts, offsets, strict=True)]),
        completion_ids=cat("completion_ids", pad_id),
        completion_mask=cat("completion_mask"),
        sampling_logprobs=cat("sampling_logprobs"),
        truncated=torch.cat([p.truncated for p in parts]),
    )


def select_groups(part: ScoredRollouts, keep: Tensor) -> ScoredRollouts:
    """The prompts where keep [P] is True, with their completions; group ids renumbered 0..K-1."""
    kept = keep.nonzero().flatten().tolist()
    renumber = torch.full((part.num_prompts,), -1, dtype=torch.long)  # [P]
    renumber[kept] = torch.arange(len(kept))
    r = part.rollouts
    rows = keep[r.group_ids].nonzero().flatten()  # [M] completions of kept prompts
    p = part.prompts
    return ScoredRollouts(
        prompts=PromptBatch(
            prompts=[p.prompts[i] for i in kept],
            prompt_token_ids=[p.prompt_token_ids[i] for i in kept],
            columns={k: [v[i] for i in kept] for k, v in p.columns.items()},
            indices=[p.indices[i] for i in kept] if p.indices else [],
        ),
        rollouts=Rollouts(
            group_ids=renumber[r.group_ids[rows]],
            completion_ids=r.completion_ids[rows],
            completion_mask=r.completion_mask[rows],
            sampling_logprobs=r.sampling_logprobs[rows],
            truncated=r.truncated[rows],
        ),
        texts=[part.texts[i] for i in rows.tolist()],
        # What reward functions logged describes a whole scoring call, not the rows kept from it.
        scores=dataclasses.replace(
            part.scores, per_function=part.scores.per_function[rows], total=part.scores.total[rows], logged={}
        ),
        rewards=part.rewards[rows],
        lag=part.lag,
    )


def first_groups(part: ScoredRollouts, num_prompts: int) -> ScoredRollouts:
    """The first num_prompts prompts and their completions (DAPO fills the batch to exactly P groups)."""
    if part.num_prompts <= num_prompts:
        return part
    keep = torch.zeros(part.num_prompts, dtype=torch.bool)
    keep[:num_prompts] = True
    return select_groups(part, keep)


def concat_rounds(parts: list[ScoredRollouts], pad_id: int) -> ScoredRollouts:
    """Several rollout rounds as one batch (prompts in order, group ids offset, completions padded)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0].prompts
    prompts = PromptBatch(
        prompts=[x for q in parts for x in q.prompts.prompts],
        prompt_token_ids=[x for q in parts for x in q.prompts.prompt_token_ids],
        columns={k: [v for q in parts for v in q.prompts.columns[k]] for k in first.columns},
        indices=[x for q in parts for x in q.prompts.indices],
    )
    scores = dataclasses.replace(
        parts[0].scores,
        per_function=torch.cat([q.scores.per_function for q in parts]),
        total=torch.cat([q.scores.total for q in parts]),
        none_applicable=sum(q.scores.none_applicable for q in parts),
        skipped=sum(q.scores.skipped for q in parts),
        logged={},
    )
    return ScoredRollouts(
        prompts=prompts,
        rollouts=concat_rollouts([q.rollouts for q in parts], [q.num_prompts for q in parts], pad_id),
        texts=[t for q in parts for t in q.texts],
        scores=scores,
        rewards=torch.cat([q.rewards for q in parts]),
        lag=max(q.lag for q in parts),
    )
