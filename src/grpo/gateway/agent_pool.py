"""Agents' episodes in a few forked worker processes (env.agent_workers), off the trainer's GIL.

Each model call of an openai-python agent costs ~4 ms of CPU in the `openai` client (request building,
TypedDict → JSON, httpx, reply parsing). Run on threads in the trainer, the 64 agents of a step share its one
interpreter lock with the gateway's server and the engine's Python, so that work is serialised beside them.
Here the step's episodes are dealt out to `size` persistent workers (forked once, as agents/workers.py forks
tool workers: closures and classes defined anywhere work, nothing of the agent is pickled); each runs its
episodes on threads (`async def run`: on one event loop) and talks HTTP to the gateway in the trainer, one
session key per episode, exactly as the in-process threads do. Only the row goes in and the reward (or what
failed) comes out.

What the trainer keeps: the deadline (a worker still running an episode at it is killed, its hung agent
with it, and forked again next step), the stop signal (the deadline shortens to STOP_GRACE_S, as for the
threads), the failure accounting (the runner classifies what a worker reports). A worker never touches
torch: it ignores SIGINT (the trainer decides when episodes end), dies with the trainer
(PR_SET_PDEATHSIG), and closes its copy of the gateway's listening socket, so no port outlives the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import threading
import time
from collections.abc import Callable

from grpo.agents.workers import CallTimedOut, Worker, WorkerDied
from grpo.gateway.wire import finite_reward
from grpo.rewards.isolation import RewardInterrupted

POLL_S = 0.5  # the longest a worker's `done` call waits for an episode to end before answering
ANSWER_S = 5.0  # beyond that wait, how long a worker may take to answer before it is killed


class NotAReward:
    """What an agent returned that is neither a number nor None, as its repr (the value itself may not
    pickle): the runner scores the episode as failed and quotes it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _sendable(value):
    """What travels back to the trainer: None, the reward as a float, or the repr of anything else."""
    if value is None:
        return None
    number = finite_reward(value)
    return number if number is not None else NotAReward(repr(value)[:300])


class _Host:
    """The worker side: runs the episodes it is given and hands back those that ended."""

    def __init__(self, agent: Callable, is_async: bool, timeout_s: float, close_fds: tuple[int, ...]) -> None:
        for fd in close_fds:  # the gateway's listening socket: the port is the trainer's alone
            with contextlib.suppress(OSError):
                os.close(fd)
        # Nothing inherited from the trainer (its model, its tensors' Python objects) is garbage: keep the
        # collector from walking it (CPU) and from touching its pages (copy-on-write).
        gc.freeze()
        self.agent, self.is_async, self.timeout_s = agent, is_async, timeout_s
        self._ended: list[tuple] = []
        self._cond = threading.Condition()
        self._http = None

    def start(self, base_url: str, episodes: list[tuple[int, str, dict]], deadline: float) -> None:
        """Start `episodes` ((index, session key, row) each) against the gateway at `base_url`; returns at
        once."""
        if self.is_async:
            threading.Thread(
                target=lambda: asyncio.run(self._gather(base_url, episodes, deadline)),
                name="grpo-agent-loop",
                daemon=True,
            ).start()
            return
        import openai

        from grpo.gateway.agent_http import agent_http_client

        if self._http is None:  # one connection stack for the worker's episodes, kept across steps
            self._http = agent_http_client()
        for k, key, row in episodes:
            client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=self._http)
            threading.Thread(
                target=self._one, args=(k, client, row, deadline), name=f"grpo-agent-{k}", daemon=True
            ).start()

    def _one(self, k: int, client, row: dict, deadline: float) -> None:
        try:
            out = (k, _sendable(self.agent(client, row)), None)
        except Exception as err:  # noqa: BLE001 - the agent's fault ends its episode, not the worker
            out = (k, None, (type(err).__name__, str(err)[:1000], time.monotonic() >= deadline - 0.1))
        self._report(out)

    async def _gather(self, base_url: str, episodes: list[tuple[int, str, dict]], deadline: float) -> None:
        import httpx
        import openai

        async def one(k: int, key: str, row: dict, http) -> None:
            client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http)
            try:
                left = None if math.isinf(deadline) else max(deadline - time.monotonic(), 0.0)
                out = (k, _sendable(await asyncio.wait_for(self.agent(client, row), left)), None)
            except TimeoutError:
                out = (k, None, ("TimeoutError", "", True))
            except Exception as err:  # noqa: BLE001
                out = (k, None, (type(err).__name__, str(err)[:1000], time.monotonic() >= deadline - 0.1))
            self._report(out)

        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
            await asyncio.gather(*(one(k, key, row, http) for k, key, row in episodes))

    def _report(self, out: tuple) -> None:
        with self._cond:
            self._ended.append(out)
            self._cond.notify_all()

    def done(self, wait_s: float) -> list[tuple]:
        """The episodes that ended since the last call: (index, value, None or (error type, message, late));
        waits up to `wait_s` for one."""
        with self._cond:
            if not self._ended:
                self._cond.wait(wait_s)
            out, self._ended = self._ended, []
        return out


class AgentPool:
    """`size` workers running `agent`'s episodes (see the module docstring)."""

    def __init__(
        self, agent: Callable, size: int, *, is_async: bool, timeout_s: float, close_fds: tuple[int, ...] = ()
    ) -> None:
        self.agent, self.size, self.is_async = agent, max(1, int(size)), is_async
        self.timeout_s, self.close_fds = timeout_s, tuple(close_fds)
        self._workers: list[Worker | None] = [None] * self.size

    def _worker(self, i: int) -> Worker:
        worker = self._workers[i]
        if worker is None or not worker.alive:
            agent, is_async, timeout_s, fds = self.agent, self.is_async, self.timeout_s, self.close_fds
            # Import the client in the trainer once, so no worker pays for it (and none imports under a lock).
            import httpx  # noqa: F401
            import openai  # noqa: F401

            worker = Worker(lambda: _Host(agent, is_async, timeout_s, fds), None, "an agent worker")
            self._workers[i] = worker
        return worker

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w is not None and w.pid is not None]

    def drive(
        self,
        base_url: str,
        episodes: list[tuple[int, str, dict]],
        deadline: Callable[[], float],
        ended: Callable[[int, object, tuple | None], None],
    ) -> set[int]:
        """Run `episodes` ((index, key, row) each) and call `ended(index, value, error)` from a poller thread
        as each ends; returns the indices that did not end by `deadline()` (read as it moves: a stop signal
        brings it forward). A worker still running an episode then is killed."""
        shares = [episodes[i :: self.size] for i in range(self.size)]
        pending = [{k for k, _, _ in share} for share in shares]
        lock = threading.Lock()

        def finish(i: int, k: int, value, error) -> None:
            with lock:  # once per episode, and never after drive() returned (its episode timed out)
                if k not in pending[i]:
                    return
                pending[i].discard(k)
            ended(k, value, error)

        threads = [
            threading.Thread(
                target=self._poll,
                args=(i, base_url, share, pending[i], deadline, finish),
                name=f"grpo-agent-pool-{i}",
                daemon=True,
            )
            for i, share in enumerate(shares)
            if share
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # each ends by the deadline, give or take POLL_S + ANSWER_S
        late: set[int] = set()
        with lock:
            for left in pending:
                late |= left
                left.clear()
        return late

    def _poll(self, i: int, base_url: str, share: list, pending: set, deadline: Callable, finish: Callable):
        """Worker `i`'s share of a step: start it, then hand on the episodes as they end, until none is left
        or the deadline passes."""
        worker = None
        try:
            worker = self._worker(i)
            try:
                # The limit is the trainer's to enforce (it kills the worker): it moves (a stop signal, a
                # step started while the learner updates), which a number sent now could not follow.
                worker.call("start", (base_url, share, math.inf))
            except TypeError as err:  # a row that cannot be pickled: the agent never saw it
                why = f"{err}; env.agent_workers=0 runs the agents in the trainer's process, rows unsent"
                for k in list(pending):
                    finish(i, k, None, ("TypeError", why, False))
                return
            while pending and (left := deadline() - time.monotonic()) > 0:
                wait = min(POLL_S, left)
                # A worker that cannot answer within seconds (an agent holding its GIL in C) is killed.
                for k, value, error in worker.call("done", (wait,), timeout=wait + ANSWER_S):
                    finish(i, k, value, error)
        except (WorkerDied, CallTimedOut) as err:
            # The whole worker went (os._exit in an agent, a crash, a kill): its episodes failed.
            late = time.monotonic() >= deadline() - 0.1
            for k in list(pending):
                finish(i, k, None, (type(err).__name__, str(err), late))
        except RewardInterrupted:
            pass  # a stop signal outlived its grace: what is pending times out
        finally:
            if pending and worker is not None:  # hung agents (a thread cannot be stopped): the worker goes
                worker.close()  # with them, closed by the thread that owns its pipe

    def close(self) -> None:
        for worker in self._workers:
            if worker is not None:
                worker.close()
        self._workers = [None] * self.size


MAX_DEFAULT = 8  # workers by default at most: each is a fork of the trainer (its page tables, a CUDA host's
# mappings), and 8 processes already run a step's clients at ~4 ms a call in parallel


def default_size() -> int:
    """As many workers as cores, at most MAX_DEFAULT (the engine uses the cores too, but between its calls the
    agents' client work is what the next call waits for)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT))


__all__ = ["AgentPool", "NotAReward", "default_size"]
