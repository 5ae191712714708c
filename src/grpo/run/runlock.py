"""One writer per run directory: a kernel lock (`flock`) on `RUN_DIR/run.lock`, held for the life of a run.

The kernel drops the lock when the process ends, however it ends (SIGKILL included), so there is no
stale pid file to clean up. The file's text says who holds it (pid, host, command with secrets masked,
start time): only so the refusal can name the other process; whether the lock is held is the kernel's
answer alone. A process forked by user code (a reward's multiprocessing helper) does not keep the lock:
the forked child closes its copy of the descriptor at once, so the lock dies with the run. Should a
holder outlive the process the file names anyway (a fork from C code), the refusal names the live
processes that hold the file open.

Several processes of one run (torchrun ranks): rank 0 takes the lock and every rank learns whether it
got it, so either all of them go on or all stop with the same message. Other ranks write nothing into
the run directory except through rank 0 (checkpoints, logs), so they need no lock of their own.
Readers (`grpo eval`, `grpo report`) take no lock: checkpoints appear by an atomic rename and the
JSONL logs are read line by line, skipping a line that is still being written.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from grpo.config import ConfigError
from grpo.files import open_fd
from grpo.redact import redact_argv
from grpo.run.console import resume_hint

LOCK_FILE = "run.lock"
_held_fds: set[int] = set()  # every lock this process holds, closed in forked children
_holders: dict[str, RunLock] = {}  # lock file (real path) -> the RunLock of this process that holds it

log = logging.getLogger("grpo")


def _drop_inherited_locks() -> None:
    for fd in _held_fds:
        with contextlib.suppress(OSError):
            os.close(fd)  # the parent's descriptor still holds the flock; this copy no longer does
    _held_fds.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class RunLock:
    """`acquire()` takes the lock (or raises ConfigError naming the holder); `release()` lets it go.

    The lock keeps other processes out. Within one process it passes to the trainer that asks last (a
    notebook cell that builds a GRPOTrainer again over the same output_dir, the old one still referenced),
    unless the holder is `busy` (its train() is running, on another thread)."""

    def __init__(self, run_dir: Path, shared_in_process: bool = False):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        self.busy = False  # set while the holder's train() runs (holding_run_lock)
        self.shared_in_process = shared_in_process  # a trainer's lock: another trainer here may take it

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        self._take_over()
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)  # a planted link is refused, its target untouched
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder, pid = _describe(self.path, fd)
            os.close(fd)
            stop = (
                f" (or stop it: kill {pid or 'PID'}, which saves a checkpoint)" if pid != os.getpid() else ""
            )  # never advice to kill the process that reads it
            raise ConfigError(
                f"{self.path.parent} is in use by another grpo run ({holder}); two runs writing one "
                f"directory would overwrite each other's checkpoints and logs. Wait for it to finish{stop}, "
                f"then resume it ({resume_hint(self.path.parent)}); or pass another output directory."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _held_fds.add(fd)
        self._key = os.path.realpath(self.path)
        _holders[self._key] = self
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(redact_argv(sys.argv)),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return self

    def _take_over(self) -> None:
        """From another trainer of this process that holds this run directory, unless it is training."""
        other = _holders.get(os.path.realpath(self.path))
        if other is None or other is self or other._fd is None:
            return
        if not (self.shared_in_process and other.shared_in_process):
            return  # not two trainers' locks: refused below like another process's
        if other.busy:
            raise ConfigError(
                f"{self.path.parent} is in use by another GRPOTrainer of this process, whose train() is "
                "running (on another thread). Wait for it to return, or pass another output_dir."
            )
        other.release()
        log.info("%s: taken over from an earlier GRPOTrainer of this process.", self.path.parent)

    def release(self) -> None:
        if self._fd is not None:
            if _holders is not None and _holders.get(self._key) is self:  # None: interpreter shutdown
                del _holders[self._key]
            if _held_fds is not None:
                _held_fds.discard(self._fd)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self):
        self.release()


class NoLock:
    """What ranks other than 0 hold: nothing (rank 0 holds the run's lock for all of them)."""

    held = True

    def acquire(self) -> NoLock:
        return self

    def release(self) -> None:
        pass


def lock_run_dir(run_dir: Path, rt=None) -> RunLock | NoLock:
    """Rank 0 (or the only process) locks `run_dir`; with several processes every rank raises the same
    ConfigError when rank 0 could not, so none of them goes on alone."""
    is_main = rt is None or rt.is_main
    lock: RunLock | NoLock = RunLock(run_dir, shared_in_process=True) if is_main else NoLock()
    error = None
    try:
        lock.acquire()
    except ConfigError as e:
        error = e
    if rt is not None and rt.active and rt.any(error is not None):
        raise error or ConfigError(
            f"{run_dir} is in use by another grpo run (rank 0 could not lock "
            f"{Path(run_dir) / LOCK_FILE}; its message says which)."
        )
    if error is not None:
        raise error
    return lock


def holding_run_lock(method):
    """Wrap GRPOTrainer.train: the lock taken at construction is held until train() returns or raises
    (taken again if an earlier train() of the same trainer let it go)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        lock = self.parts.lock
        lock.acquire()
        lock.busy = True
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.busy = False
            lock.release()

    return wrapper


def _describe(path: Path, fd: int) -> tuple[str, int | None]:
    """Who holds the lock, as the refusal says it, and the pid to stop. The file names the process that
    took the lock; if that one is gone (or the file says nothing), the live processes holding the lock
    file open are named instead, read from /proc."""
    try:
        info = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8"))
        pid = int(info["pid"])
        named = f"pid {pid} on {info['host']}, started {info['started']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        pid, named = None, None
    if pid is not None and (info.get("host") != socket.gethostname() or _alive(pid)):
        return named, pid
    holders = _processes_holding(fd)
    if holders:
        who = ", ".join(f"pid {p}: {command}" for p, command in holders)
        gone = f"pid {pid}, which took it, has ended; " if pid is not None else ""
        return f"{gone}held by {who}", holders[0][0]
    if named:
        return named, pid
    return f"its lock file {path} does not say which process holds it", None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _processes_holding(fd: int) -> list[tuple[int, str]]:
    """(pid, command line with secrets masked) of every other process with the lock file open."""
    target = os.fstat(fd)
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    except OSError:
        return []
    for pid in sorted(pids):
        try:
            for entry in os.listdir(f"/proc/{pid}/fd"):
                st = os.stat(f"/proc/{pid}/fd/{entry}")
                if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        argv = fh.read().decode("utf-8", "replace").split("\0")
                    found.append((pid, " ".join(redact_argv([a for a in argv if a]))))
                    break
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return found
