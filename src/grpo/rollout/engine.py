"""The seam every rollout backend fills: `RolloutEngine`, plus the helpers the backends share.

An engine turns prompt token ids into sampled completions (ids, the sampler's log-probs, flags). Its
weights are either the learner's own parameters (colocated native and transformers engines: nothing to
sync) or its own copy (vLLM, a Ray actor's engine, the full copy FSDP2 needs): `needs_weight_sync` says
which, `sync_weights(policy)` pulls a policy's current weights and `load_weights` takes them pushed by
name. `exact_logprobs` and `sampler_differs` tell the loop what the sampling log-probs are worth.

Two ways to sample: `generate` (P prompts × n completions, the batched shared-prompt fast path) and
`continue_rows` (token in, token out: extend each given row of ids by one sampled continuation, what a
multi-turn episode calls once per turn for all its live episodes). The rollout source owns its engine and
calls `close` when the run ends (an engine may hold a weight folder, a server connection, a process).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from grpo.records import Rollouts, SamplingParams, concat_rollouts


class RolloutEngine(Protocol):
    # The sampling log-probs equal the learner's π_θ (same weights, kernels and precision) when nothing
    # filters the distribution: π_old then needs no forward pass.
    exact_logprobs: bool
    # The log-probs come from other kernels than the learner's (vLLM): the learner recomputes π_old and
    # corrects for the difference with importance weights.
    sampler_differs: bool
    needs_weight_sync: bool  # holds its own copy of the weights, which sync_weights must refresh

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        chunk_prompts: int | None = None,
    ) -> Rollouts:
        """n completions for each prompt, at most chunk_prompts prompts at a time (None: all at once);
        completion i·n … i·n+n−1 answer prompt i."""

    def continue_rows(self, rows: list[list[int]], sampling: SamplingParams) -> Rollouts:
        """Token in, token out: one sampled continuation of each row of ids (prompt and turns so far);
        result row i continues rows[i] (group_ids = i). Nothing given is re-tokenized."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """New weights pushed by (parameter name, full tensor), in the policy's naming."""

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Refresh the engine's own copy from `policy`; a no-op for an engine that samples with it."""

    def close(self) -> None:
        """Release what the engine holds outside the process's memory (weight folders, connections)."""


def generate_in_chunks(
    generate: Callable[[list[list[int]], int, SamplingParams], Rollouts],
    prompt_token_ids: list[list[int]],
    n: int,
    sampling: SamplingParams,
    chunk_prompts: int | None,
    pad_id: int,
) -> Rollouts:
    """`generate` over consecutive chunks of at most chunk_prompts prompts (bounding the KV cache), joined."""
    chunk = chunk_prompts or len(prompt_token_ids)
    chunks = [prompt_token_ids[i : i + chunk] for i in range(0, len(prompt_token_ids), chunk)]
    with torch.no_grad():
        parts = [generate(c, n, sampling) for c in chunks]
    return concat_rollouts(parts, [len(c) for c in chunks], pad_id)


def copy_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, tensor) pairs into the model's parameters of the same names."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in named_tensors:
            params[name].copy_(tensor)


def logprobs_match_policy(engine: RolloutEngine, sampling: SamplingParams) -> bool:
    """The engine's sampling log-probs are the learner's π_θ: exact kernels, and an unfiltered
    distribution."""
    return engine.exact_logprobs and not sampling.filtered
