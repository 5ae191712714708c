"""grpo: Group Relative Policy Optimization for causal language models.

from grpo import GRPOTrainer, GRPOConfig, SimplePromptDataset
"""

from grpo.config import GRPOConfig
from grpo.data import SimplePromptDataset
from grpo.rewards import REWARD_FUNCTIONS, resolve_reward, score_completions
from grpo.rewards.math import extract_answer, gsm8k_correctness, gsm8k_format
from grpo.train import GRPOTrainer

__all__ = [
    "REWARD_FUNCTIONS",
    "GRPOConfig",
    "GRPOTrainer",
    "SimplePromptDataset",
    "extract_answer",
    "gsm8k_correctness",
    "gsm8k_format",
    "resolve_reward",
    "score_completions",
]
__version__ = "0.1.0"
