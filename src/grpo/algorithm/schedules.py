"""Learning-rate schedules: a multiplier of the peak rate per optimizer step, linear warmup first.

Each LR_SCHEDULES entry maps progress p ∈ [0, 1] through the post-warmup steps to a factor; a new schedule
is one more entry (optim.lr_scheduler takes its name).
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["LR_SCHEDULES", "lr_lambda"]

LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda _progress: 1.0,
    "linear": lambda progress: 1.0 - progress,  # to 0 at the last step
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),  # half a cosine, to 0
}


def lr_lambda(warmup: int, total: int, schedule: str) -> Callable[[int], float]:
    """`factor(step)` for torch's LambdaLR: (step + 1) / warmup during the first `warmup` steps, then the
    schedule over the remaining `total − warmup` steps."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {sorted(LR_SCHEDULES)}")
    shape = LR_SCHEDULES[schedule]

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        return shape(min(1.0, (step - warmup) / max(1, total - warmup)))

    return factor
