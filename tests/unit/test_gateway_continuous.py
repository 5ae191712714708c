"""The gateway's batcher on an engine with its own continuous batching (`add_row` / `step_rows`, as vLLM
in-process has): requests join the running batch at the next step, stream per step, and fail alone.
A scripted engine stands in for vLLM (tests/integration/test_vllm.py runs the real one)."""

from __future__ import annotations

import queue
import time

import pytest

from grpo.gateway.batching import Batcher, Job, continuous
from grpo.records import SamplingParams

GREEDY = SamplingParams(max_new_tokens=50, greedy=True)


class Stepped:
    """Each row emits ids 100, 101, ... one per step (log-prob −0.5 each) until its max_new_tokens."""

    def __init__(self, step_s: float = 0.01, fail_at: int | None = None):
        self.rows: list[dict] = []
        self.step_s, self.fail_at, self.steps = step_s, fail_at, 0
        self.added_at_step: list[int] = []

    def add_row(self, ids, sampling, report, fail):
        if ids == [0]:
            raise ValueError("row refused")
        self.added_at_step.append(self.steps)
        self.rows.append({"left": sampling.max_new_tokens, "next": 100, "report": report, "fail": fail})

    def step_rows(self) -> int:
        time.sleep(self.step_s)
        self.steps += 1
        rows, self.rows = self.rows, []
        if self.fail_at is not None and self.steps >= self.fail_at:
            for row in rows:
                row["fail"](RuntimeError("engine died"))
            raise RuntimeError("engine died")
        for row in rows:
            row["left"] -= 1
            row["report"]([row["next"]], [-0.5], row["left"] == 0, row["left"] == 0)
            row["next"] += 1
            if row["left"]:
                self.rows.append(row)
        return len(rows)


class Stamped(queue.SimpleQueue):
    def __init__(self):
        super().__init__()
        self.stamps: list[tuple[float, str]] = []

    def put(self, item, block=True, timeout=None):
        self.stamps.append((time.monotonic(), item[0]))
        super().put(item, block, timeout)

    def first(self, kind: str) -> float:
        return next(t for t, k in self.stamps if k == kind)


def drain(job: Job) -> tuple[list[int], tuple]:
    tokens = []
    while (event := job.events.get(timeout=30))[0] == "token":
        tokens.append(event[1])
    return tokens, event


def test_an_engine_with_add_row_and_step_rows_is_continuous():
    assert continuous(Stepped())
    assert not continuous(object())


def test_a_request_arriving_mid_decode_joins_at_the_next_step():
    engine = Stepped()
    batcher = Batcher(engine, GREEDY, live=lambda: (5, 5))  # 5 live sessions yet to call: no window waited
    try:
        a = batcher.submit(Job([1, 2], 40, stream=True, events=Stamped()))
        a.events.get(timeout=30)
        b = batcher.submit(Job([3], 5, stream=True, events=Stamped()))
        c = batcher.submit(Job([4], 3, stream=False))
        results = [drain(j) for j in (a, b, c)]
    finally:
        batcher.close()
    assert b.events.first("token") < a.events.first("done")
    assert engine.added_at_step[0] == 0 and 0 < engine.added_at_step[1] < 40  # B joined while A decoded
    (ta, da), (tb, db), (tc, dc) = results
    assert da == ("done", list(range(100, 140)), [-0.5] * 40, True) and ta[-1] == 139
    assert db[1] == tb == [100, 101, 102, 103, 104]
    assert dc[1] == [100, 101, 102] and tc == []  # not streamed: the reply only
    metrics = batcher.metrics()
    assert metrics["gateway/engine_calls"] == 40 and metrics["gateway/batch_rows"] > 1


def test_a_refused_row_fails_alone_and_an_engine_failure_reaches_every_row():
    engine = Stepped(fail_at=3)
    batcher = Batcher(engine, GREEDY, live=lambda: (1, 0))
    try:
        refused = batcher.submit(Job([0], 5))
        assert refused.events.get(timeout=30)[0] == "error"
        a = batcher.submit(Job([1], 10, stream=True))
        b = batcher.submit(Job([2], 10))
        ta, ea = drain(a)
        _, eb = drain(b)
        assert ea[0] == eb[0] == "error" and "engine died" in str(ea[1]) and len(ta) >= 1
        engine.fail_at = None  # the server stays up: the next request is served
        c = batcher.submit(Job([3], 2))
        assert drain(c)[1][1] == [100, 101]
    finally:
        batcher.close()


def test_closing_the_batcher_ends_waiting_requests():
    batcher = Batcher(Stepped(), GREEDY, live=lambda: (1, 0))
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(Job([1], 3))
