"""One writer per run directory: a kernel lock (`flock`) on `RUN_DIR/run.lock`, held for the life of a run.

The kernel drops the lock when the process ends, however it ends (SIGKILL included), so there is no
stale pid file to clean up. The file's text says who holds it (pid, host, command, start time): only
so the refusal can name the other process; whether the lock is held is the kernel's answer alone.

Several processes of one run (torchrun ranks): rank 0 takes the lock and every rank learns whether it
got it, so either all of them go on or all stop with the same message. Other ranks write nothing into
the run directory except through rank 0 (checkpoints, logs), so they need no lock of their own.
Readers (`grpo eval`, `grpo report`) take no lock: checkpoints appear by an atomic rename and the
JSONL logs are read line by line, skipping a line that is still being written.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

from grpo.config import ConfigError

LOCK_FILE = "run.lock"


class RunLock:
    """`acquire()` takes the lock (or raises ConfigError naming the holder); `release()` lets it go."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(self.path)
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent} is in use by another grpo run ({holder}); two runs writing one "
                "directory would overwrite each other's checkpoints and logs. Wait for it to finish (or stop "
                f"it: kill {_pid(self.path) or 'PID'}, which saves a checkpoint), then --resume latest "
                "continues it; or pass another --output-dir."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return self

    def release(self) -> None:
        if self._fd is not None:
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
    lock: RunLock | NoLock = RunLock(run_dir) if is_main else NoLock()
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
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return wrapper


def _describe(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock file {path} does not say which process holds it"


def _pid(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
