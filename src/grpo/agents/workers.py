"""User code in an episode (tools, environment methods) run where it can be stopped: in worker processes.

A reward function runs in a forked child per call (rewards/isolation.py). An environment instance holds
state across an episode's calls, so it lives in its own worker process for as long as its episode slot
does: the trainer forks the worker once, the worker makes the instance (`environment_factory()`), and every
call (`reset`, a tool method, `step`, `get_reward`, `close`, an attribute read) is a message to it with a
deadline. Stateless tools (`tools=[fn]`) run in a small pool of such workers, reused call after call.

What that guarantees, as for rewards (the trainer never runs the user's code itself):
- a time limit that holds when the code holds the GIL or sits in C (a catastrophic regex): at the deadline
  the worker is killed (SIGKILL) and the call raises CallTimedOut;
- a stop signal (SIGINT/SIGTERM) ends a waiting call within STOP_GRACE_S: the worker is killed and the
  call raises RewardInterrupted, so the loop drops the step and saves the checkpoint;
- `os._exit` or a crash in user code raises WorkerDied saying how the process ended;
- an answer is read as soon as its last byte is in (a grandchild holding the pipe changes nothing).
A killed environment worker takes its instance with it: later calls raise WorkerDied until the next
`reset`, which starts a fresh worker (a new instance, as the factory makes it).

`remote_class(cls, make)` is a stand-in class with the user's class's name, methods (signatures and
docstrings, so tool schemas are unchanged) and attributes, whose instances forward every call to their
worker; `remote_tools(functions)` does the same for plain tool functions. Forking copies the trainer's
memory, so closures and classes defined anywhere work without pickling; arguments and results are
pickled (an unpicklable result is replaced by its type name, rewards/isolation.Unpicklable).

The cost: one fork per worker (once per episode slot), then ~0.1 ms per call (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import functools
import inspect
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from grpo.rewards.isolation import (
    ChildDied,
    RewardInterrupted,
    _die_with_parent,
    _how_it_ended,
    _packed,
    can_fork,
    read_frame,
    write_frame,
)

log = logging.getLogger("grpo")

__all__ = ["CallTimedOut", "Worker", "WorkerDied", "can_fork", "remote_class", "remote_tools"]


class WorkerDied(ChildDied):
    """The worker process ended without an answer (os._exit, a crash, a kill), or ended earlier."""


class CallTimedOut(TimeoutError):
    """The call ran past its limit; its worker was killed."""


def _serve(make: Callable[[], Any], requests: int, answers: int) -> None:
    """The worker's life: make the target, then answer requests until the trainer closes the pipe."""
    code = 0
    try:
        _die_with_parent()
        # Ctrl-C reaches the whole process group: the trainer decides when a call ends, not the terminal.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if "torch" in sys.modules:  # the parent's thread pool did not survive the fork
            sys.modules["torch"].set_num_threads(1)
        try:
            target, reply = make(), ("value", None)
        except BaseException as err:  # noqa: BLE001 - the trainer reports it
            target, reply = None, ("error", err)
        write_frame(answers, _packed(*reply, []))
        if reply[0] == "error":
            return
        while True:
            message = read_frame(requests, None, "a worker")
            if not message:
                return  # the trainer closed the pipe (or died)
            op, name, args, kwargs = pickle.loads(message)
            try:
                reply = ("value", _run(target, op, name, args, kwargs))
            except BaseException as err:  # noqa: BLE001 - whatever user code raises (SystemExit too)
                reply = ("error", err)
            write_frame(answers, _packed(*reply, []))
    except BaseException:  # noqa: BLE001 - nothing may escape the fork
        code = 1
    finally:
        os._exit(code)


_CALLABLE = "__grpo_callable__"  # an attribute read that found a method: the stand-in makes a forwarder


def _run(target: Any, op: str, name: str, args: tuple, kwargs: dict) -> Any:
    if op == "get":
        value = getattr(target, name)
        return _CALLABLE if callable(value) and not isinstance(value, type) else value
    fn = target[name] if isinstance(target, dict) else getattr(target, name)
    value = fn(*args, **kwargs)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return value


async def _awaited(value: Any) -> Any:
    return await value


# Workers are forked by one long-lived thread: the kernel's parent-death signal (PR_SET_PDEATHSIG, which
# kills a worker when the trainer dies, SIGKILL included) fires when the *thread* that forked it ends, and a
# tool call's thread ends with the call.
_fork_requests: queue.SimpleQueue = queue.SimpleQueue()
_forker: threading.Thread | None = None
_forker_lock = threading.Lock()
_open_fds: set[int] = set()  # every live worker's pipe ends in the trainer: a new worker closes its copies


def _fork(make: Callable[[], Any]) -> tuple[int, int, int]:
    global _forker
    with _forker_lock:
        if _forker is None or not _forker.is_alive():
            _forker = threading.Thread(target=_forking, name="grpo-worker-forker", daemon=True)
            _forker.start()
    answer: queue.SimpleQueue = queue.SimpleQueue()
    _fork_requests.put((make, answer))
    result = answer.get()
    if isinstance(result, BaseException):
        raise result
    return result


def _forking() -> None:
    while True:
        make, answer = _fork_requests.get()
        try:
            answer.put(_fork_now(make))
        except BaseException as err:  # noqa: BLE001 - handed to the caller (e.g. out of processes)
            answer.put(err)


def _fork_now(make: Callable[[], Any]) -> tuple[int, int, int]:
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    with warnings.catch_warnings():  # 3.12+ warns about fork with threads; the child takes no lock of theirs
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        # Other workers' pipe ends stay with the trainer: a copy here would keep their pipes open.
        for fd in (*_open_fds, requests_w, answers_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        _serve(make, requests_r, answers_w)
    os.close(requests_r)
    os.close(answers_w)
    _open_fds.update((requests_w, answers_r))
    return pid, requests_w, answers_r


class Worker:
    """One forked process holding `make()`'s result; `call` runs a method (or, for a dict, a function) of it.

    One call at a time (a lock serialises callers). `timeout`: each call's limit in seconds (None: none);
    `what`: how errors name the target ("Counter", "tool calculator")."""

    def __init__(self, make: Callable[[], Any], timeout: float | None, what: str) -> None:
        self.timeout, self.what = timeout, what
        self._lock = threading.Lock()
        self.pid: int | None = None
        pid, requests_w, answers_r = _fork(make)
        self.pid, self._requests, self._answers = pid, requests_w, answers_r
        self._finalizer = weakref.finalize(self, _end, pid, requests_w, answers_r)
        self._answer(f"making {what}")  # raises what the factory raised

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def call(
        self,
        name: str,
        args: tuple = (),
        kwargs: dict | None = None,
        op: str = "call",
        timeout: float | None = None,
    ) -> Any:
        """`name(*args, **kwargs)` on the target, within `timeout` (default: the worker's)."""
        with self._lock:
            if self.pid is None:
                raise WorkerDied(f"{self.what}'s process has ended")
            try:
                write_frame(self._requests, pickle.dumps((op, name, args, kwargs or {})))
            except (BrokenPipeError, pickle.PicklingError, TypeError, AttributeError) as err:
                if isinstance(err, BrokenPipeError):
                    self._died(f"{name}: ")
                raise TypeError(f"the arguments of {name} cannot be sent to its process ({err})") from None
            return self._answer(name, timeout or self.timeout)

    def _answer(self, name: str, timeout: float | None = None) -> Any:
        timeout = timeout or self.timeout
        try:
            data = read_frame(self._answers, timeout, f"{self.what}: {name}")
        except RewardInterrupted:
            self.close()
            raise
        if data is None:
            self.close()
            raise CallTimedOut(f"{name} did not finish within {timeout:g} s (its process was killed)")
        if not data:
            self._died(f"{name}: ")
        kind, value, _ = pickle.loads(data)
        if kind == "error":
            raise value
        return value

    def _died(self, prefix: str) -> None:
        pid = self.pid
        self.close(kill=False)
        status = _reap(pid)
        how = _how_it_ended(status) if status is not None else "its process ended before it returned"
        raise WorkerDied(f"{prefix}{how}")

    def close(self, kill: bool = True) -> None:
        """End the process now (SIGKILL; the user's close() is a call made before this)."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        self._finalizer.detach()
        _end(pid, self._requests, self._answers, kill)


def _reap(pid: int | None) -> int | None:
    if pid is None:
        return None
    with contextlib.suppress(ChildProcessError):
        return os.waitpid(pid, 0)[1]
    return None


def _end(pid: int, requests: int, answers: int, kill: bool = True) -> None:
    _open_fds.difference_update((requests, answers))
    for fd in (requests, answers):
        with contextlib.suppress(OSError):
            os.close(fd)
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _reap(pid)


# -- environment instances ------------------------------------------------------------------------------
# reset/step/get_reward/close get at least this long (a reset may start a container); tool methods get
# env.tool_timeout_s.
LIFECYCLE_TIMEOUT_S = 60.0
_LIFECYCLE = {"reset", "step", "get_reward", "close", "cleanup"}


class _RemoteMeta(type):
    """The stand-in classes' type: they pickle as the recipe that makes them (Ray actors get factories)."""


class _Remote(metaclass=_RemoteMeta):
    """Base of the stand-in classes remote_class makes (see the module docstring)."""

    _make: Callable[[], Any]
    _timeout: float | None

    def __init__(self) -> None:
        object.__setattr__(self, "_worker", None)
        object.__setattr__(self, "_gone", None)  # why the last worker ended, until the next reset
        self._start()

    def _start(self) -> None:
        worker = Worker(type(self)._make, type(self)._timeout, type(self).__name__)
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "_gone", None)

    def _call(self, name: str, args: tuple, kwargs: dict, op: str = "call") -> Any:
        if self._worker is None or not self._worker.alive:
            if name in ("get_reward", "close", "cleanup") and op == "call":
                # The episode's state went with its process: no reward to give (None: not scored), and
                # nothing left to close.
                log.warning("%s.%s(): its process ended earlier (%s).", type(self).__name__, name, self._gone)
                return None
            if name != "reset":
                raise WorkerDied(
                    f"{type(self).__name__}'s process ended earlier ({self._gone}); its state is gone "
                    "until the next episode's reset"
                )
            self._start()
        # A tool method or an attribute read: the worker's own limit (env.tool_timeout_s).
        limit = max(LIFECYCLE_TIMEOUT_S, self._timeout or 0) if name in _LIFECYCLE and op == "call" else None
        try:
            return self._worker.call(name, args, kwargs, op, timeout=limit)
        except (WorkerDied, CallTimedOut) as err:
            object.__setattr__(self, "_gone", str(err))
            raise

    def __getattr__(self, name: str) -> Any:  # an attribute the class does not define: the instance's own
        if name.startswith("__") or name in ("_worker", "_gone"):
            raise AttributeError(name)
        value = self._call(name, (), {}, op="get")
        if isinstance(value, str) and value == _CALLABLE:
            return lambda *args, **kwargs: self._call(name, args, kwargs)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__} runs in its own process (reward_isolation): set {name} inside its methods"
        )

    def _end(self) -> None:
        if self._worker is not None:
            self._worker.close()


def end_worker(instance: Any) -> None:
    """End the worker process of a remote_class instance (no-op for anything else)."""
    if isinstance(instance, _Remote):
        instance._end()


def _method(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        return self._call(name, args, kwargs)

    return forward


def remote_class(cls: type, make: Callable[[], Any] | None = None, timeout: float | None = None) -> type:
    """A stand-in for `cls` whose instances each hold one `make()` (default: `cls()`) in a worker process."""
    methods = {
        name: _method(name, member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not (name.startswith("__") and name.endswith("__"))
    }
    namespace = {
        **methods,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_make": staticmethod(make or cls),
        "_timeout": timeout,
        "user_class": cls,
    }
    return _RemoteMeta(cls.__name__, (_Remote,), namespace)


# -- stateless tools ------------------------------------------------------------------------------------
class _Pool:
    """Workers holding the tool functions. A call takes an idle worker; when none is idle it waits a moment
    for one (a fast tool is answered by a few workers, as forking one costs ~10-70 ms) before forking
    another (a slow tool gets one per concurrent call)."""

    WAIT_S = 0.02

    def __init__(self, functions: dict[str, Callable], timeout: float | None) -> None:
        self.functions, self.timeout = functions, timeout
        self._idle: list[Worker] = []
        self._ready = threading.Condition()

    def call(self, name: str, kwargs: dict) -> Any:
        worker = self._take()
        if worker is None:
            worker = Worker(lambda: self.functions, self.timeout, f"tool {name}")
        try:
            value = worker.call(name, (), kwargs)
        except (WorkerDied, CallTimedOut, RewardInterrupted):
            raise  # that worker is gone; a later call forks another
        except BaseException:
            self._give_back(worker)
            raise
        self._give_back(worker)
        return value

    def __reduce__(self) -> tuple:  # a copy sent to a Ray rollout actor forks its own workers there
        return _Pool, (self.functions, self.timeout)

    def _take(self) -> Worker | None:
        with self._ready:
            if not self._idle:
                self._ready.wait(self.WAIT_S)
            return self._idle.pop() if self._idle else None

    def _give_back(self, worker: Worker) -> None:
        if worker.alive:
            with self._ready:
                self._idle.append(worker)
                self._ready.notify()

    def close(self) -> None:
        with self._ready:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


def remote_tools(functions: dict[str, Callable], timeout: float | None) -> dict[str, Callable]:
    """Stand-ins for `functions` (same names, signatures and docstrings) that run in a pool of workers."""
    pool = _Pool(dict(functions), timeout)

    def forwarder(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def forward(**kwargs):
            return pool.call(name, kwargs)

        forward.__grpo_pool__ = pool
        return forward

    return {name: forwarder(name, fn) for name, fn in functions.items()}


# -- where the run's user code is chosen ------------------------------------------------------------------
def _remote_meta_reduce(cls: type) -> tuple | str:
    if cls is _Remote:
        return "_Remote"  # the base itself: by name
    return remote_class, (cls.user_class, cls._make, cls._timeout)


def isolate_factory(
    factory: Any, tool_specs: list, environment_spec: Any, isolation: str, timeout: float
) -> None:
    """Move the user code of an EnvironmentFactory into workers, in place, under `isolation` (the rule of
    rewards/isolation.isolated: `auto` isolates what the config named by import path, `process` all, `thread`
    none). `tool_specs` / `environment_spec`: what the factory was built from (strings are import paths)."""
    if not can_fork() or isolation == "thread":
        return
    by_path = isolation == "process"
    chosen = [by_path or isinstance(spec, str) for spec in tool_specs or []]
    names = list(factory.fixed_tools)
    tools = {name: factory.fixed_tools[name] for name, pick in zip(names, chosen, strict=False) if pick}
    if tools:
        factory.fixed_tools.update(remote_tools(tools, timeout))
    moved = list(tools)
    specs = environment_spec if isinstance(environment_spec, dict) else {None: environment_spec}
    for key, maker in list(factory.factories.items()):
        if not (by_path or isinstance(specs.get(key), str)):
            continue
        cls = getattr(factory, "classes", {}).get(key) or (maker if inspect.isclass(maker) else None)
        if cls is None:
            continue  # a factory function whose class is not known: it stays in-process
        factory.factories[key] = remote_class(cls, make=maker, timeout=timeout)
        moved.append(cls.__name__)
        for instance in factory._pool.pop(key, []):  # made in-process to check the form: made again there
            with contextlib.suppress(Exception):
                for hook in ("close", "cleanup"):
                    if callable(getattr(instance, hook, None)):
                        getattr(instance, hook)()
                        break
    if moved:
        log.info(
            "User code in worker processes (algorithm.reward_isolation=%s; limit %g s a call): %s.",
            isolation,
            timeout,
            ", ".join(moved),
        )


copyreg.pickle(_RemoteMeta, _remote_meta_reduce)
