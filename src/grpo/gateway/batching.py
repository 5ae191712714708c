"""The calls of all live episodes, batched into the engine by one thread.

Requests queue while the engine decodes; when a batch ends, every request that arrived meanwhile goes into
the next one (never one request at a time). The thread starts a batch as soon as every live session has a
request waiting, else once no new request came for a while: `window_s`, or a quarter of the last engine
call if longer (a batch split in two decodes twice, while a straggler costs only its own delay); at most
`max_wait_s` after the first request. An episode that has not called yet is always waited for (up to
`max_wait_s`): an agent's first act is to call the model. An agent running its tools joins the next batch.

The calls that the next batch waits for are those of the turns that called a tool: their agents run the tool
and call again at once, while an agent given its final answer (a reply with no tool call) ends. So when a
batch ends, the replies that call a tool go out first, and the final replies (`Job.final` says which) wait
until the next batch starts (at most the last engine call's time or `window_s`, whichever is longer; not at
all when no other call is expected): the calls of the next turn are not queued behind the answers' parsing,
and the answers are read while the engine decodes. A session
whose last reply was final is not waited for (the live callback leaves it out: SessionTable.expected),
unless the run's agents have been seen calling again after a final reply; one that does call joins the
batch that is forming, or the next.

An engine whose `generate` / `continue_rows` take `on_step` (native, transformers) reports each decode
step's tokens, which the waiting requests stream as they are sampled; another engine's arrive when its call
ends. An engine with its own continuous batching (`add_row` / `step_rows`: vLLM in-process) is driven step
by step instead: a request joins the running batch at the next engine step, with no window, and its tokens
stream after every step.

The batcher's thread forms the batches; the engine calls run on the step's thread while it waits for its
episodes (`host`), so the decode shares the learner's OpenMP team instead of starting a second one.

`pause()` holds every request until `resume()`: the runner starts the next step's agents while the learner
updates (gateway/runner.py, `start_ahead`), and their first requests, rendered and queued meanwhile, must be
sampled with the new weights, not the ones being changed.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from grpo.model.turn_kv import TurnCache, takes_kv
from grpo.records import SamplingParams

log = logging.getLogger("grpo")


@dataclasses.dataclass
class Job:
    """One request's sampling: continue `ids` by at most `max_new` tokens. Its `events` queue receives
    ("token", id) as tokens are sampled (streamed jobs only: a thread woken per token costs the decode
    time), then ("done", ids, logprobs, truncated, version) or ("error", exception). `version`: the weights
    that sampled the ids, when the engine says (a Ray rollout actor's VersionedEngine), else None."""

    ids: list[int]
    max_new: int
    stream: bool = False  # the client streams: it gets each token as it is sampled
    events: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    key: object = None  # the row's session: its K/V are kept for its next turn (model/turn_kv.py)
    # `final(ids)`: the sampled ids make a final reply (no tool call), which may wait for the next batch to
    # start (see the module docstring); None: the reply goes out as soon as it is sampled.
    final: Callable[[list[int]], bool] | None = None
    # The episode's index in its step: a batch's rows go to the engine in this order, not in the order the
    # requests arrived (see `in_episode_order`); None: after the others, as they arrived.
    order: int | None = None


class Batcher:
    def __init__(
        self,
        engine,
        sampling: SamplingParams,
        live: Callable[[], tuple[int, int]],
        window_s: float = 0.2,
        max_wait_s: float = 5.0,
    ):
        self.engine, self.sampling, self.live = engine, sampling, live
        self.kv = TurnCache() if takes_kv(engine) else None
        self.window_s, self.max_wait_s = window_s, max(window_s, max_wait_s)
        self._last_call_s = 0.0
        self._pending: list[Job] = []
        self._held: list[tuple[Job, tuple]] = []  # final replies waiting for the next batch to start
        self._held_until = 0.0
        self._in_flight: dict[int, Callable] = {}  # id → fail(error) of each job a continuous engine samples
        self._cond = threading.Condition()
        self._closed = False
        self._host: queue.SimpleQueue | None = None  # the engine calls' thread while one lends itself (host)
        self._paused = False  # requests queue, no engine call starts (the weights are being updated)
        self.batches: list[int] = []  # rows per engine call, since the last metrics()
        self.engine_s = 0.0  # seconds in engine calls, since the last metrics()
        self._thread = threading.Thread(target=self._loop, name="grpo-gateway-batcher", daemon=True)
        self._thread.start()

    def use(self, engine, sampling: SamplingParams) -> None:
        """The engine and run sampling of the next calls (a step, or an evaluation with greedy sampling)."""
        with self._cond:
            self.engine, self.sampling = engine, sampling
            # Sessions' K/V, kept between their turns; new each step (they are the old weights' K/V).
            self.kv = TurnCache() if takes_kv(engine) else None

    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._closed:
                raise RuntimeError("the gateway is closed")
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def pause(self) -> None:
        """No engine call starts until resume(); requests queue meanwhile (a call already running ends)."""
        with self._cond:
            self._paused = True

    @property
    def paused(self) -> bool:
        return self._paused

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def fail_pending(self, error: BaseException) -> None:
        """Every queued request gets `error` (discarded episodes' first calls, before they are sampled)."""
        with self._cond:
            pending, self._pending = self._pending, []
        for job in pending:
            job.events.put(("error", error))

    def wake(self) -> None:
        """A session ended: the batch waiting for it may start now."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._release()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _expected(self) -> tuple[int, int]:
        """(calls the next batch waits for, episodes yet to call): a held reply's session is not awaited."""
        live, fresh = self.live()
        return live - len(self._held), fresh

    def _release(self) -> None:
        """The held final replies go out (under the lock)."""
        held, self._held = self._held, []
        for job, event in held:
            job.events.put(event)

    def _take(self) -> list[Job] | None:
        with self._cond:
            while (not self._pending or self._paused) and not self._closed:
                if self._held and (self._expected()[0] <= 0 or time.monotonic() >= self._held_until):
                    self._release()  # no call is coming that the replies would delay
                    continue
                self._cond.wait(max(0.0, self._held_until - time.monotonic()) if self._held else None)
            if self._closed:
                self._release()
                for job in self._pending:
                    job.events.put(("error", RuntimeError("the gateway closed")))
                return None
            # Wait while requests keep coming (each arrival restarts the window), at most max_wait_s.
            start = time.monotonic()
            seen, last = len(self._pending), start
            while not self._closed:
                live, fresh = self._expected()
                if len(self._pending) >= live:
                    break
                if self._held and time.monotonic() >= self._held_until:
                    self._release()
                    continue
                now = time.monotonic()
                if len(self._pending) > seen:
                    seen, last = len(self._pending), now
                window = max(self.window_s, self._last_call_s / 4)
                until = start + self.max_wait_s  # an episode yet to call: it will, wait for it
                left = (until if fresh else min(until, last + window)) - now
                if left <= 0:
                    break
                self._cond.wait(min(left, self._held_until - now) if self._held else left)
            self._release()  # the batch starts: the answers are read while it decodes
            jobs = in_episode_order(j for j in self._pending if not j.cancelled)
            self._pending = []
            return jobs

    def _loop(self) -> None:
        while True:
            with self._cond:
                engine = self.engine
            if continuous(engine):
                if not self._step(engine):
                    return
            elif (jobs := self._take()) is None:
                return
            elif jobs:
                self._run(jobs)

    # -- an engine with continuous batching ---------------------------------------------------------------
    def _step(self, engine) -> bool:
        """Add the requests that arrived, then one engine step; False once closed."""
        with self._cond:
            self._release()  # held by a batch of the engine before this one
            while (self._paused or not (self._pending or self._in_flight)) and not self._closed:
                self._cond.wait()
            if self._closed:
                for job in self._pending:
                    job.events.put(("error", RuntimeError("the gateway closed")))
                return False
            jobs = in_episode_order(j for j in self._pending if not j.cancelled)
            self._pending, sampling = [], self.sampling
        for job in jobs:
            self._join(engine, sampling, job)
        if not self._in_flight:
            return True
        started = time.perf_counter()
        try:
            rows = self._call(engine.step_rows, own_thread=False)
        except Exception as err:  # noqa: BLE001 - every row in flight gets the error; the server stays up
            log.warning("The gateway's engine step failed: %s: %s", type(err).__name__, err)
            for fail in list(self._in_flight.values()):
                fail(err)
            return True
        self.engine_s += time.perf_counter() - started
        if rows:
            self.batches.append(rows)
        return True

    def _join(self, engine, sampling: SamplingParams, job: Job) -> None:
        """`job` joins the engine's running batch; its tokens go to its events as each step samples them."""
        ids: list[int] = []
        logprobs: list[float] = []

        def report(tokens: list[int], lps: list[float], finished: bool, truncated: bool) -> None:
            ids.extend(tokens)
            logprobs.extend(lps)
            if job.stream:
                for t in tokens:
                    job.events.put(("token", t))
            if finished:
                self._in_flight.pop(id(job), None)
                # no weight version: a Ray actor's VersionedEngine drives whole calls, not steps
                job.events.put(("done", ids, logprobs, truncated, None))

        def fail(err: BaseException) -> None:
            if self._in_flight.pop(id(job), None) is not None:
                job.events.put(("error", err))

        self._in_flight[id(job)] = fail
        try:
            engine.add_row(job.ids, dataclasses.replace(sampling, max_new_tokens=job.max_new), report, fail)
        except Exception as err:  # noqa: BLE001 - this request gets the error; the others go on
            fail(err)

    def _run(self, jobs: list[Job]) -> None:
        with self._cond:
            engine, sampling, cache = self.engine, self.sampling, self.kv
        sampling = dataclasses.replace(sampling, max_new_tokens=max(j.max_new for j in jobs))
        self.batches.append(len(jobs))
        started = time.perf_counter()
        rows = [j.ids for j in jobs]
        # A group's first calls share a prompt: the engine's shared-prompt path (one prefill per prompt), but
        # not greedy, where vLLM and transformers refuse n > 1 (the copies would be equal): rows then.
        prompts, n, order = (rows, 1, list(range(len(rows)))) if sampling.greedy else shared_prompts(rows)

        def on_step(rows: list[int], tokens: list[int]) -> None:
            for r, t in zip(rows, tokens, strict=True):
                if (job := jobs[order[r]]).stream:
                    job.events.put(("token", t))

        streamed = any(j.stream for j in jobs)

        try:
            if n > 1:  # order[output row] = job index
                call, args = engine.generate, (prompts, n, sampling)
            else:
                call, args = engine.continue_rows, (rows, sampling)
            kw = {"on_step": on_step} if streamed and takes_on_step(call) else {}
            if cache is not None:  # result row r is job order[r]'s; a row without a session keeps nothing
                kw["kv"] = cache.bind(jobs[k].key if jobs[k].key is not None else object() for k in order)
            out = self._call(call, *args, **kw)
        except Exception as err:  # noqa: BLE001 - every waiting request gets the error; the server stays up
            log.warning("The gateway's engine call failed: %s: %s", type(err).__name__, err)
            for job in jobs:
                job.events.put(("error", err))
            return
        self._last_call_s = time.perf_counter() - started
        log.debug("Gateway: %d requests in one engine call (%.2f s).", len(jobs), self._last_call_s)
        self.engine_s += self._last_call_s
        lengths = out.completion_mask.sum(-1).long().tolist()
        # one engine call, one set of weights: a row's stamps are its version (-1 where nothing was sampled)
        versions = [None] * len(order) if out.weight_version is None else out.weight_version.max(-1).values
        done, finals = [], []
        for r, k in enumerate(order):
            ids = out.completion_ids[r, : lengths[r]].tolist()
            logprobs = out.sampling_logprobs[r, : lengths[r]].tolist()
            version = None if versions[r] is None else int(versions[r])
            job = jobs[k]
            event = ("done", ids, logprobs, bool(out.truncated[r]), version)
            (finals if _is_final(job, ids) else done).append((job, event))
        if not done:  # every reply is final: no call of a next turn to wait for
            done, finals = finals, []
        for job, event in done:
            job.events.put(event)
        if finals:
            with self._cond:
                self._held += finals
                # Long enough for the tool-calling agents' next calls to come in (they run while nothing else
                # does), short enough that a slow tool does not keep the answers from their agents.
                self._held_until = time.monotonic() + max(self.window_s, self._last_call_s)

    # -- where the engine calls run --------------------------------------------------------------------------
    def host(self, work: Callable[[], object]):
        """Run `work()` on a new thread while this thread runs the engine calls it causes; work's result.

        Why: the engine's OpenMP team is its calling thread's (GNU OpenMP keeps one per thread that starts a
        parallel region), and the step's thread already has one, the learner's. A decode on any other thread
        makes two teams on the same cores, and with more OpenMP threads than CPUs GNU OpenMP lets an idle
        worker spin only ~100 times before it sleeps: every parallel op of the decode then waits for its
        worker to wake (docs/agents.md, "One OpenMP team"). On the step's thread, which only waited for its
        episodes, the decode has the same single team as the in-process runners' decode and the update."""
        calls: queue.SimpleQueue = queue.SimpleQueue()
        with self._cond:
            if self._host is not None:  # a thread hosts already (nested): it keeps hosting
                return work()
            self._host = calls
        box: dict = {}

        def run() -> None:
            try:
                box["out"] = work()
            except BaseException as err:  # noqa: BLE001 - raised again on the hosting thread
                box["err"] = err
            finally:
                calls.put(None)

        thread = threading.Thread(target=run, name="grpo-gateway-episodes", daemon=True)
        thread.start()
        stopped = True  # left by an exception (Ctrl-C): the calls still queued fail instead of running
        try:
            while True:
                try:
                    call = calls.get(timeout=0.25)  # a timeout: Ctrl-C reaches the main thread while it waits
                except queue.Empty:
                    continue
                if call is None:
                    break
                call()
            stopped = False
        finally:
            with self._cond:
                self._host = None
            while True:  # a call queued before the hosting ended runs here; later ones go elsewhere
                try:
                    call = calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call.refuse() if stopped else call()
        thread.join()
        if "err" in box:
            raise box["err"]
        return box["out"]

    def _call(self, call, *args, own_thread: bool = True, **kwargs):
        """`call(*args, **kwargs)` under no_grad on the hosting thread (`host`) while one hosts; else on a
        thread that ends with it (`own_thread`), or on this one."""
        with self._cond:
            host = self._host
            if host is not None:
                hosted = _Hosted(call, args, kwargs)
                host.put(hosted)
        if host is not None:
            return hosted.result()
        if own_thread:
            return on_a_thread_of_its_own(call, *args, **kwargs)
        with torch.no_grad():
            return call(*args, **kwargs)

    def metrics(self) -> dict[str, float]:
        batches, self.batches = self.batches, []
        seconds, self.engine_s = self.engine_s, 0.0
        if not batches:
            return {}
        return {
            "gateway/engine_s": seconds,  # of time/rollout; the rest: HTTP, templates, the agents, waiting
            "gateway/engine_calls": float(len(batches)),
            "gateway/batch_rows": sum(batches) / len(batches),
        }


class _Hosted:
    """One engine call handed to the hosting thread; the batcher waits for `result()`."""

    def __init__(self, call, args, kwargs):
        self.call, self.args, self.kwargs = call, args, kwargs
        self.done = threading.Event()
        self.out = self.err = None

    def __call__(self) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread: the hosting thread's may be on
                self.out = self.call(*self.args, **self.kwargs)
        except BaseException as err:  # handed to the batcher, which tells the requests
            self.err = err
            if not isinstance(err, Exception):  # Ctrl-C, SystemExit: the hosting thread stops too
                raise
        finally:
            self.done.set()

    def refuse(self) -> None:
        self.err = RuntimeError("the engine call was not run: the step is stopping")
        self.done.set()

    def result(self):
        self.done.wait()
        if isinstance(self.err, Exception):
            raise self.err
        if self.err is not None:  # the hosting thread was interrupted; the batcher goes on
            raise RuntimeError("the engine call was interrupted (the step is stopping)") from self.err
        return self.out


def on_a_thread_of_its_own(call, *args, **kwargs):
    """`call(*args, **kwargs)` under no_grad on a new thread that ends when it returns: its result or error.
    Where an engine call runs when no thread hosts them (`Batcher.host`, the step's thread, is better still).

    Why: GNU OpenMP (torch's CPU threads) gives every thread that starts a parallel region a team of workers
    of its own, kept until that thread exits. Run on the batcher's long-lived thread, the engine's decode kept
    a second team beside the learner's, and with more OpenMP threads than CPUs GNU OpenMP lets an idle worker
    spin only ~100 times before it sleeps: every parallel op of the update then waited for its worker to wake.
    Measured on 2 cores (docs/agents.md, "Where the rest of the gap is"): the update's OpenMP worker ran
    66-74% of the update's time instead of ~99%, and the update took 0.59-0.78 s where the same batches took
    0.47-0.57 s with the engine's calls on a thread that exits. A thread costs ~0.1 ms; an engine call decodes
    a whole batch. (Grad mode is per thread too: the step's no_grad would not reach this one.)"""
    box: dict = {}

    def run() -> None:
        try:
            with torch.no_grad():
                box["out"] = call(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread as it is
            box["err"] = err

    thread = threading.Thread(target=run, name="grpo-gateway-engine-call", daemon=True)
    thread.start()
    thread.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def in_episode_order(jobs) -> list[Job]:
    """`jobs` by their episodes' order in the step (those without one last, as they arrived). Each row of an
    engine call draws its own random numbers by its place in the batch, so in arrival order what a row samples
    would hang on the agents' timing: a run's episodes, and with them its steps' work (whether an episode
    calls a tool twice, a third turn), differed from run to run of the same seed, while the in-process
    runners, which batch their episodes in order, repeat (gateway_concurrency.py's two clusters)."""
    return sorted(jobs, key=lambda j: (j.order is None, 0 if j.order is None else j.order))


def _is_final(job: Job, ids: list[int]) -> bool:
    if job.final is None:
        return False
    try:
        return bool(job.final(ids))
    except Exception as err:  # noqa: BLE001 - a reply that cannot be told is sent at once, never lost
        log.debug("Gateway: a reply could not be read for tool calls (%s); it is sent at once.", err)
        return False


def continuous(engine) -> bool:
    """The engine batches continuously itself: rows join at its next step (`add_row` / `step_rows`). Read on
    its class: a wrapper that forwards attributes (VersionedEngine, which stamps weight versions per call)
    is served by its own calls."""
    kind = type(engine)
    return callable(getattr(kind, "add_row", None)) and callable(getattr(kind, "step_rows", None))


def takes_on_step(method) -> bool:
    try:
        return "on_step" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def shared_prompts(rows: list[list[int]]) -> tuple[list[list[int]], int, list[int]]:
    """(distinct rows, n, order) when the rows are n > 1 copies of each distinct row (a step's first calls:
    a group's episodes send one prompt): row u·n + j of generate(distinct, n) answers job order[u·n + j].
    Else (rows, 1, identity)."""
    groups: dict[tuple, list[int]] = {}
    for k, ids in enumerate(rows):
        groups.setdefault(tuple(ids), []).append(k)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1 or (n := sizes.pop()) < 2:
        return rows, 1, list(range(len(rows)))
    return [list(key) for key in groups], n, [k for g in groups.values() for k in g]
