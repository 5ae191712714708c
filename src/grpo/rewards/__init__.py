"""Reward functions, their registry, and the weighted combination the trainer logs and optimises.

A reward function has TRL's shape, so users can bring theirs:
`fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`, where `columns` are
the dataset's other fields, one list per field aligned with the samples, and `None` means "does not
apply to this sample". Functions must accept and ignore columns they do not use (`**kwargs`).
"""

import difflib
import functools
import importlib
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from math import isfinite, nan  # a plain `import math` would be shadowed by the grpo.rewards.math submodule

import torch

from grpo.rewards.math import (
    extract_answer,
    gsm8k_correctness,
    gsm8k_format,
    normalize_number,
    reference_answer,
)
from grpo.rewards.model import CausalLMLikelihoodReward, SequenceClassifierReward, reward_from_model

__all__ = [
    "REWARD_FUNCTIONS",
    "CausalLMLikelihoodReward",
    "RewardError",
    "RewardScores",
    "SequenceClassifierReward",
    "extract_answer",
    "gsm8k_correctness",
    "gsm8k_format",
    "normalize_number",
    "reference_answer",
    "resolve_reward",
    "reward_from_model",
    "reward_name",
    "score_completions",
]

RewardFunction = Callable[..., list[float | None]]

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "gsm8k_correctness": gsm8k_correctness,
    "gsm8k_format": gsm8k_format,
}

_PROMPT_CHARS_IN_ERRORS = 200


class RewardError(RuntimeError):
    """A reward function raised; the message names it and the original exception is chained."""


def resolve_reward(spec: str | RewardFunction) -> RewardFunction:
    """A callable as is, a registered name (`"gsm8k_format"`), or an import path (`"my_pkg.rewards:fn"`)."""
    if callable(spec):
        return spec
    if ":" in spec:
        return _import_reward(spec)
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    nearest = difflib.get_close_matches(spec, REWARD_FUNCTIONS, n=3)
    suggestion = f"did you mean {' or '.join(map(repr, nearest))}? " if nearest else ""
    raise ValueError(
        f"unknown reward function {spec!r}; {suggestion}registered: {', '.join(sorted(REWARD_FUNCTIONS))}; "
        "or give your own as an import path 'package.module:function'"
    )


def _import_reward(spec: str) -> RewardFunction:
    module_name, _, attribute_path = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except Exception as error:
        raise ImportError(f"cannot import module {module_name!r} for reward {spec!r}: {error!r}") from error
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attribute_path!r}")
        target = getattr(target, attribute)
    if not callable(target):
        raise TypeError(f"reward {spec!r} resolved to a {type(target).__name__}, which is not callable")
    return target


def reward_name(fn: RewardFunction) -> str:
    """The metric name of a reward function: its `__name__`, else its class name."""
    if isinstance(fn, functools.partial):
        return reward_name(fn.func)
    return getattr(fn, "__name__", None) or type(fn).__name__


@dataclass
class RewardScores:
    """Rewards of one batch of N completions under F functions."""

    per_function: torch.Tensor  # [N, F] float32, NaN where a function returned None
    names: list[str]  # [F] metric names, in the order of the columns of per_function
    total: torch.Tensor  # [N] Σ_f w_f·r_f over the functions that apply; 0.0 where none applies
    none_applicable: int  # samples on which every function returned None


def score_completions(
    funcs: list[RewardFunction],
    weights: list[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
) -> RewardScores:
    """Calls each function once on the whole batch, checks what it returns, and sums with weights.

    A None reward is skipped in the sum rather than counted as 0 (TRL's nansum), so a function that
    applies only to some samples does not drag the others down.
    """
    if not funcs:
        raise ValueError("score_completions needs at least one reward function")
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(funcs)} reward functions")
    _check_batch(prompts, completions, columns)
    names = [reward_name(fn) for fn in funcs]
    rows_by_function = [
        _call_reward(fn, name, prompts, completions, columns) for fn, name in zip(funcs, names, strict=True)
    ]
    per_function = torch.tensor(rows_by_function, dtype=torch.float32).T  # [N, F]
    weighted = per_function * torch.tensor(weights, dtype=torch.float32)  # [N, F]
    return RewardScores(
        per_function=per_function,
        names=names,
        total=torch.nansum(weighted, dim=1),  # [N]
        none_applicable=int(per_function.isnan().all(dim=1).sum()),
    )


def _check_batch(prompts: list[str], completions: list[str], columns: dict[str, list]) -> None:
    if len(completions) != len(prompts):
        raise ValueError(f"got {len(completions)} completions for {len(prompts)} prompts")
    for column, values in columns.items():
        if column in ("prompts", "completions"):
            raise ValueError(
                f"dataset column {column!r} clashes with the reward function argument of that name"
            )
        if len(values) != len(prompts):
            raise ValueError(f"column {column!r} has {len(values)} values for {len(prompts)} samples")


def _call_reward(
    fn: RewardFunction, name: str, prompts: list[str], completions: list[str], columns: dict[str, list]
) -> list[float]:
    try:
        rewards = fn(prompts=prompts, completions=completions, **columns)
    except Exception as error:
        raise RewardError(f"reward function {name!r} raised {type(error).__name__}: {error}") from error
    if not isinstance(rewards, list | tuple):
        raise TypeError(f"reward function {name!r} returned a {type(rewards).__name__}; expected a list")
    if len(rewards) != len(prompts):
        raise ValueError(f"reward function {name!r} returned {len(rewards)} rewards, expected {len(prompts)}")
    return [_checked_reward(reward, name, index, prompts[index]) for index, reward in enumerate(rewards)]


def _checked_reward(reward: object, name: str, index: int, prompt: str) -> float:
    if reward is None:
        return nan
    if not isinstance(reward, numbers.Real):
        raise TypeError(
            f"reward function {name!r} returned {reward!r} ({type(reward).__name__}) for sample {index}; "
            "expected a float, int, bool or None"
        )
    if not isfinite(reward):
        raise ValueError(
            f"reward function {name!r} returned {reward} for sample {index} "
            "(return None for 'not applicable'); "
            f"prompt: {prompt[:_PROMPT_CHARS_IN_ERRORS]!r}"
        )
    return float(reward)
