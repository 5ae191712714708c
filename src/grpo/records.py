"""Typed records handed from one stage of the loop to the next.

N = completions in the step (P prompts × G), T = longest completion, Lp = longest prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptBatch:
    """P prompts drawn from the dataset for one step."""

    prompts: list  # the dataset's prompts as it gave them (text or chat messages), as reward functions receive them
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


@dataclass
class Rollouts:
    """What a RolloutEngine returns: N = len(prompts) × n completions, grouped by prompt."""

    prompt_index: torch.Tensor  # [N] long: which prompt of the batch each completion answers
    completion_ids: torch.Tensor  # [N, T] long, right-padded with pad_token_id
    completion_mask: torch.Tensor  # [N, T] float: 1 on generated tokens (eos/stop included)
    sampling_logprobs: torch.Tensor  # [N, T] float: log-prob of each token under the sampling distribution
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens before eos or a stop string

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1).long()  # [N]


@dataclass
class TrainBatch:
    """Everything the learner needs for one optimisation step; rows are completions."""

    input_ids: torch.Tensor  # [N, Lp + T] left-padded prompt then right-padded completion
    attention_mask: torch.Tensor  # [N, Lp + T]
    prompt_width: int  # Lp: completion tokens start at this column
    completion_mask: torch.Tensor  # [N, T] float, after mask_truncated_completions
    advantages: torch.Tensor  # [N, T] float, per-token (γ credit applied)
    group_ids: torch.Tensor  # [N] long
    ref_logprobs: torch.Tensor | None = None  # [N, T] when β > 0
    old_logprobs: torch.Tensor | None = None  # [N, T] π_old, filled in the first optimisation pass
    # [N, T] log-probs of the (older) policy that sampled the rollout; set only when it lags the
    # learner (async rollout), which turns on the importance correction
    behaviour_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def position_ids(self) -> torch.Tensor:
        # Left padding shifts prompts; positions count real tokens only, as generate() did.
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, L]

    def rows(self, index: slice) -> TrainBatch:
        """A micro-batch: the same record restricted to some rows."""
        pick = lambda t: None if t is None else t[index]
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
