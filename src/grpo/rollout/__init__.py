"""Rollout engines by name: `ENGINES` maps `generation.engine` to the `build` function of its module.

A new backend is one module under rollout/ with a class that fills `engine.RolloutEngine` and a
`build(model, tokenizer, *, compute_dtype, compile_decode, generation, seed)` function, plus one line
here. Entries are import paths so that listing the names (config choices) imports no backend.
"""

from __future__ import annotations

import torch

from grpo.plugins import Registry
from grpo.rollout.engine import RolloutEngine

__all__ = ["ENGINES", "RolloutEngine", "build_engine", "resolve_auto"]

ENGINES: Registry = Registry(
    "generation.engine",
    {
        "native": "grpo.rollout.native:build",  # falls back to transformers on a model it does not support
        "transformers": "grpo.rollout.transformers:build",
        "vllm": "grpo.rollout.vllm:build",  # in-process, or a server (generation.vllm_server_url)
        "auto": "grpo.rollout:build_auto",  # vllm on CUDA when installed, else native
    },
)


def build_engine(
    name: str,
    model,
    tokenizer,
    compile_decode: bool = False,
    compute_dtype: torch.dtype | None = None,
    generation=None,
    seed: int = 0,
) -> RolloutEngine:
    """The engine `name` sampling from `model`, in `compute_dtype` (None: the weights' own dtype) from
    float32 master weights (docs/performance.md has the measurements behind the choices)."""
    return ENGINES[name](
        model,
        tokenizer,
        compute_dtype=compute_dtype,
        compile_decode=compile_decode,
        generation=generation,
        seed=seed,
    )


def build_auto(model, tokenizer, **options) -> RolloutEngine:
    return build_engine(resolve_auto(next(model.parameters()).device), model, tokenizer, **options)


def resolve_auto(device: torch.device) -> str:
    """vLLM on CUDA when installed; native on a CPU, where it measured faster than vLLM-CPU
    (docs/performance.md)."""
    from grpo.rollout.vllm import vllm_available

    return "vllm" if device.type == "cuda" and vllm_available() else "native"
