"""Held-out accuracy: greedy pass@1, and pass@k / maj@k from k samples per prompt.

Correctness is the GSM8K rule (final number equals the reference's `#### n`), the same check the
training reward uses, so "accuracy" during and after training means one thing. IFEval rows (with an
`instruction_id_list`) are scored by their instructions instead: accuracy is prompt-level strict, and
the four IFEval accuracies are reported beside it. Rows with a `source` (or task/category/subject/level/
type) column also get one accuracy per value, and every accuracy has a 95% bootstrap interval.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.data import PromptFormatter, prompt_text
from grpo.records import SamplingParams
from grpo.rewards.ifeval import check_instructions, is_ifeval_row
from grpo.rewards.math import extract_answer, gsm8k_correctness
from grpo.rollout import RolloutEngine

SOURCE_COLUMNS = ("source", "task", "category", "subject", "level", "type")


@dataclass
class EvalResult:
    accuracy: float  # greedy pass@1 (or mean per-sample accuracy when sampling)
    n: int
    k: int = 1
    pass_at_k: float | None = None
    maj_at_k: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)  # CI, per-source and IFEval accuracies

    def as_dict(self) -> dict[str, Any]:
        out = {"accuracy": self.accuracy, "n": self.n, "k": self.k}
        if self.k > 1:
            out.update({f"pass@{self.k}": self.pass_at_k, f"maj@{self.k}": self.maj_at_k})
        return {**out, **self.extra}


def evaluate(
    engine: RolloutEngine,
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
) -> EvalResult:
    if not rows:
        raise ValueError("Evaluation needs at least one row.")
    ifeval = is_ifeval_row(rows[0])
    if not ifeval and "answer" not in rows[0]:
        raise ValueError(
            "Evaluation needs an answer column (answer/solution) to check completions against, "
            "or IFEval rows (instruction_id_list, kwargs)."
        )
    greedy = k == 1
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        stop_strings=stop_strings or [],
    )
    correct: list[list[float]] = []
    votes: list[bool] = []
    records: list[dict[str, Any]] = []
    ifeval_checks: list[list] = []
    tokenizer = formatter.tokenizer
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        ids = formatter.encode([r["prompt"] for r in chunk])
        rollouts = engine.generate(ids, k, sampling)
        texts = tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
        prompts = [prompt_text(r["prompt"]) for r in chunk for _ in range(k)]
        for i, row in enumerate(chunk):
            row_texts = texts[i * k : (i + 1) * k]
            record = {"prompt": prompts[i * k], "completions": row_texts}
            if ifeval:
                checks = [
                    check_instructions(t, row["instruction_id_list"], row.get("kwargs"), prompts[i * k])
                    for t in row_texts
                ]
                row_scores = [float(c.prompt_strict) for c in checks]
                ifeval_checks.append(checks)
                record.update(
                    instruction_id_list=row["instruction_id_list"],
                    strict=[c.instruction_strict for c in checks],
                    loose=[c.instruction_loose for c in checks],
                )
            else:
                row_scores = [
                    float(s or 0.0)
                    for s in gsm8k_correctness(
                        prompts[i * k : (i + 1) * k], row_texts, answer=[row["answer"]] * k
                    )
                ]
                votes.append(_majority_correct(row_texts, row_scores))
                record["answer"] = row["answer"]
            record["correct"] = row_scores
            for column in SOURCE_COLUMNS:
                if column in row:
                    record[column] = row[column]
            correct.append(row_scores)
            records.append(record)
    per_prompt = [sum(r) / len(r) for r in correct]
    result = EvalResult(accuracy=sum(per_prompt) / len(rows), n=len(rows), k=k, records=records)
    lo, hi = bootstrap_interval(per_prompt)
    result.extra.update({"accuracy_ci_low": lo, "accuracy_ci_high": hi})
    result.extra.update(_by_source(rows, per_prompt))
    if ifeval:
        result.extra.update(_ifeval_accuracies(ifeval_checks))
    if k > 1:
        result.pass_at_k = sum(max(r) for r in correct) / len(rows)
        result.maj_at_k = None if ifeval else sum(votes) / len(rows)
    return result


def _by_source(rows: list[dict[str, Any]], per_prompt: list[float]) -> dict[str, float]:
    column = next((c for c in SOURCE_COLUMNS if c in rows[0]), None)
    if column is None:
        return {}
    groups: dict[str, list[float]] = {}
    for row, value in zip(rows, per_prompt, strict=True):
        groups.setdefault(str(row.get(column)), []).append(value)
    return {f"accuracy/{column}={name}": sum(v) / len(v) for name, v in sorted(groups.items())}


def _ifeval_accuracies(checks: list[list]) -> dict[str, float]:
    """IFEval's four numbers over all samples: prompt-level means, instruction-level pooled."""
    flat = [c for row in checks for c in row]
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
    return any(s > 0 for a, s in zip(answers, scores) if a == winner)


def bootstrap_interval(values: list[float], level: float = 0.95, samples: int = 1000, seed: int = 0):
    """Percentile bootstrap CI of the mean (for reporting accuracy with its uncertainty)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(x), (samples, len(x)), generator=g)
    means = x[idx].mean(-1).sort().values
    lo = means[math.floor((1 - level) / 2 * samples)].item()
    hi = means[math.ceil((1 + level) / 2 * samples) - 1].item()
    return lo, hi
