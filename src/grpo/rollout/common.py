"""What every engine shares: weights pushed in by name, and generation in chunks of prompts."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from grpo.records import Rollouts, SamplingParams


class ChunkedEngine:
    """Base of the engines: subclasses set `model` and `pad_id` and implement `_generate` on one chunk."""

    model: torch.nn.Module
    pad_id: int

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        chunk_prompts: int | None = None,
    ) -> Rollouts:
        chunk = chunk_prompts or len(prompt_token_ids)
        parts = [
            self._generate(prompt_token_ids[i : i + chunk], n, sampling)
            for i in range(0, len(prompt_token_ids), chunk)
        ]
        sizes = [len(prompt_token_ids[i : i + chunk]) for i in range(0, len(prompt_token_ids), chunk)]
        return concat_rollouts(parts, sizes, self.pad_id)

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        raise NotImplementedError


def concat_rollouts(parts: list[Rollouts], sizes: list[int], pad_id: int) -> Rollouts:
    """Rollouts of consecutive prompt ranges (sizes[i] prompts in part i) → one record; prompt indices
    offset to the whole batch, completions right-padded to the longest."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return Rollouts(
        prompt_index=torch.cat([p.prompt_index + o for p, o in zip(parts, offsets, strict=True)]),
        completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
        completion_mask=torch.cat([pad(p.completion_mask, 0.0) for p in parts]),
        sampling_logprobs=torch.cat([pad(p.sampling_logprobs, 0.0) for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
    )
