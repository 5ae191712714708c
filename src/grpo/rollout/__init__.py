"""Rollout engines: prompt token ids in, sampled completions (ids, sampling log-probs, flags) out.

The seam is the `RolloutEngine` protocol; the learner never needs to know which engine ran.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

import torch

from grpo.batch import Rollouts, SamplingParams

log = logging.getLogger("grpo")


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """n completions for each prompt; completion i·n … i·n+n−1 answer prompt i."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive new policy weights; a colocated engine shares the learner's parameters and skips this."""


def build_engine(name: str, model, tokenizer, compile_decode: bool = False,
                 compute_dtype: torch.dtype | None = None) -> RolloutEngine:
    """`native` on a supported Llama-family model, else (or when asked) transformers `generate`. Both
    sample in `compute_dtype` (None: the weights' own dtype) from float32 master weights."""
    from grpo.native.decoder import unsupported_reason
    from grpo.rollout.hf_generate import TransformersEngine
    from grpo.rollout.native import NativeEngine

    engines = {"native": NativeEngine, "transformers": TransformersEngine}
    if name not in engines:
        raise ValueError(f"Unknown rollout engine '{name}'; available: {', '.join(engines)}.")
    if name == "native" and (reason := unsupported_reason(model)) is not None:
        log.info("Native engine: unsupported model (%s); using transformers generate.", reason)
        name = "transformers"
    if name == "native":
        return NativeEngine(model, tokenizer, compile_decode=compile_decode, compute_dtype=compute_dtype)
    return TransformersEngine(model, tokenizer, compute_dtype=compute_dtype)
