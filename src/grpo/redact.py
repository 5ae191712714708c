"""Keeping secrets (the HF token, any `*_token` / `*_key` / `*_secret` / `*password` value) out of
everything a run writes or prints: logs, the saved config, metrics, reports and error messages.

Config dumps replace secret fields with `<redacted>` (`GRPOConfig.to_dict`). Free text — a log line,
an exception from a library that echoes its arguments — goes through `redact`, which replaces every
secret value this process knows of: the secret config fields, and environment variables whose names
look secret (HF_TOKEN, WANDB_API_KEY, ...).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

REDACTED = "<redacted>"
SECRET_SUFFIXES = ("_token", "_key", "_secret", "password")
MIN_SECRET_LENGTH = 6  # shorter values ("1", "true") would redact ordinary text

_known: set[str] = set()


def is_secret(key: str) -> bool:
    return key.lower().lstrip("-").replace("-", "_").endswith(SECRET_SUFFIXES)


def remember(values: Iterable[object]) -> None:
    """Add secret values (e.g. from the config) to those `redact` removes, for this process's lifetime."""
    _known.update(str(v) for v in values if v is not None and len(str(v)) >= MIN_SECRET_LENGTH)


def remember_from_argv(argv: list[str]) -> None:
    """Remember the values given to secret-looking flags (`--hf_access_token X`, `--x-token=X`,
    `model.hf_token=X`) before anything parses them, so even a usage error cannot echo them."""
    for i, arg in enumerate(argv):
        key, sep, value = arg.partition("=")
        if is_secret(key):
            remember([value] if sep else argv[i + 1 : i + 2])


def redact_argv(argv: list[str]) -> list[str]:
    """A command line safe to write down (a lock file, a process listing): the value of every
    secret-looking flag or assignment masked whether or not this process has seen it before, and
    every known secret redacted from the rest."""
    out = []
    for i, arg in enumerate(argv):
        key, sep, _ = arg.partition("=")
        if sep and is_secret(key):
            out.append(f"{key}={REDACTED}")
        elif i and is_secret(argv[i - 1]) and argv[i - 1].startswith("-") and "=" not in argv[i - 1]:
            out.append(REDACTED)
        else:
            out.append(redact(arg))
    return out


@contextmanager
def argv_redacted() -> Iterator[None]:
    """sys.argv with its secrets masked while a library copies the command line into its own files (W&B's
    run metadata, Ray's job table and session logs)."""
    argv, sys.argv = sys.argv, redact_argv(sys.argv)
    try:
        yield
    finally:
        sys.argv = argv


def secrets() -> list[str]:
    from_env = {v for k, v in os.environ.items() if is_secret(k) and len(v) >= MIN_SECRET_LENGTH}
    return sorted(_known | from_env, key=len, reverse=True)  # longest first: no partial leftovers


def redact(text: str) -> str:
    for value in secrets():
        text = text.replace(value, REDACTED)
    return text


def redact_mapping(mapping: dict) -> dict:
    """A copy with the values of secret-looking keys replaced, e.g. for logging CLI overrides."""
    return {k: (REDACTED if is_secret(str(k)) and v else v) for k, v in mapping.items()}


class RedactingFilter(logging.Filter):
    """Put on a handler: the formatted message (arguments and exception text included) is redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
            record.exc_info = record.exc_text = None
        record.msg, record.args = redact(message), None
        return True
