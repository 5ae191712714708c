"""A step's sessions as Rollouts: every row of every episode, grouped by prompt (the agent runner's)."""

from __future__ import annotations

import dataclasses

import torch

from grpo.gateway.sessions import Session
from grpo.records import Episode, PromptBatch
from grpo.rollout.multi_turn import episode_rollouts
from grpo.rollout.weight_versions import with_versions


def session_rollouts(tokenizer, prompts: PromptBatch, sessions: list[Session], episodes: list[Episode]):
    """Every row of every session, grouped by prompt. A group's prompt is the token prefix all its rows
    share (their own prompts may differ: the agent writes them); the rest of a row's prompt is injected
    (loss_mask 0). An episode with no row (it never called the model) is one masked end-of-turn token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad
    prompt_ids = list(prompts.prompt_token_ids)
    rows: list[tuple[int, Episode, list[int], list[float], list[float]]] = []
    turns: list[list[int]] = []  # per row: the episode turn that sampled each id (0: none)
    stamps: list[list[int]] = []  # per row: the weight version of each id (Ray rollout actors)
    for i in range(len(prompts)):
        members = [(s, e) for s, e in zip(sessions, episodes, strict=True) if s.group == i]
        own = [r for s, _ in members for r in s.rows]
        if own:
            shared = min(r.prompt_len for r in own)
            for r in own[1:]:
                shared = next((k for k in range(shared) if r.ids[k] != own[0].ids[k]), shared)
            if shared == 0:
                raise ValueError(
                    "An agent's episodes of one prompt share no first token: they cannot form a group."
                )
            prompt_ids[i] = own[0].ids[:shared]
        start = len(prompt_ids[i])
        for s, e in members:
            if not s.rows:
                rows.append((i, e, [eos], [0.0], [0.0]))
                turns.append([0])
                stamps.append([-1])
            for r in s.rows:
                turns.append(r.turns_from(start) or [0])
                stamps.append(r.versions_from(start) or [-1])
                rows.append(
                    (
                        i,
                        e,
                        r.ids[start:] or [eos],
                        r.sampled[start:] or [0.0],
                        r.logprobs[start:] or [0.0],
                    )
                )
    rollouts = with_versions(episode_rollouts(rows, pad), stamps)
    turn_ids = torch.zeros_like(rollouts.completion_ids)  # [N, T]
    for k, row_turns in enumerate(turns):
        turn_ids[k, : len(row_turns)] = torch.tensor(row_turns, dtype=torch.long)
    rollouts = dataclasses.replace(rollouts, turn_ids=turn_ids)
    return dataclasses.replace(prompts, prompt_token_ids=prompt_ids), rollouts
