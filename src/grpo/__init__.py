"""grpo: Group Relative Policy Optimization for causal language models.

from grpo import GRPOTrainer, GRPOConfig, SimplePromptDataset
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo.config import GRPOConfig
    from grpo.data import SimplePromptDataset
    from grpo.rewards import REWARD_FUNCTIONS, resolve_reward, score_completions
    from grpo.rewards.math import extract_answer, gsm8k_correctness, gsm8k_format
    from grpo.run.lifecycle import TrainingStopped
    from grpo.trainer import GRPOTrainer

# The public names load on first use: `grpo --help` and `import grpo.config` then never import torch
# (the trainer's import chain does), which keeps the CLI's start-up and the config checks fast.
_HOMES = {
    "GRPOConfig": "grpo.config",
    "GRPOTrainer": "grpo.trainer",
    "REWARD_FUNCTIONS": "grpo.rewards",
    "SimplePromptDataset": "grpo.data",
    "TrainingStopped": "grpo.run.lifecycle",
    "extract_answer": "grpo.rewards.math",
    "gsm8k_correctness": "grpo.rewards.math",
    "gsm8k_format": "grpo.rewards.math",
    "resolve_reward": "grpo.rewards",
    "score_completions": "grpo.rewards",
}
__all__ = [
    "REWARD_FUNCTIONS",
    "GRPOConfig",
    "GRPOTrainer",
    "SimplePromptDataset",
    "TrainingStopped",
    "extract_answer",
    "gsm8k_correctness",
    "gsm8k_format",
    "resolve_reward",
    "score_completions",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
