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
import functools
import inspect
import os
import pickle
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


class Worker:
    """One forked process holding `make()`'s result; `call` runs a method (or, for a dict, a function) of it.

    One call at a time (a lock serialises callers). `timeout`: each call's limit in seconds (None: none);
    `what`: how errors name the target ("Counter", "tool calculator")."""

    def __init__(self, make: Callable[[], Any], timeout: float | None, what: str) -> None:
        self.timeout, self.what = timeout, what
        self._lock = threading.Lock()
        self.pid: int | None = None
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        with (
            warnings.catch_warnings()
        ):  # 3.12+ warns about fork with threads; the child takes no lock of theirs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(requests_w)
            os.close(answers_r)
            _serve(make, requests_r, answers_w)
        os.close(requests_r)
        os.close(answers_w)
        self.pid, self._requests, self._answers = pid, requests_w, answers_r
        self._finalizer = weakref.finalize(self, _end, pid, requests_w, answers_r)
        self._answer(f"making {what}")  # raises what the factory raised

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None, op: str = "call") -> Any:
        with self._lock:
            if self.pid is None:
                raise WorkerDied(f"{self.what}'s process has ended")
            try:
                write_frame(self._requests, pickle.dumps((op, name, args, kwargs or {})))
            except (BrokenPipeError, pickle.PicklingError, TypeError, AttributeError) as err:
                if isinstance(err, BrokenPipeError):
                    self._died(f"{name}: ")
                raise TypeError(f"the arguments of {name} cannot be sent to its process ({err})") from None
            return self._answer(name)

    def _answer(self, name: str) -> Any:
        try:
            data = read_frame(self._answers, self.timeout, f"{self.what}: {name}")
        except RewardInterrupted:
            self.close()
            raise
        if data is None:
            self.close()
            raise CallTimedOut(f"{name} did not finish within {self.timeout:g} s (its process was killed)")
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
    for fd in (requests, answers):
        with contextlib.suppress(OSError):
            os.close(fd)
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _reap(pid)


# -- environment instances ------------------------------------------------------------------------------
class _Remote:
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
            if name != "reset":
                raise WorkerDied(
                    f"{type(self).__name__}'s process ended earlier ({self._gone}); its state is gone "
                    "until the next episode's reset"
                )
            self._start()
        try:
            return self._worker.call(name, args, kwargs, op)
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
    return type(cls.__name__, (_Remote,), namespace)


# -- stateless tools ------------------------------------------------------------------------------------
class _Pool:
    """Workers holding the tool functions; a call takes an idle one or forks another."""

    def __init__(self, functions: dict[str, Callable], timeout: float | None) -> None:
        self.functions, self.timeout = functions, timeout
        self._idle: list[Worker] = []
        self._lock = threading.Lock()

    def call(self, name: str, kwargs: dict) -> Any:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = Worker(lambda: self.functions, self.timeout, f"tool {name}")
        try:
            value = worker.call(name, (), kwargs)
        except (WorkerDied, CallTimedOut, RewardInterrupted):
            raise  # that worker is gone; the next call forks another
        except BaseException:
            self._give_back(worker)
            raise
        self._give_back(worker)
        return value

    def _give_back(self, worker: Worker) -> None:
        if worker.alive:
            with self._lock:
                self._idle.append(worker)

    def close(self) -> None:
        with self._lock:
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
