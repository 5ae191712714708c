"""The calls of all live episodes, batched into the engine by one thread.

Requests queue while the engine decodes; when a batch ends, every request that arrived meanwhile goes into
the next one (never one request at a time). The thread starts a batch as soon as every live session has a
request waiting, or once no new request came for `window_s` (at most `max_wait_s` after the first): an
agent still running its tools joins the next batch. An engine whose `continue_rows` takes `on_step` (the
native one) reports each decode step's tokens, which the waiting requests stream as they are sampled;
another engine's tokens arrive when its call ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable

from grpo.records import SamplingParams

log = logging.getLogger("grpo")


@dataclasses.dataclass
class Job:
    """One request's sampling: continue `ids` by at most `max_new` tokens. Its `events` queue receives
    ("token", id) as tokens are sampled, then ("done", ids, logprobs, truncated) or ("error", exception)."""

    ids: list[int]
    max_new: int
    events: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    cancelled: bool = False


class Batcher:
    def __init__(
        self,
        engine,
        sampling: SamplingParams,
        live: Callable[[], int],
        window_s: float = 0.1,
        max_wait_s: float = 1.0,
    ):
        self.engine, self.sampling, self.live = engine, sampling, live
        self.window_s, self.max_wait_s = window_s, max(window_s, max_wait_s)
        self._pending: list[Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches: list[int] = []  # rows per engine call, since the last metrics()
        self._thread = threading.Thread(target=self._loop, name="grpo-gateway-batcher", daemon=True)
        self._thread.start()

    def use(self, engine, sampling: SamplingParams) -> None:
        """The engine and run sampling of the next calls (a step, or an evaluation with greedy sampling)."""
        with self._cond:
            self.engine, self.sampling = engine, sampling

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._closed:
                raise RuntimeError("the gateway is closed")
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def wake(self) -> None:
        """A session ended: the batch waiting for it may start now."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _take(self) -> list[Job] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                for job in self._pending:
                    job.events.put(("error", RuntimeError("the gateway closed")))
                return None
            # Wait while requests keep coming (each arrival restarts the window), at most max_wait_s.
            start = time.monotonic()
            seen, last = len(self._pending), start
            while not self._closed and len(self._pending) < self.live():
                now = time.monotonic()
                if len(self._pending) > seen:
                    seen, last = len(self._pending), now
                left = min(last + self.window_s, start + self.max_wait_s) - now
                if left <= 0:
                    break
                self._cond.wait(left)
            jobs = [j for j in self._pending if not j.cancelled]
            self._pending = []
            return jobs

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[Job]) -> None:
        with self._cond:
            engine, sampling = self.engine, self.sampling
        sampling = dataclasses.replace(sampling, max_new_tokens=max(j.max_new for j in jobs))
        self.batches.append(len(jobs))

        def on_step(rows: list[int], tokens: list[int]) -> None:
            for r, t in zip(rows, tokens, strict=True):
                jobs[r].events.put(("token", t))

        try:
            if takes_on_step(engine):
                out = engine.continue_rows([j.ids for j in jobs], sampling, on_step=on_step)
            else:
                out = engine.continue_rows([j.ids for j in jobs], sampling)
        except Exception as err:  # noqa: BLE001 - every waiting request gets the error; the server stays up
            log.warning("The gateway's engine call failed: %s: %s", type(err).__name__, err)
            for job in jobs:
                job.events.put(("error", err))
            return
        lengths = out.completion_mask.sum(-1).long().tolist()
        for r, job in enumerate(jobs):
            ids = out.completion_ids[r, : lengths[r]].tolist()
            logprobs = out.sampling_logprobs[r, : lengths[r]].tolist()
            job.events.put(("done", ids, logprobs, bool(out.truncated[r])))

    def metrics(self) -> dict[str, float]:
        batches, self.batches = self.batches, []
        if not batches:
            return {}
        return {
            "gateway/engine_calls": float(len(batches)),
            "gateway/batch_rows": sum(batches) / len(batches),
        }


def takes_on_step(engine) -> bool:
    try:
        return "on_step" in inspect.signature(engine.continue_rows).parameters
    except (TypeError, ValueError):
        return False
