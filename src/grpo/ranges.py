"""Where the math holds: the one range check every number from user input passes where it enters.

Config values (config/validate.py), reward values and their weighted sums (rewards/scoring.py), the
advantages and the learning rate a step uses (train.py, learner.py) all go through `check_range`, so a
value outside the range the arithmetic is good for stops the run with the value and where it came from,
instead of turning into loss 0 and grad 0 downstream (a reward of 1e20 squares to inf in float32, and
the group std of inf makes every advantage 0).
"""

from __future__ import annotations

import math
import numbers

# |reward| and |Σ w·r| at most this. Rewards are summed and standardised in float32: their squares must
# stay finite summed over a group (float32 overflows past 3.4e38, so |r| < ~1e18), and with
# advantage_scale=none they are the advantages themselves, whose squared gradients clip_grad_norm sums.
# 1e9 leaves that arithmetic room to spare while being far above any reward a task needs; a value past it
# is a bug (an unnormalised count, an overflow), not a signal.
REWARD_LIMIT = 1e9
# Counts (steps, sizes, lengths): a 64-bit tensor index, and far beyond any run.
INT_LIMIT = 2**62
# Time limits: a year. threading and datetime overflow on the floats beyond ~1e9 seconds.
MAX_SECONDS = 365 * 24 * 3600.0


class OutOfRangeError(ValueError):
    """A number outside the range where the math holds; the message names it, its value and the range."""


def check_range(
    value: object,
    what: str,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
    error: type[Exception] = OutOfRangeError,
) -> float:
    """`value` as a float when it is a finite real number in [low, high] (open ends when asked); else raise
    `error` saying `what` it is, the value, and the range. Python ints too large for a float (10**400)
    are out of range, not an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number, got {_shown(value)} ({type(value).__name__}).{_sep(hint)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if not math.isfinite(number) or too_low or too_high:
        raise error(
            f"{what} = {_shown(value)} is outside {_interval(low, high, low_open, high_open)}.{_sep(hint)}"
        )
    return number


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return "the finite numbers"
    left = "(" if low_open or low is None else "["
    right = ")" if high_open or high is None else "]"
    return f"{left}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}{right}"


def _shown(value: object) -> str:
    if isinstance(value, int) and value.bit_length() > 128:  # repr of a huge int is slow, or refused
        return f"an integer of {value.bit_length()} bits (about 10**{int(value.bit_length() * 0.30103)})"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}…{text[-8:]} ({len(text)} characters)"


def _sep(hint: str) -> str:
    return f" {hint}" if hint else ""
