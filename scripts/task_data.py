"""What the bundled tasks' generators share (scripts/make_tiny_math.py, scripts/make_tiny_tools.py): drawing
problems unique by question text, the train/test split, the JSONL files and the command line."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

Problem = Callable[[random.Random], dict[str, str]]  # rng -> {"question": ..., "answer": ...}


def unique_problems(
    make_problem: Problem, rng: random.Random, count: int, exclude: Iterable[str] = ()
) -> list[dict]:
    """`count` problems, no two with the same question and none whose question is in `exclude`."""
    seen, rows = set(exclude), []
    while len(rows) < count:
        row = make_problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def generate(
    make_problem: Problem, seed: int, train_size: int, test_size: int
) -> tuple[list[dict], list[dict]]:
    """Draw unique problems; the first `test_size` become the held-out split. A pure function of `seed`."""
    rows = unique_problems(make_problem, random.Random(seed), train_size + test_size)
    return rows[test_size:], rows[:test_size]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(
    description: str, make_problem: Problem, *, seed: int, train_size: int, test_size: int, out_dir: Path
) -> None:
    """The generators' command line: --seed, --train-size, --test-size, --out-dir (defaults given)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--train-size", type=int, default=train_size)
    parser.add_argument("--test-size", type=int, default=test_size)
    parser.add_argument("--out-dir", type=Path, default=out_dir)
    args = parser.parse_args()
    train, test = generate(make_problem, args.seed, args.train_size, args.test_size)
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "test.jsonl", test)
    print(f"wrote {len(train)} train and {len(test)} test problems to {args.out_dir}")
