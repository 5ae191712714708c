"""Safe reward execution: time limits, errors that name function/sample/input, counted skips, NaN/inf,
concurrent async rewards, and model-written code in a limited subprocess."""

import asyncio
import math
import time

import pytest

from grpo.rewards import (
    NonFiniteRewardError,
    RewardError,
    RewardTimeoutError,
    code_tests,
    run_python,
    score_completions,
)

PROMPTS, COMPLETIONS = ["p0", "p1", "p2"], ["c0", "c1", "BOOM"]


def fragile(prompts, completions, **_):
    """Fails whenever the batch holds the completion 'BOOM'."""
    if "BOOM" in completions:
        raise ZeroDivisionError("division by zero")
    return [1.0] * len(completions)


def sleeper(prompts, completions, **_):
    time.sleep(3600)


def nan_on_last(prompts, completions, **_):
    return [math.nan if c == "BOOM" else 0.5 for c in completions]


def good(prompts, completions, **_):
    return [2.0] * len(completions)


def test_exception_names_function_sample_and_input():
    with pytest.raises(RewardError) as raised:
        score_completions([good, fragile], None, PROMPTS, COMPLETIONS, {"answer": ["a0", "a1", "a2"]})
    message = str(raised.value)
    assert "'fragile' raised ZeroDivisionError: division by zero on sample 2 of 3" in message
    assert "prompt: 'p2'; completion: 'BOOM'; columns: {'answer': 'a2'}" in message
    assert "reward_on_error=skip" in message
    assert isinstance(raised.value.__cause__, ZeroDivisionError)


def test_skip_scores_only_the_failing_sample_as_missing_and_counts_it():
    scores = score_completions([good, fragile], None, PROMPTS, COMPLETIONS, {}, on_error="skip")
    assert scores.skipped == 1
    assert scores.per_function[:, 1].tolist()[:2] == [1.0, 1.0] and math.isnan(scores.per_function[2, 1])
    assert scores.total.tolist() == [3.0, 3.0, 2.0]  # the missing score is left out of the sum


def test_a_reward_that_never_returns_times_out_and_is_named():
    start = time.perf_counter()
    with pytest.raises(
        RewardTimeoutError, match=r"'sleeper' timed out \(no result after 0.2 s\) on sample 0"
    ):
        score_completions([sleeper], None, PROMPTS, COMPLETIONS, {}, timeout=0.2)
    assert time.perf_counter() - start < 2.0  # the batch call and one sample, not the hour


def test_timeout_with_skip_drops_the_whole_batch_once():
    start = time.perf_counter()
    scores = score_completions([good, sleeper], None, PROMPTS, COMPLETIONS, {}, timeout=0.2, on_error="skip")
    assert time.perf_counter() - start < 1.5
    assert scores.skipped == 3 and scores.total.tolist() == [2.0, 2.0, 2.0]


def test_non_finite_rewards_stop_or_are_counted():
    with pytest.raises(
        NonFiniteRewardError, match=r"'nan_on_last' returned nan for sample 2.*completion: 'BOOM'"
    ):
        score_completions([nan_on_last], None, PROMPTS, COMPLETIONS, {})
    scores = score_completions([nan_on_last], None, PROMPTS, COMPLETIONS, {}, on_error="skip")
    # the skipped sample is not scored at all: NaN, which the advantages leave out of the baseline
    assert scores.skipped == 1 and scores.total.tolist()[:2] == [0.5, 0.5] and math.isnan(scores.total[2])


def test_async_rewards_run_concurrently_and_are_time_limited():
    async def slow_a(prompts, completions, **_):
        await asyncio.sleep(0.4)
        return [1.0] * len(completions)

    async def slow_b(prompts, completions, **_):
        await asyncio.sleep(0.4)
        return [10.0] * len(completions)

    start = time.perf_counter()
    scores = score_completions([slow_a, good, slow_b], None, PROMPTS, COMPLETIONS, {}, timeout=5)
    elapsed = time.perf_counter() - start
    assert scores.total.tolist() == [13.0, 13.0, 13.0]
    assert scores.names == ["slow_a", "good", "slow_b"]
    assert elapsed < 0.75, f"two 0.4 s async rewards took {elapsed:.2f} s: not concurrent"

    async def hangs(prompts, completions, **_):
        await asyncio.sleep(3600)

    with pytest.raises(RewardTimeoutError, match="'hangs' timed out"):
        score_completions([hangs], None, PROMPTS[:1], COMPLETIONS[:1], {}, timeout=0.2)


def test_async_reward_exceptions_are_named_like_sync_ones():
    async def broken(prompts, completions, **_):
        raise KeyError("answer")

    with pytest.raises(RewardError, match="'broken' raised KeyError: 'answer' on sample 0 of 3"):
        score_completions([broken], None, PROMPTS, COMPLETIONS, {})


def test_run_python_limits_time_and_memory_in_a_child_process():
    start = time.perf_counter()
    assert run_python("while True: pass", timeout=0.5).timed_out
    assert time.perf_counter() - start < 3
    result = run_python("x = bytearray(4_000_000_000)", memory_mb=256)
    assert not result.ok and "MemoryError" in result.stderr
    result = run_python("import os; print(os.getpid())")
    assert result.ok and int(result.stdout) != __import__("os").getpid()  # never the trainer's process


def test_code_tests_reward():
    completions = [
        "Here:\n```python\ndef add(a, b):\n    return a + b\n```",
        "def add(a, b):\n    return a - b",
        "anything",
    ]
    tests = ["assert add(2, 3) == 5"] * 2 + [None]
    assert code_tests(["q"] * 3, completions, tests=tests) == [1.0, 0.0, None]
