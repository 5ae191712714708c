"""Reward functions, their registry, and the weighted combination the trainer logs and optimises.

A reward function has TRL's shape, so users can bring theirs:
`fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`, where `columns` are
the dataset's other fields, one list per field aligned with the samples, and `None` means "does not
apply to this sample". Functions must accept and ignore columns they do not use (`**kwargs`).
"""

import difflib

from grpo import plugins
from grpo.rewards.ifeval import check_instructions, ifeval_strict, torchrl_ifeval
from grpo.rewards.isolation import mark_named_by_path
from grpo.rewards.math import (
    extract_answer,
    gsm8k_correctness,
    gsm8k_format,
    math_correctness,
    math_equivalent,
    normalize_number,
    reference_answer,
)
from grpo.rewards.sandbox import code_tests, run_python
from grpo.rewards.schemes import REWARD_SCHEMES, SCHEME_FUNCTIONS
from grpo.rewards.scoring import (
    NonFiniteRewardError,
    RewardError,
    RewardFunction,
    RewardScores,
    RewardTimeoutError,
    reward_name,
    score_completions,
)

__all__ = [
    "REWARD_FUNCTIONS",
    "REWARD_SCHEMES",
    "CausalLMLikelihoodReward",
    "NonFiniteRewardError",
    "RewardError",
    "RewardScores",
    "RewardTimeoutError",
    "SequenceClassifierReward",
    "check_instructions",
    "code_tests",
    "expand_schemes",
    "extract_answer",
    "gsm8k_correctness",
    "gsm8k_format",
    "ifeval_strict",
    "math_correctness",
    "math_equivalent",
    "normalize_number",
    "reference_answer",
    "resolve_reward",
    "resolve_rewards",
    "reward_from_model",
    "reward_name",
    "run_python",
    "score_completions",
    "torchrl_ifeval",
]

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "gsm8k_correctness": gsm8k_correctness,
    "gsm8k_format": gsm8k_format,
    "math_correctness": math_correctness,
    "torchrl_ifeval": torchrl_ifeval,
    "ifeval_strict": ifeval_strict,
    "code_tests": code_tests,
    **SCHEME_FUNCTIONS,
}


# Rewards computed by a model load on first use, so the registry imports no model code (rewards and model
# share a floor; the policy's packed forward imports records, which the rewards also read).
_BY_MODEL = ("CausalLMLikelihoodReward", "SequenceClassifierReward", "reward_from_model")


def __getattr__(name: str):
    if name in _BY_MODEL:
        return plugins.load(f"grpo.rewards.model:{name}")
    raise AttributeError(f"module 'grpo.rewards' has no attribute {name!r}")


def expand_schemes(specs: list) -> list:
    """Reward specs with scheme names (`tunix_gsm8k`) replaced by the names of their functions."""
    return [
        name
        for spec in specs
        for name in (REWARD_SCHEMES[spec] if isinstance(spec, str) and spec in REWARD_SCHEMES else [spec])
    ]


def resolve_rewards(specs: list) -> list[RewardFunction]:
    """Resolve a list of reward specs (callables, names, scheme names, import paths) to functions."""
    return [resolve_reward(spec) for spec in expand_schemes(specs)]


def resolve_reward(spec: str | RewardFunction) -> RewardFunction:
    """A callable as is, a registered name (`"gsm8k_format"`), or an import path (`"my_pkg.rewards:fn"`)."""
    if callable(spec):
        return spec
    if ":" in spec:
        return _import_reward(spec)
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    known = [*REWARD_FUNCTIONS, *REWARD_SCHEMES]
    nearest = difflib.get_close_matches(spec, known, n=3)
    suggestion = f"did you mean {' or '.join(map(repr, nearest))}? " if nearest else ""
    raise ValueError(
        f"unknown reward function {spec!r}; {suggestion}registered: {', '.join(sorted(known))}; "
        "or give your own as an import path 'package.module:function'"
    )


def _import_reward(spec: str) -> RewardFunction:
    target = plugins.load(spec, "reward function", call=True)
    mark_named_by_path(target)
    return target
