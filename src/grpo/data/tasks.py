"""Tasks: a dataset together with the rewards that score it, the split that evaluates it, and how an
evaluation scores a completion. One `TASKS` entry is the whole of a task.

Switching the dataset to a task (`env.dataset=ifeval`, `--dataset gsm8k`, `--hf_path openai/gsm8k`) brings
the task's rewards, evaluation split and system prompt with it (`GRPOConfig` applies `task_settings`
unless the user set those keys too), so a switch never leaves GSM8K's reward scoring IFEval prompts.
A dataset that is not a task (a local file, another hub id) keeps the configured rewards; the columns
those rewards need are checked against it before any model loads (`missing_reward_columns`), and a local
copy of a task's data is recognised by its columns (`task_of_rows`). Evaluation scores rows with the scorer
of the task whose columns they carry (`scorer_for_rows`).

A new task: one `Task(...)` in TASKS, with a `Scorer` (an existing one, or a class with `columns`,
`score` and `summary`), plus a preset in grpo/configs/ if it should have one.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpo.rewards.ifeval import IFEvalScore, check_instructions
from grpo.rewards.math import extract_answer, gsm8k_correctness

GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem step by step. End with the final answer on its own line as '#### <number>'."
)
IFEVAL_SYSTEM_PROMPT = (
    "Think about the instructions inside <think></think>, then give your full response inside "
    "<answer></answer>."
)


# -- evaluation scorers ------------------------------------------------------------------------------


@dataclass
class RowScore:
    """One evaluation row's k completions, scored."""

    scores: list[float]  # per completion, 1.0 = correct
    record: dict[str, Any] = field(default_factory=dict)  # shown beside the completions in the dump
    majority_correct: bool | None = None  # maj@k: is the most common answer a correct one (None: no vote)
    detail: Any = None  # what `Scorer.summary` aggregates


class Scorer(Protocol):
    """How an evaluation scores completions against one row (evaluation.evaluate)."""

    columns: tuple[str, ...]  # the row columns it reads (rows without them cannot be scored)

    def score(self, row: dict[str, Any], prompt: str, completions: list[str]) -> RowScore: ...

    def summary(self, details: list[Any]) -> dict[str, float]:
        """Task-specific accuracies over all rows, from their RowScore.detail."""
        ...


class AnswerScorer:
    """The GSM8K rule (final number equals the reference's `#### n`), the check the training reward
    gsm8k_correctness makes, so "accuracy" during and after training means one thing."""

    columns = ("answer",)

    def score(self, row: dict[str, Any], prompt: str, completions: list[str]) -> RowScore:
        k = len(completions)
        correct = gsm8k_correctness([prompt] * k, completions, answer=[row["answer"]] * k)
        scores = [float(s or 0.0) for s in correct]
        return RowScore(scores, {"answer": row["answer"]}, _majority_correct(completions, scores))

    def summary(self, details: list[Any]) -> dict[str, float]:
        del details  # accuracy and majority vote are all an answer task reports
        return {}


class IFEvalScorer:
    """IFEval's checks of the row's instructions: accuracy is prompt-level strict, and the four IFEval
    accuracies are reported beside it; no majority vote (responses have no single answer)."""

    columns = ("instruction_id_list",)

    def score(self, row: dict[str, Any], prompt: str, completions: list[str]) -> RowScore:
        ids = row["instruction_id_list"]
        checks = [check_instructions(text, ids, row.get("kwargs"), prompt) for text in completions]
        record = {
            "instruction_id_list": ids,
            "strict": [c.instruction_strict for c in checks],
            "loose": [c.instruction_loose for c in checks],
        }
        return RowScore([float(c.prompt_strict) for c in checks], record, detail=checks)

    def summary(self, details: list[list[IFEvalScore]]) -> dict[str, float]:
        """IFEval's four numbers over all samples: prompt-level means, instruction-level pooled."""
        flat = [c for row in details for c in row]
        strict = [x for c in flat for x in c.instruction_strict]
        loose = [x for c in flat for x in c.instruction_loose]
        return {
            "prompt_level_strict_acc": sum(c.prompt_strict for c in flat) / len(flat),
            "prompt_level_loose_acc": sum(c.prompt_loose for c in flat) / len(flat),
            "inst_level_strict_acc": sum(strict) / max(len(strict), 1),
            "inst_level_loose_acc": sum(loose) / max(len(loose), 1),
        }


def _majority_correct(texts: list[str], scores: list[float]) -> bool:
    """Is the most common extracted answer a correct one? (Ties: the first seen wins.)"""
    answers = [extract_answer(t) for t in texts]
    counted = Counter(a for a in answers if a is not None)
    if not counted:
        return False
    winner = counted.most_common(1)[0][0]
    return any(s > 0 for a, s in zip(answers, scores, strict=True) if a == winner)


ANSWER_SCORER, IFEVAL_SCORER = AnswerScorer(), IFEvalScorer()


# -- the registry ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    name: str
    # Where its rows come from: None = bundled with the package (grpo/assets/<name>/<split>.jsonl), else a
    # dataset spec as `load_rows` reads it (a hub id, a local folder or file; "{split}" becomes the split).
    source: str | None
    reward_funcs: tuple[str, ...]
    reward_weights: tuple[float, ...] | None
    eval_dataset: str
    scorer: Scorer
    columns: tuple[str, ...]  # what its rows carry for the rewards and the evaluation
    system_prompt: str | None = None
    hub_config: str | None = None  # the hub dataset's config name (openai/gsm8k: main)
    fixed_split: str | None = None  # the dataset has one split only (google/IFEval: train)

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
            name="tiny_math",
            source=None,
            reward_funcs=("gsm8k_correctness", "gsm8k_format"),
            reward_weights=(1.0, 0.1),
            eval_dataset="tiny_math:test",
            scorer=ANSWER_SCORER,
            columns=("answer",),
        ),
        Task(
            name="tiny_tools",  # answered with the calculator tool in the loop (configs/tiny_tools.yaml)
            source=None,
            reward_funcs=("gsm8k_correctness", "gsm8k_format"),
            reward_weights=(1.0, 0.1),
            eval_dataset="tiny_tools:test",
            scorer=ANSWER_SCORER,
            columns=("answer",),
        ),
        Task(
            name="gsm8k",
            source="openai/gsm8k",
            hub_config="main",
            reward_funcs=("gsm8k_correctness", "gsm8k_format"),
            reward_weights=(1.0, 0.2),
            eval_dataset="gsm8k:test",
            scorer=ANSWER_SCORER,
            columns=("answer",),
            system_prompt=GSM8K_SYSTEM_PROMPT,
        ),
        Task(
            name="ifeval",
            source="google/IFEval",
            fixed_split="train",
            reward_funcs=("torchrl_ifeval",),
            reward_weights=None,
            eval_dataset="ifeval",
            scorer=IFEVAL_SCORER,
            columns=("instruction_id_list", "kwargs"),
            system_prompt=IFEVAL_SYSTEM_PROMPT,
        ),
    )
}


def find_task(spec: str | None) -> Task | None:
    """The task a dataset spec names (`gsm8k`, `gsm8k:test`, `openai/gsm8k`), or None."""
    if not spec:
        return None
    name = str(spec).partition(":")[0]
    by_source = {t.source.lower(): t for t in TASKS.values() if t.source}
    return TASKS.get(name) or by_source.get(name.lower())


def task_settings(spec: str | None) -> dict[str, Any]:
    task = find_task(spec)
    return task.settings() if task else {}


def _fitting(columns: Callable[[Task], tuple[str, ...]], rows: list[dict[str, Any]]) -> list[Task]:
    """Tasks whose `columns(task)` the rows carry, the most specific (most task columns) first."""
    fits = [t for t in TASKS.values() if rows and all(c in rows[0] for c in columns(t))]
    return sorted(fits, key=lambda t: -len(t.columns))


def task_of_rows(rows: list[dict[str, Any]]) -> Task | None:
    """The task whose columns the rows carry, for a local copy of a task's data (an IFEval .jsonl); None
    when no task, or several equally specific ones (tiny_math, tiny_tools and gsm8k share `answer`), fit."""
    fits = _fitting(lambda t: t.columns, rows)
    if not fits or (len(fits) > 1 and len(fits[1].columns) == len(fits[0].columns)):
        return None
    return fits[0]


def scorer_for_rows(rows: list[dict[str, Any]]) -> Scorer:
    """The evaluation scorer of the most specific task whose scorer can read the rows."""
    fits = _fitting(lambda t: t.scorer.columns, rows)
    if not fits:
        needs = " or ".join(
            f"{', '.join(s.columns)} ({', '.join(t.name for t in TASKS.values() if t.scorer is s)})"
            for s in {id(t.scorer): t.scorer for t in TASKS.values()}.values()
        )
        raise ValueError(
            f"Evaluation cannot score these rows: they need the columns of one of the tasks: {needs} "
            f"(the rows have {', '.join(rows[0]) if rows else 'none'})."
        )
    return fits[0].scorer


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


# What the trainer hands every reward function besides the dataset's columns (TRL's contract, docs/trl.md;
# multi-turn episodes add their environments, their own rewards and the class that gave them).
SUPPLIED = frozenset(
    {"completion_ids", "completion_truncated", "trainer_state", "log_metric", "log_extra", "environments",
     "env_reward", "env_class"}
)  # fmt: skip
# Names a dataset column cannot take: the trainer's own arguments would be replaced by the data's.
RESERVED_COLUMNS = SUPPLIED | {"prompts", "completions"}


def reserved_column_message(source: str, columns: set[str]) -> str | None:
    """Why the dataset's columns cannot reach reward functions under their names, or None. Refused rather
    than renamed behind the user's back: a reward asking for `completion_ids` must get the sampled ids, and
    a reward written for the data's own column would silently read the trainer's instead."""
    clash = sorted(columns & RESERVED_COLUMNS)
    if not clash:
        return None
    return (
        f"The dataset ({source}) has a column named {', '.join(map(repr, clash))}: reward functions receive "
        f"that name from the trainer ({', '.join(sorted(RESERVED_COLUMNS))}), so the column would be "
        f"hidden or would replace the trainer's value. Rename the column (e.g. 'data_{clash[0]}')."
    )


def missing_reward_columns(funcs: list[Callable], columns: set[str]) -> dict[str, list[str]]:
    """{reward name: [columns it needs that the dataset lacks]} for every reward that cannot run."""
    missing = {}
    for fn in funcs:
        lacking = [c for c in required_columns(fn) if c not in columns and c not in SUPPLIED]
        if lacking:
            missing[getattr(fn, "__name__", type(fn).__name__)] = lacking
    return missing
