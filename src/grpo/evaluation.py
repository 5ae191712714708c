"""Held-out accuracy: greedy pass@1, and pass@k / maj@k from k samples per prompt.

What "correct" means is the task's: each row is scored by the `Scorer` of its task (data/tasks.py; the
GSM8K final-number rule for rows with an answer, IFEval's instruction checks for IFEval rows), which may
add its own accuracies (IFEval's four). Rows with a `source` (or task/category/subject/level/type) column
also get one accuracy per value, and every accuracy has a 95% bootstrap interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.algorithm.advantages import episode_rows
from grpo.data import PromptFormatter, make_prompt_batch, prompt_text
from grpo.data.tasks import Scorer, scorer_for_rows
from grpo.records import Rollouts, SamplingParams, take_rows
from grpo.rollout import RolloutEngine
from grpo.rollout.episodes import SingleTurn, answer_texts

SOURCE_COLUMNS = ("source", "task", "category", "subject", "level", "type")


@dataclass
class EvalResult:
    accuracy: float  # greedy pass@1 (or mean per-sample accuracy when sampling)
    n: int
    k: int = 1
    pass_at_k: float | None = None
    maj_at_k: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # CI, per-source and the scorer's accuracies

    def as_dict(self) -> dict[str, Any]:
        out = {"accuracy": self.accuracy, "n": self.n, "k": self.k}
        if self.k > 1:
            out.update({f"pass@{self.k}": self.pass_at_k, f"maj@{self.k}": self.maj_at_k})
        return {**out, **self.extra}


class EngineSampler:
    """An engine (and the episodes to run with it) seen as a source's `sample`."""

    def __init__(self, engine: RolloutEngine, episodes=None):
        self.engine, self.episodes = engine, episodes or SingleTurn()

    def sample(self, prompts, n: int, sampling: SamplingParams):
        return self.episodes.run(self.engine, prompts, n, sampling)


def evaluate(
    sampler,
    formatter: PromptFormatter,
    rows: list[dict[str, Any]],
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    k: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_strings: list[str] | None = None,
    scorer: Scorer | None = None,
    progress: Callable[[int], object] | None = None,
) -> EvalResult:
    """Generate k completions per row (greedy when k == 1) and score them with `scorer` (default: the
    scorer of the task whose columns the rows carry, `scorer_for_rows`). `sampler` is a rollout source
    (its `sample`: the run's own engine and episodes, tools included) or a bare engine (one turn).
    `progress(n)` hears of every n rows done (a progress bar's update)."""
    if not rows:
        raise ValueError("Evaluation needs at least one row.")
    scorer = scorer or scorer_for_rows(rows)
    missing = [c for c in scorer.columns if c not in rows[0]]
    if missing:
        raise ValueError(f"Evaluation needs the column(s) {', '.join(missing)} to score completions.")
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=k == 1,
        stop_strings=stop_strings or [],
    )
    correct: list[list[float]] = []
    votes: list[bool | None] = []
    details: list[Any] = []
    records: list[dict[str, Any]] = []
    tokenizer = formatter.tokenizer
    if not hasattr(sampler, "sample"):
        sampler = EngineSampler(sampler)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = make_prompt_batch(list(range(start, start + len(chunk))), chunk, formatter)
        _, rollouts = sampler.sample(prompts, k, sampling)
        rollouts = one_row_per_episode(rollouts)
        texts = answer_texts(rollouts, tokenizer)
        for i, row in enumerate(chunk):
            prompt, row_texts = prompt_text(row["prompt"]), texts[i * k : (i + 1) * k]
            scored = scorer.score(row, prompt, row_texts)
            record = {"prompt": prompt, "completions": row_texts, **scored.record, "correct": scored.scores}
            if rollouts.episodes is not None:
                episodes = rollouts.episodes[i * k : (i + 1) * k]
                record["tool_calls"] = [e.tool_calls for e in episodes]
                record["messages"] = [e.messages for e in episodes]
            record.update({c: row[c] for c in SOURCE_COLUMNS if c in row})
            correct.append(scored.scores)
            votes.append(scored.majority_correct)
            details.append(scored.detail)
            records.append(record)
        if progress is not None:
            progress(len(chunk))
    per_prompt = [sum(r) / len(r) for r in correct]
    result = EvalResult(accuracy=sum(per_prompt) / len(rows), n=len(rows), k=k, records=records)
    if records and "tool_calls" in records[0]:
        calls = [c for r in records for c in r["tool_calls"]]
        result.extra["tool_call_rate"] = sum(c > 0 for c in calls) / len(calls)
    lo, hi = bootstrap_interval(per_prompt)
    result.extra.update({"accuracy_ci_low": lo, "accuracy_ci_high": hi})
    result.extra.update(_by_source(rows, per_prompt))
    result.extra.update(scorer.summary(details))
    if k > 1:
        result.pass_at_k = sum(max(r) for r in correct) / len(rows)
        result.maj_at_k = None if None in votes else sum(votes) / len(rows)
    return result


def one_row_per_episode(rollouts: Rollouts) -> Rollouts:
    """An agent's episode that forked through the gateway is several rows (one Episode): an evaluation scores
    the episode once, so k rows per prompt stay k episodes (its answer is the Episode's, whichever row)."""
    rows = episode_rows(rollouts)
    return rollouts if rows is None else take_rows(rollouts, rows.first)


def _by_source(rows: list[dict[str, Any]], per_prompt: list[float]) -> dict[str, float]:
    column = next((c for c in SOURCE_COLUMNS if c in rows[0]), None)
    if column is None:
        return {}
    groups: dict[str, list[float]] = {}
    for row, value in zip(rows, per_prompt, strict=True):
        groups.setdefault(str(row.get(column)), []).append(value)
    return {f"accuracy/{column}={name}": sum(v) / len(v) for name, v in sorted(groups.items())}


def bootstrap_interval(values: list[float], level: float = 0.95, samples: int = 1000, seed: int = 0):
    """Percentile bootstrap CI of the mean (for reporting accuracy with its uncertainty)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(x), (samples, len(x)), generator=g)
    means = x[idx].mean(-1).sort().values
    lo = means[math.floor((1 - level) / 2 * samples)].item()
    hi = means[math.ceil((1 + level) / 2 * samples) - 1].item()
    return lo, hi
