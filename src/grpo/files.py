"""Every file grpo writes goes through here: one place that refuses symbolic links and redacts secrets.

A run directory may come from someone else (copied, unpacked, shared). A link planted where the run
expects its own file (`run.lock -> ~/.bashrc`) must never make grpo write through it, so files are
opened with O_NOFOLLOW and a link is refused by name; so is a FIFO or device in a file's place. Text
passes through `grpo.redact.redact` on its way to disk, whatever wrote it.

Two kinds of write:
* `write_text` / `write_bytes`: a file the run owns (config.yaml, a report page, a manifest), written to a
  fresh temporary name and renamed over the old one, so a reader never sees half a file.
* `open_append` / `append_text`: a log the run appends to (metrics.jsonl, samples.jsonl, train.log).
Directories the run creates inside its run directory (report/, tensorboard/) go through `own_dir`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from grpo.config.errors import ConfigError
from grpo.redact import redact

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def refuse_link(path: str | os.PathLike) -> None:
    """ConfigError when `path` is a symbolic link (a run writes its own file or directory there)."""
    if os.path.islink(path):
        raise ConfigError(_link_message(path))


def _link_message(path) -> str:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return (
        f"{path} is a symbolic link{target} where grpo writes its own file; grpo does not write through "
        f"links, so nothing was written there. Remove the link (rm {path}) or pass another --output-dir."
    )


def open_fd(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """os.open that never follows a link in the last component and accepts only a regular file."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, mode)  # NONBLOCK: a planted FIFO cannot hang us
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise ConfigError(_link_message(path)) from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise ConfigError(_not_a_file_message(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(_not_a_file_message(path))
    os.set_blocking(fd, True)
    return fd


def nofollow_opener(path: str, flags: int) -> int:
    """For `open(path, mode, opener=nofollow_opener)`: the same refusals as `open_fd`."""
    return open_fd(path, flags)


def _not_a_file_message(path) -> str:
    return (
        f"{path} is not a regular file (a directory, FIFO or device) where grpo writes its own file; move it "
        "out of the way or pass another --output-dir."
    )


class _RedactingText:
    """A text file whose every write is redacted; the rest is the wrapped file's."""

    def __init__(self, fh):
        self._fh = fh

    def write(self, text: str) -> int:
        return self._fh.write(redact(text))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


def open_append(path: str | os.PathLike):
    """A text file opened for appending (created if missing); writes are redacted."""
    fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    return _RedactingText(os.fdopen(fd, "a", encoding="utf-8"))


def append_text(path: str | os.PathLike, text: str) -> None:
    with open_append(path) as fh:
        fh.write(text)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace a file the run owns, atomically: a fresh temporary file (O_EXCL, so nothing planted under
    its name is opened), fsynced, then renamed over `path`. A link at `path` is refused, never replaced."""
    path = Path(path)
    refuse_link(path)
    if path.exists() and not path.is_file():
        raise ConfigError(_not_a_file_message(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a killed process's leftover (a link there goes; its target stays)
    fd = open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """`write_bytes` for text, redacted."""
    write_bytes(path, redact(text).encode("utf-8"))


def own_dir(path: str | os.PathLike) -> Path:
    """A directory the run writes into (created if missing); a link or a file in its place is refused."""
    path = Path(path)
    refuse_link(path)
    path.mkdir(parents=True, exist_ok=True)
    refuse_link(path)  # created as a link between the check and mkdir
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory where grpo writes its own; move it out of the way.")
    return path


class LogFileHandler(logging.FileHandler):
    """logging.FileHandler whose file is opened through `open_append` (no links followed, text redacted)."""

    def _open(self):
        return open_append(self.baseFilename)
