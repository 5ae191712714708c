"""Typed records handed from one stage of the loop to the next, and the few ways they are cut and joined.

    PromptBatch ──engine──▶ Rollouts ──rewards──▶ ScoredRollouts ──advantages──▶ TrainBatch ──▶ learner

P = prompts in the batch, G = completions per prompt, N = P × G completions, T = longest completion,
Lp = longest prompt. A group is the G completions of one prompt; `group_ids` [N] names it everywhere by
the index of its prompt in the PromptBatch.

A completion is everything after the prompt: in a multi-turn episode, the turns the policy sampled and
the tool or environment messages injected between them. `completion_mask` says which columns hold a
token (the model attends to them); `loss_mask` says which of those the policy sampled (the loss, KL,
entropy, importance weights and metrics read only these). Single-turn, the two are the same tensor.

Every per-row or per-token field is declared with `per_row()` / `per_token()`, and `take_rows`,
`trim_columns` and `concat_rollouts` carry every such field: a new field is one line here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

R = TypeVar("R")


def per_row(**kwargs) -> Any:
    """A field with one entry per row (completion): a [N, ...] tensor or a list of N."""
    return field(metadata={"axis": "row"}, **kwargs)


def per_token(**kwargs) -> Any:
    """A [N, T] field aligned with the completion columns."""
    return field(metadata={"axis": "token"}, **kwargs)


def per_position(**kwargs) -> Any:
    """A [N, Lp + T] field: prompt columns, then completion columns."""
    return field(metadata={"axis": "position"}, **kwargs)


def _axis_fields(record) -> list[tuple[str, str]]:
    return [(f.name, f.metadata["axis"]) for f in dataclasses.fields(record) if "axis" in f.metadata]


def _pick(value, index: slice | Tensor):
    if value is None or isinstance(value, Tensor):
        return None if value is None else value[index]
    if isinstance(value, dict):  # columns: one list per name
        return {k: _pick(v, index) for k, v in value.items()}
    if not value:  # an optional list left empty (PromptBatch.indices when nothing tracks them)
        return value
    if isinstance(index, slice):
        return value[index]
    return [value[i] for i in index.tolist()]


def _join(values: list):
    if all(v is None for v in values):
        return None
    if isinstance(values[0], Tensor):
        return torch.cat(values)
    if isinstance(values[0], dict):
        return {k: _join([v[k] for v in values]) for k in values[0]}
    return [x for v in values for x in v]


def take_rows(record: R, index: slice | Tensor) -> R:
    """The same record restricted to some rows (a slice, or a [M] index tensor); every per-row,
    per-token and per-position field follows."""
    done: dict[int, Any] = {}  # fields that alias one tensor (loss_mask = completion_mask) stay aliased
    changes = {}
    for name, _ in _axis_fields(record):
        value = getattr(record, name)
        if id(value) not in done:
            done[id(value)] = _pick(value, index)
        changes[name] = done[id(value)]
    return dataclasses.replace(record, **changes)


def join_rows(parts: list[R]) -> R:
    """Records of the same type, one after the other: every per-row field joined (tensors concatenated,
    lists and each list of a dict extended); every other field taken from the first part. For Rollouts,
    whose group ids and [N, T] columns need more, see concat_rollouts."""
    if len(parts) == 1:
        return parts[0]
    rows = {
        name: _join([getattr(p, name) for p in parts])
        for name, axis in _axis_fields(parts[0])
        if axis == "row"
    }
    return dataclasses.replace(parts[0], **rows)


def trim_columns(record: R, width: int, prompt_width: int = 0) -> R:
    """The first `width` completion columns of every per-token field (and prompt_width + width of every
    per-position field)."""
    done: dict[int, Any] = {}
    changes = {}
    for name, axis in _axis_fields(record):
        value = getattr(record, name)
        if value is None or axis == "row":
            continue
        if id(value) not in done:
            done[id(value)] = value[:, : (width if axis == "token" else prompt_width + width)]
        changes[name] = done[id(value)]
    return dataclasses.replace(record, **changes)


@dataclass
class Episode:
    """What one multi-turn episode did, beside its tokens (rollout/episodes.py)."""

    # the messages the episode added after the prompt, roles included: assistant turns (with their parsed
    # tool calls), tool results and environment messages
    messages: list[dict]
    env_reward: float | None = None  # the environment's own reward for the episode, if it gives one
    turns: int = 0  # assistant turns sampled
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)  # error kind → count
    # why it ended: "answer" (a turn without a tool call), "done" (the environment said so), or a cap:
    # "max_turns", "max_tokens", "turn_length" (a turn hit the per-turn token limit); "template" (the chat
    # template cannot render the next turn, e.g. Llama 3's on two calls in one turn)
    ended_by: str = "answer"
    environment: Any = None  # the environment instance (TRL reward functions receive it as `environments`)
    env_class: str | None = None  # its class name (which environment reward function scores it)
    # set: the episode's reward in place of the reward functions' total (an agent's own reward through the
    # gateway; a failed episode's 0, or NaN = dropped from its group's baseline)
    final_reward: float | None = None
    # rewards given for single assistant turns (turn number → reward, 1 = the first turn), e.g. posted to the
    # gateway's /v1/reward with a "turn"; the "turn" advantage estimator credits each from its turn back
    turn_rewards: dict[int, float] = field(default_factory=dict)
    reward_is_turn_sum: bool = False  # final_reward is the sum of turn_rewards (no episode reward was given)

    @property
    def truncated(self) -> bool:
        return self.ended_by in ("max_turns", "max_tokens", "turn_length")


@dataclass
class PromptBatch:
    """P prompts drawn from the dataset for one step."""

    # the dataset's prompts as it gave them (text or chat messages), as reward functions receive them
    prompts: list = per_row()
    prompt_token_ids: list[list[int]] = per_row()  # chat-templated and tokenized, no padding
    columns: dict[str, list] = per_row(default_factory=dict)  # other dataset fields, e.g. answer
    indices: list[int] = per_row(default_factory=list)  # dataset rows, for logs and resume checks

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

    group_ids: Tensor = per_row()  # [N] long: which prompt of the batch (0..P-1) each completion answers
    completion_ids: Tensor = per_token()  # [N, T] long, right-padded with pad_token_id
    completion_mask: Tensor = per_token()  # [N, T] float: 1 on every completion token (eos/stop included)
    sampling_logprobs: Tensor = per_token()  # [N, T] float: log-prob of each sampled token (0 if injected)
    truncated: Tensor = per_row()  # [N] bool: hit a length/turn cap before eos, a stop string or done
    # [N, T] float: 1 on the tokens the policy sampled, 0 on injected ones (tool results, environment
    # messages); None → the completion mask (single turn: every token was sampled)
    loss_mask: Tensor | None = per_token(default=None)
    # [N, T] long: which assistant turn of its episode sampled each token (1 = the first), 0 where none did;
    # set by runners that have per-turn rewards (the gateway), read by the "turn" advantage estimator
    turn_ids: Tensor | None = per_token(default=None)
    episodes: list[Episode] | None = per_row(default=None)  # multi-turn: what each episode did
    # a runner's per-completion data for reward functions (TRL rollout_func's extra keys), {column: value}
    extra_fields: list[dict] | None = per_row(default=None)
    # [N, T] long: the weight version (learner step) that sampled each token, -1 where none did; set by Ray
    # rollout actors, where an agent's episode may span weight updates (rollout/weight_versions.py)
    weight_version: Tensor | None = per_token(default=None)

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask

    @property
    def lengths(self) -> Tensor:
        """Completion tokens per row, injected ones included (the length caps count them)."""
        return self.completion_mask.sum(-1).long()  # [N]

    @property
    def sampled_lengths(self) -> Tensor:
        return self.loss_mask.sum(-1).long()  # [N]


@dataclass
class RewardScores:
    """Rewards of one batch of N completions under F functions."""

    per_function: torch.Tensor = per_row()  # [N, F] float32, NaN where a function returned None (or skipped)
    names: list[str]  # [F] metric names, in the order of the columns of per_function; unique (name, name_2)
    total: torch.Tensor = per_row()  # [N] Σ_f w_f·r_f over the functions that apply; 0.0 where none applies
    none_applicable: int  # samples on which every function returned None
    skipped: int = 0  # (function, sample) scores dropped under on_error="skip"
    logged: dict[str, float] = field(default_factory=dict)  # what the functions passed to log_metric


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

    input_ids: Tensor = per_position()  # [N, Lp + T] left-padded prompt then right-padded completion
    attention_mask: Tensor = per_position()  # [N, Lp + T]
    prompt_width: int  # Lp: completion tokens start at this column
    # [N, T] float: the completion tokens the forward computes (truncated rows zeroed under
    # mask_truncated_completions)
    completion_mask: Tensor = per_token()
    advantages: Tensor = per_token()  # [N, T] float, per-token (γ credit applied)
    group_ids: Tensor = per_row()  # [N] long
    # [N, T] float: the tokens the loss reads, those the policy sampled (⊆ completion_mask); None → the
    # completion mask
    loss_mask: Tensor | None = per_token(default=None)
    ref_logprobs: Tensor | None = per_token(default=None)  # [N, T] when β > 0
    # [N, T] π_old: the sampler's log-probs when they are the learner's own, else the learner's first pass
    old_logprobs: Tensor | None = per_token(default=None)
    # [N, T] log-probs of the sampler when it is not the learner (older weights or other kernels); set,
    # they turn on the importance correction
    behaviour_logprobs: Tensor | None = per_token(default=None)

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def position_ids(self) -> Tensor:
        # Left padding shifts prompts; positions count real tokens only, as generate() did.
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, L]

    def rows(self, index: slice) -> TrainBatch:
        """A micro-batch: the same record restricted to some rows."""
        return take_rows(self, index)

    def trim(self) -> TrainBatch:
        """Without the completion columns that are padding in every row."""
        longest = int(self.completion_mask.sum(-1).max().item()) if len(self) else 0
        return trim_columns(self, max(longest, 1), self.prompt_width)


# -- cutting and joining -------------------------------------------------------------------------------
def concat_rollouts(parts: list[Rollouts], num_prompts: list[int], pad_id: int) -> Rollouts:
    """Rollouts of consecutive prompt ranges (num_prompts[i] prompts in part i) → one record: group ids
    offset to the whole batch, [N, T] tensors right-padded to the longest T (ids with pad_id, the rest 0)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)
    offsets = torch.tensor([0, *num_prompts[:-1]]).cumsum(0).tolist()
    shared_mask = all(p.loss_mask is p.completion_mask for p in parts)
    joined = {}
    for name, axis in _axis_fields(parts[0]):
        values = [getattr(p, name) for p in parts]
        if name == "group_ids":
            joined[name] = torch.cat([v + o for v, o in zip(values, offsets, strict=True)])
        elif all(v is None for v in values) or (name == "loss_mask" and shared_mask):
            joined[name] = None
        elif any(v is None for v in values):
            raise ValueError(f"Rollouts to join disagree on whether they carry {name}.")
        elif axis == "token":
            fill = pad_id if name == "completion_ids" else 0.0
            joined[name] = torch.cat([F.pad(v, (0, width - v.shape[1]), value=fill) for v in values])
        elif isinstance(values[0], Tensor):
            joined[name] = torch.cat(values)
        else:
            joined[name] = [x for v in values for x in v]
    return Rollouts(**joined)


def select_groups(part: ScoredRollouts, keep: Tensor) -> ScoredRollouts:
    """The prompts where keep [P] is True, with their completions; group ids renumbered 0..K-1."""
    kept = keep.nonzero().flatten().tolist()
    renumber = torch.full((part.num_prompts,), -1, dtype=torch.long)  # [P]
    renumber[kept] = torch.arange(len(kept))
    r = part.rollouts
    rows = keep[r.group_ids].nonzero().flatten()  # [M] completions of kept prompts
    return ScoredRollouts(
        prompts=take_rows(part.prompts, torch.tensor(kept, dtype=torch.long)),
        rollouts=dataclasses.replace(take_rows(r, rows), group_ids=renumber[r.group_ids[rows]]),
        texts=[part.texts[i] for i in rows.tolist()],
        # What reward functions logged describes a whole scoring call, not the rows kept from it.
        scores=dataclasses.replace(take_rows(part.scores, rows), logged={}),
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
    scores = dataclasses.replace(
        join_rows([q.scores for q in parts]),
        none_applicable=sum(q.scores.none_applicable for q in parts),
        skipped=sum(q.scores.skipped for q in parts),
        logged={},
    )
    return ScoredRollouts(
        prompts=join_rows([q.prompts for q in parts]),
        rollouts=concat_rollouts([q.rollouts for q in parts], [q.num_prompts for q in parts], pad_id),
        texts=[t for q in parts for t in q.texts],
        scores=scores,
        rewards=torch.cat([q.rewards for q in parts]),
        lag=max(q.lag for q in parts),
    )
