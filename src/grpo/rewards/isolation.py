"""Running a user's reward function where it can be stopped: a forked child process per call.

Which calls (algorithm.reward_isolation): `auto` (the default) forks for functions the config names by
import path (`--reward-funcs my_pkg.rewards:fn`), and calls a function or object handed over in Python
(`GRPOTrainer(reward_funcs=[fn])`) in-process, where the caller may be watching its state, as TRL does;
`process` forks for every user function; `thread` for none.

A reward stuck in C code that holds the GIL (a catastrophic regex, a hung verifier) stops every Python
thread of its process: no time limit and no signal handler can run there. In a forked child the trainer
stays free: it waits on a pipe, kills the child at `timeout`, and reacts to SIGINT/SIGTERM while it
waits. Forking copies the trainer's memory, so closures, lambdas and objects work unpickled, and what the
function sees is exactly what an in-process call would see; what it *changes* (a counter in a closure, a
global) stays in the child. `log_metric` calls are sent back. A function that needs its state kept runs
in-process with `algorithm.reward_isolation=thread` (no hard stop for code stuck in C).

The cost is one fork per call (docs/rewards.md has the measurement); the result comes back pickled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import warnings
from collections.abc import Callable

ISOLATIONS = ("auto", "process", "thread")
_BY_PATH = "__grpo_named_by_path__"
# After a first SIGINT/SIGTERM, a running reward call gets this long to finish its step before it is
# killed and the run stops at the last complete step.
STOP_GRACE_S = 5.0
_POLL_S = 0.05
_interrupted = threading.Event()
# A message between the trainer and a child: its length (8 bytes, little-endian), then a pickle. The reader
# stops at the last byte, not at end-of-file: a grandchild the user's code forked may hold the pipe open.
_HEADER = struct.Struct("<Q")


class RewardInterrupted(BaseException):
    """A stop signal arrived while user code ran (a reward, a tool, an environment method), and the call did
    not finish within STOP_GRACE_S. A BaseException, as KeyboardInterrupt is: code that turns a user's
    exception into a message (`except Exception`) must let the stop through to the training loop."""


def can_fork() -> bool:
    return hasattr(os, "fork") and sys.platform != "darwin"  # macOS: fork after threads is unsafe


def mark_named_by_path(fn: Callable) -> None:
    """Record that `fn` was loaded from an import path in the config (`module:function`): nothing outside
    holds it, so under reward_isolation=auto it runs in a child process."""
    with contextlib.suppress(AttributeError, TypeError):  # a builtin or a slotted object: runs in-process
        setattr(fn, _BY_PATH, True)


def isolated(fn: Callable, isolation: str) -> bool:
    """Whether a call of the user's `fn` runs in a child process under `isolation`."""
    if not can_fork() or isolation == "thread":
        return False
    return isolation == "process" or getattr(fn, _BY_PATH, False) is True


def request_stop() -> None:
    """Called from the trainer's signal handler: a waiting call gets STOP_GRACE_S more, then is killed."""
    _interrupted.set()


def clear_stop() -> None:
    _interrupted.clear()


def stop_requested() -> bool:
    """Whether the trainer got SIGINT/SIGTERM (agents through the gateway get STOP_GRACE_S too)."""
    return _interrupted.is_set()


class ChildDied(RuntimeError):
    """The reward's process ended without an answer (killed, crashed, or it called os._exit)."""


class Unpicklable:
    """What a function returned when it cannot be sent back (a generator, an open file): its type name."""

    def __init__(self, type_name: str):
        self.type_name = type_name


def call_in_child(fn: Callable, kwargs: dict, timeout: float | None) -> tuple[str, object]:
    """("value", result) or ("error", exception) of `fn(**kwargs)` run in a forked child; a call past
    `timeout` seconds is killed and answers ("error", TimeoutError). Raises RewardInterrupted when a stop
    signal came and the call outlived the grace period."""
    relay = kwargs.get("log_metric")
    read_fd, write_fd = os.pipe()
    with (
        warnings.catch_warnings()
    ):  # 3.12+ warns about fork with threads; the child touches no locks of theirs
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        _child(fn, kwargs, write_fd)
    os.close(write_fd)
    try:
        data = read_frame(read_fd, timeout, "a reward call")
    except BaseException:
        _kill(pid)
        raise
    finally:
        os.close(read_fd)
    if data is None:
        _kill(pid)
        return "error", TimeoutError(f"no result after {timeout:g} s (its process was killed)")
    _, status = os.waitpid(pid, 0)
    if not data:
        return "error", ChildDied(_how_it_ended(status))
    kind, value, logged = pickle.loads(data)
    if relay is not None:
        for name, number in logged:
            relay(name, number)
    return kind, value


def stop_overdue(since: list[float | None], what: str) -> None:
    """Raise RewardInterrupted once a stop signal is STOP_GRACE_S old. `since[0]` holds when this waiter
    first saw it (None before)."""
    if _interrupted.is_set() and since[0] is None:
        since[0] = time.monotonic()
    if since[0] is not None and time.monotonic() - since[0] > STOP_GRACE_S:
        raise RewardInterrupted(f"{what} still ran {STOP_GRACE_S:g} s after the stop signal")


def read_frame(fd: int, timeout: float | None, what: str) -> bytes | None:
    """One message from a child (see _HEADER), as soon as its last byte is in: b"" when the child closed the
    pipe (died) before it was complete, None at the deadline. Raises RewardInterrupted (see stop_overdue)."""
    data, start, since = bytearray(), time.monotonic(), [None]
    while True:
        if len(data) >= _HEADER.size and len(data) >= _HEADER.size + _HEADER.unpack_from(data)[0]:
            return bytes(data[_HEADER.size :])
        stop_overdue(since, what)
        if timeout is not None and time.monotonic() - start > timeout:
            return None
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([fd], [], [], _POLL_S)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return b""
                data += chunk


def write_frame(fd: int, payload: bytes) -> None:
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


def _child(fn: Callable, kwargs: dict, write_fd: int) -> None:
    code = 0
    try:
        _die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM):  # the trainer's handlers are not this process's
            signal.signal(sig, signal.SIG_DFL)
        if (
            "torch" in sys.modules
        ):  # the parent's thread pool did not survive the fork (as DataLoader workers)
            sys.modules["torch"].set_num_threads(1)
        logged: list[tuple[str, float]] = []
        if "log_metric" in kwargs:
            kwargs["log_metric"] = lambda name, value: logged.append((str(name), float(value)))
        try:
            payload = _packed("value", fn(**kwargs), logged)
        except BaseException as error:  # noqa: BLE001 (reported by the parent, SystemExit included)
            payload = _packed("error", error, logged)
        write_frame(write_fd, payload)
    except BaseException:  # noqa: BLE001 (the parent reports a silent death; nothing may escape the fork)
        code = 1
    finally:
        os._exit(code)


def _packed(kind: str, value: object, logged: list) -> bytes:
    try:
        return pickle.dumps((kind, value, logged))
    except Exception:  # noqa: BLE001 (anything unpicklable: say what it was instead)
        if kind == "error":
            error = RuntimeError(f"{type(value).__name__}: {value}")
            return pickle.dumps((kind, error, logged))
        if isinstance(value, list | tuple):  # a list holding something unpicklable: name the first one
            bad = next((v for v in value if not _picklable(v)), value)
            return pickle.dumps((kind, [Unpicklable(type(bad).__name__)] * len(value), logged))
        return pickle.dumps((kind, Unpicklable(type(value).__name__), logged))


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True


def _die_with_parent() -> None:
    """Linux: the kernel kills this child when the trainer dies, however it dies (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"its process was killed by signal {os.WTERMSIG(status)} before it returned"
    return f"its process exited with code {os.waitstatus_to_exitcode(status)} before it returned"
