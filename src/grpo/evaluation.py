"""Held-out accuracy: greedy pass@1, and pass@k / maj@k from k samples per prompt.

Correctness is the GSM8K rule (final number equals the reference's `#### n`), the same check the
training reward uses, so "accuracy" during and after training means one thing.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.batch import SamplingParams
from grpo.data import PromptFormatter, prompt_text
from grpo.rewards.math import extract_answer, gsm8k_correctness
from grpo.rollout import RolloutEngine


@dataclass
class EvalResult:
    accuracy: float  # greedy pass@1 (or mean per-sample accuracy when sampling)
    n: int
    k: int = 1
    pass_at_k: float | None = None
    maj_at_k: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = {"accuracy": self.accuracy, "n": self.n, "k": self.k}
        if self.k > 1:
            out.update({f"pass@{self.k}": self.pass_at_k, f"maj@{self.k}": self.maj_at_k})
        return out


def evaluate(engine: RolloutEngine, formatter: PromptFormatter, rows: list[dict[str, Any]], *,
             max_new_tokens: int, batch_size: int = 256, k: int = 1, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, stop_strings: list[str] | None = None) -> EvalResult:
    if not rows:
        raise ValueError("Evaluation needs at least one row.")
    if "answer" not in rows[0]:
        raise ValueError("Evaluation needs an answer column (answer/solution) to check completions against.")
    greedy = k == 1
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, greedy=greedy, stop_strings=stop_strings or [])
    correct: list[list[float]] = []
    votes: list[bool] = []
    records = []
    tokenizer = formatter.tokenizer
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids = formatter.encode([r["prompt"] for r in chunk])
        rollouts = engine.generate(ids, k, sampling)
        texts = tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
        prompts = [prompt_text(r["prompt"]) for r in chunk for _ in range(k)]
        answers = [r["answer"] for r in chunk for _ in range(k)]
        scores = gsm8k_correctness(prompts, texts, answer=answers)
        for i, row in enumerate(chunk):
            row_scores = [float(s or 0.0) for s in scores[i * k:(i + 1) * k]]
            row_texts = texts[i * k:(i + 1) * k]
            correct.append(row_scores)
            votes.append(_majority_correct(row_texts, row_scores))
            records.append({"prompt": prompts[i * k], "answer": row["answer"], "completions": row_texts,
                            "correct": row_scores})
    per_sample = torch.tensor([s for row in correct for s in row])
    result = EvalResult(accuracy=float(per_sample.mean()), n=len(rows), k=k, records=records)
    if k > 1:
        result.pass_at_k = sum(max(r) for r in correct) / len(rows)
        result.maj_at_k = sum(votes) / len(rows)
    return result


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
