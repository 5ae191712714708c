"""An agent step's deadline, read as the step goes: `env.episode_timeout_s` from when the step's episodes can
be served, sooner on a stop signal or a discard.

A step whose agents started while the learner updated (runner.AgentRunner.start_ahead) waits in a paused
batcher: its clock starts when the batcher resumes, so a long update never times its episodes out.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable

from grpo.rewards.isolation import STOP_GRACE_S, stop_requested

DISCARD_S = 1.0  # a discarded step's agents get this long to see their calls refused and end


def step_deadline(
    timeout_s: float, paused: Callable[[], bool], cut: threading.Event | None = None
) -> Callable[[], float]:
    """A function giving the step's deadline (time.monotonic()) each time it is called."""
    limit: list[float | None] = [None]

    def deadline() -> float:
        now = time.monotonic()
        if limit[0] is None and not paused():
            limit[0] = now + timeout_s  # the clock starts when the engine serves the step
        current = now + timeout_s if limit[0] is None else limit[0]
        if stop_requested() and current > now + STOP_GRACE_S:
            current = limit[0] = now + STOP_GRACE_S  # SIGINT/SIGTERM: the step ends soon
        if cut is not None and cut.is_set() and current > now + DISCARD_S:
            current = limit[0] = now + DISCARD_S  # discarded: their calls get 409 now
        return current

    return deadline


async def until(work: Awaitable, deadline: Callable[[], float]):
    """`await work`, or TimeoutError once `deadline()` has passed (asyncio.wait_for with a moving end)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        left = deadline() - time.monotonic()
        if left <= 0:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise TimeoutError
        await asyncio.wait({task}, timeout=min(left, 0.25))
    return task.result()
