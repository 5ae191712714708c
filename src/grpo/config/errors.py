"""The errors a configuration raises; a leaf, so that every config module (and its callers) can import it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""


class TRLConfigError(ConfigError):
    """A TRL setting this package cannot honour; the message says why and what to do instead."""


def clause(error: BaseException | str) -> str:
    """An error's message as a clause of a longer sentence: without its own final period, which would
    double before the sentence's next words ("… unreachable.. Nothing …")."""
    return str(error).rstrip().rstrip(".")
