"""Tasks: a dataset together with the rewards that score it and the split that evaluates it.

Switching the dataset to a task (`env.dataset=ifeval`, `--dataset gsm8k`, `--hf_path openai/gsm8k`) brings
the task's rewards, evaluation split and system prompt with it (`GRPOConfig` applies `task_settings`
unless the user set those keys too), so a switch never leaves GSM8K's reward scoring IFEval prompts.
A dataset that is not a task (a local file, another hub id) keeps the configured rewards; the columns
those rewards need are checked against it before any model loads (`check_reward_columns`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem step by step. End with the final answer on its own line as '#### <number>'."
)
IFEVAL_SYSTEM_PROMPT = (
    "Think about the instructions inside <think></think>, then give your full response inside "
    "<answer></answer>."
)


@dataclass(frozen=True)
class Task:
    name: str
    hub_path: str | None  # None: bundled with the package (grpo/assets/<name>/<split>.jsonl)
    hub_config: str | None
    fixed_split: str | None  # the hub dataset has one split only (google/IFEval: train)
    reward_funcs: tuple[str, ...]
    reward_weights: tuple[float, ...] | None
    eval_dataset: str
    system_prompt: str | None
    columns: tuple[str, ...]  # what its rows carry for the rewards and the evaluation

    def settings(self) -> dict[str, Any]:
        return {
            "algorithm.reward_funcs": list(self.reward_funcs),
            "algorithm.reward_weights": list(self.reward_weights) if self.reward_weights else None,
            "data.eval_dataset": self.eval_dataset,
            "data.system_prompt": self.system_prompt,
        }


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "tiny_math",
            None,
            None,
            None,
            ("gsm8k_correctness", "gsm8k_format"),
            (1.0, 0.1),
            "tiny_math:test",
            None,
            ("answer",),
        ),
        Task(
            "gsm8k",
            "openai/gsm8k",
            "main",
            None,
            ("gsm8k_correctness", "gsm8k_format"),
            (1.0, 0.2),
            "gsm8k:test",
            GSM8K_SYSTEM_PROMPT,
            ("answer",),
        ),
        Task(
            "ifeval",
            "google/IFEval",
            None,
            "train",
            ("torchrl_ifeval",),
            None,
            "ifeval",
            IFEVAL_SYSTEM_PROMPT,
            ("instruction_id_list", "kwargs"),
        ),
    )
}
HUB_TASKS = {t.hub_path.lower(): t for t in TASKS.values() if t.hub_path}


def find_task(spec: str | None) -> Task | None:
    """The task a dataset spec names (`gsm8k`, `gsm8k:test`, `openai/gsm8k`), or None."""
    if not spec:
        return None
    name = str(spec).partition(":")[0]
    return TASKS.get(name) or HUB_TASKS.get(name.lower())


def task_settings(spec: str | None) -> dict[str, Any]:
    task = find_task(spec)
    return task.settings() if task else {}


def task_of_rows(rows: list[dict[str, Any]]) -> Task | None:
    """The task whose columns the rows carry, for a local copy of a task's data (an IFEval .jsonl)."""
    if rows and all(c in rows[0] for c in TASKS["ifeval"].columns):
        return TASKS["ifeval"]
    return None


def required_columns(fn: Callable) -> tuple[str, ...]:
    """Dataset columns a reward function cannot do without: its keyword parameters after (prompts,
    completions) that have no default, or the names it lists in a `required_columns` attribute."""
    listed = getattr(fn, "required_columns", None)
    if listed is not None:
        return tuple(listed)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return ()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = positional[2:] + [p for p in params if p.kind == p.KEYWORD_ONLY]
    return tuple(p.name for p in named if p.default is p.empty)


# What the trainer hands every reward function besides the dataset's columns (TRL's contract, docs/trl.md).
SUPPLIED = frozenset({"completion_ids", "completion_truncated", "trainer_state", "log_metric", "log_extra"})


def missing_reward_columns(funcs: list[Callable], columns: set[str]) -> dict[str, list[str]]:
    """{reward name: [columns it needs that the dataset lacks]} for every reward that cannot run."""
    missing = {}
    for fn in funcs:
        lacking = [c for c in required_columns(fn) if c not in columns and c not in SUPPLIED]
        if lacking:
            missing[getattr(fn, "__name__", type(fn).__name__)] = lacking
    return missing
