"""Calling reward functions safely and combining what they return.

A long run must not hang on, or be killed by, one bad reward call. Each function is called once on
the whole batch with a time limit (`timeout`, seconds; a call still running after it is abandoned on a
daemon thread). When a call raises, times out or returns NaN/inf, `on_error` decides:

- "stop": raise a RewardError naming the function, the sample (found by re-scoring the samples one at a
  time) and its input (prompt, completion and columns, shortened);
- "skip": score the offending samples as missing (None), count them in `RewardScores.skipped`, go on.

`async def` reward functions run concurrently with each other on one event loop. Contract violations
that no sample explains (a wrong number of rewards, a string reward) always stop the run.

Each function receives its own deep copies of the prompts, completions and columns: one function
editing its inputs in place cannot change what the next one scores, nor what samples.jsonl shows.
Batch-wide arguments (`extras`: TRL's `trainer_state`, `log_metric`, `log_extra`) are passed as they are.

Conversational data reaches user functions as TRL sends it (prompts as message lists, completions as
`[{"role": "assistant", "content": ...}]`); this package's own rewards (module `grpo.rewards.*`) read text,
so they receive the last user message and the completion's text instead.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from math import nan

import torch

from grpo.config.errors import clause
from grpo.ranges import REWARD_LIMIT, OutOfRangeError, check_range
from grpo.records import RewardScores
from grpo.rewards.isolation import ISOLATIONS, Unpicklable, call_in_child, isolated

log = logging.getLogger("grpo")

RewardFunction = Callable[..., list[float | None]]
ON_ERROR = ("stop", "skip")
# Keyword arguments every reward call gets from the trainer; a dataset column may not share their names.
REWARD_ARGUMENTS = ("prompts", "completions", "trainer_state", "log_metric", "log_extra")
_CHARS_IN_ERRORS = 200
_SKIP_HINT = "Set algorithm.reward_on_error=skip to score such samples as missing and go on."


class RewardError(RuntimeError):
    """A reward function failed; the message names it, the sample and the input."""


class RewardTimeoutError(RewardError, TimeoutError):
    """A reward call ran past its time limit."""


class NonFiniteRewardError(RewardError, ValueError):
    """A reward function returned NaN, ±inf, or a value outside ±REWARD_LIMIT."""


class RewardContractError(RewardError, TypeError):
    """A reward function returned something other than one number (or None) per sample."""


class _Failure:
    """What a guarded call produced instead of rewards."""

    def __init__(self, error: BaseException):
        self.error = error


def reward_name(fn: RewardFunction) -> str:
    import functools

    if isinstance(fn, functools.partial):
        return reward_name(fn.func)
    return getattr(fn, "__name__", None) or type(fn).__name__


def unique_names(names: list[str]) -> list[str]:
    """Metric names with repeats numbered (two lambdas: `<lambda>`, `<lambda>_2`), so none overwrites
    another."""
    taken: set[str] = set()
    out = []
    for name in names:
        candidate, k = name, 1
        while candidate in taken:
            k += 1
            candidate = f"{name}_{k}"
        taken.add(candidate)
        out.append(candidate)
    return out


def is_async(fn: RewardFunction) -> bool:
    target = fn.func if hasattr(fn, "func") else fn
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)


def score_completions(
    funcs: list[RewardFunction],
    weights: list[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    *,
    timeout: float | None = None,
    on_error: str = "stop",
    extras: dict | None = None,
    isolation: str = "thread",
    given: list[tuple[str, list[float | None], float]] | None = None,
) -> RewardScores:
    """Calls each function on the whole batch (guarded as the module docstring says) and sums with weights.

    A None reward is skipped in the sum rather than counted as 0 (TRL's nansum), so a function that
    applies only to some samples does not drag the others down. A sample on which every function
    returned None has total NaN: it is "not scored", and the advantages leave it out of its group's baseline.
    `extras` are batch-wide keyword arguments (not one value per sample), e.g. `trainer_state`.
    `isolation`: "process" runs each user function in a forked child (rewards/isolation.py) that a time
    limit or a stop signal can kill; "thread" calls it in this process; "auto" forks for the functions
    the config named by import path. This package's own functions always run in-process.
    `given`: scores that arrive as data (an environment's own reward, per sample or None), as (name, values,
    weight); they are columns after the functions', summed and logged alike.
    """
    given = given or []
    if not funcs and not given:
        raise ValueError("score_completions needs at least one reward function")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    isolate = isolation
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(funcs)} reward functions")
    _check_batch(prompts, completions, columns)
    names = unique_names([reward_name(fn) for fn in funcs])
    logged: dict[str, list[float]] = {}
    extras = {
        "log_metric": lambda name, value: logged.setdefault(name, []).append(float(value)),
        "log_extra": lambda column, values: None,  # noqa: ARG005 (TRL's signature; the table is not kept)
        **(extras or {}),
    }
    batch = {"prompts": prompts, "completions": completions, **columns}
    call = _Call(timeout, extras, isolate)
    raw = _call_all(funcs, batch, call)  # list per function: rewards or _Failure
    rows, skipped = [], 0
    for fn, name, result in zip(funcs, names, raw, strict=True):
        checked, dropped = _checked(fn, name, result, batch, call, on_error)
        rows.append(checked)
        skipped += dropped
    rows += [[nan if v is None else float(v) for v in values] for _, values, _ in given]
    names = unique_names([*names, *(name for name, _, _ in given)])
    weights = [*weights, *(weight for _, _, weight in given)]
    per_function = torch.tensor(rows, dtype=torch.float32).T  # [N, F]
    weighted = per_function * torch.tensor(weights, dtype=torch.float32)  # [N, F]
    unscored = per_function.isnan().all(dim=1)  # [N] every function returned None
    total = torch.nansum(weighted, dim=1).masked_fill(unscored, nan)  # [N]
    _check_totals(total, names, weights, batch)
    return RewardScores(
        per_function=per_function,
        names=names,
        total=total,
        none_applicable=int(unscored.sum()),
        skipped=skipped,
        logged={k: sum(v) / len(v) for k, v in logged.items()},
    )


def _check_totals(total: torch.Tensor, names: list[str], weights: list[float], batch: dict) -> None:
    """The weighted sum Σ w·r stays where the advantage math holds, as each reward does (grpo/ranges.py)."""
    outside = (total.abs() > REWARD_LIMIT).nonzero()  # NaN (not scored) compares False
    if len(outside):
        i = int(outside[0])
        raise NonFiniteRewardError(
            f"the weighted reward total {float(total[i]):.6g} of sample {i} (weights "
            f"{dict(zip(names, weights, strict=True))}) is outside ±{REWARD_LIMIT:g}, where float32 "
            f"advantages hold; {_describe(batch, i)}. Lower algorithm.reward_weights or rescale the rewards."
        )


@dataclass
class _Call:
    """How each reward call runs: its time limit, the batch-wide extras, and in a child process or not."""

    timeout: float | None
    extras: dict
    isolate: str  # algorithm.reward_isolation: auto, process or thread


def _check_batch(prompts: list[str], completions: list[str], columns: dict[str, list]) -> None:
    if len(completions) != len(prompts):
        raise ValueError(f"got {len(completions)} completions for {len(prompts)} prompts")
    for column, values in columns.items():
        if column in REWARD_ARGUMENTS:
            raise ValueError(
                f"dataset column {column!r} clashes with the reward function argument of that name"
            )
        if len(values) != len(prompts):
            raise ValueError(f"column {column!r} has {len(values)} values for {len(prompts)} samples")


# -- calling -------------------------------------------------------------------------------------
def _own_copy(batch: dict[str, list], extras: dict, fn: RewardFunction | None = None) -> dict:
    """One function's arguments: its own copies of the per-sample lists, the batch-wide extras as they are."""
    own = copy.deepcopy(batch)
    if fn is not None and _reads_text(fn):
        own["prompts"] = [_text(p, "user") for p in own["prompts"]]
        own["completions"] = [_text(c, "assistant") for c in own["completions"]]
    return {**own, **extras}


def _reads_text(fn: RewardFunction) -> bool:
    target = fn.func if hasattr(fn, "func") else fn
    module = getattr(target, "__module__", None) or type(target).__module__
    if not isinstance(module, str) or not module.startswith("grpo.rewards"):
        module = type(target).__module__  # a callable object: its class's module
    return module.startswith("grpo.rewards")


def _text(value, role: str):
    """A message list's text: the last message of `role` (a completion's assistant message); text as is."""
    if not isinstance(value, list):
        return value
    return next(
        (m.get("content", "") for m in reversed(value) if isinstance(m, dict) and m.get("role") == role),
        value[-1].get("content", "") if value and isinstance(value[-1], dict) else "",
    )


def _call_all(funcs: list[RewardFunction], batch: dict[str, list], call: _Call) -> list:
    results: list = [None] * len(funcs)
    async_indices = [i for i, fn in enumerate(funcs) if is_async(fn)]
    if async_indices:
        gathered = _run_async(
            [funcs[i] for i in async_indices],
            [_own_copy(batch, call.extras, funcs[i]) for i in async_indices],
            call.timeout,
        )
        for i, result in zip(async_indices, gathered, strict=True):
            results[i] = result
    for i, fn in enumerate(funcs):
        if i not in async_indices:
            results[i] = _call_sync(fn, _own_copy(batch, call.extras, fn), call)
    return results


def _call_sync(fn: RewardFunction, batch: dict[str, list], call: _Call):
    if isolated(fn, call.isolate) and not _reads_text(fn):  # where a time limit and a signal can stop it
        kind, value = call_in_child(fn, batch, call.timeout)
        return _Failure(value) if kind == "error" else value
    timeout = call.timeout
    if timeout is None:
        try:
            return fn(**batch)
        except (Exception, SystemExit) as error:  # noqa: BLE001 (reported by _checked; sys.exit() too)
            return _Failure(error)
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn(**batch)
        except BaseException as error:  # noqa: BLE001 (a reward's SystemExit must not end the trainer either)
            box["error"] = error

    # A daemon thread: a call that never returns is abandoned and cannot keep the process alive at exit.
    worker = threading.Thread(target=target, name=f"reward-{reward_name(fn)}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return _Failure(TimeoutError(f"no result after {timeout:g} s"))
    return _Failure(box["error"]) if "error" in box else box["value"]


def _run_async(funcs: list[RewardFunction], batches: list[dict[str, list]], timeout: float | None) -> list:
    async def guarded(fn, batch):
        try:
            return await asyncio.wait_for(fn(**batch), timeout)
        except TimeoutError:
            return _Failure(TimeoutError(f"no result after {timeout:g} s"))
        except Exception as error:  # noqa: BLE001 (reported by _checked)
            return _Failure(error)

    async def everything():
        return await asyncio.gather(*(guarded(fn, b) for fn, b in zip(funcs, batches, strict=True)))

    # Its own thread and loop, so a caller that already runs an event loop (a notebook) is no obstacle.
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(value=asyncio.run(everything())), daemon=True)
    worker.start()
    worker.join(None if timeout is None else timeout + 5.0)
    if "value" not in box:
        return [_Failure(TimeoutError(f"the event loop did not finish after {timeout} s"))] * len(funcs)
    return box["value"]


def _call_one(fn: RewardFunction, batch: dict[str, list], index: int, call: _Call):
    single = _own_copy({k: v[index : index + 1] for k, v in batch.items()}, call.extras, fn)
    if is_async(fn):
        return _run_async([fn], [single], call.timeout)[0]
    return _call_sync(fn, single, call)


# -- checking --------------------------------------------------------------------------------------
def _checked(
    fn, name: str, result, batch: dict[str, list], call: _Call, on_error: str
) -> tuple[list[float], int]:
    n = len(batch["prompts"])
    if isinstance(result, _Failure):
        timed_out = isinstance(result.error, TimeoutError)
        if on_error == "skip" and timed_out:
            # Re-scoring one by one could cost N more time limits; the whole batch goes missing instead.
            log.warning(
                "Reward %r timed out after %s s on a batch of %d; scored as missing.", name, call.timeout, n
            )
            return [nan] * n, n
        return _per_sample(fn, name, batch, call, on_error, result.error)
    values, bad = _scores(name, result, n)
    if not bad:
        return values, 0
    if on_error == "stop":
        i = bad[0]
        raise NonFiniteRewardError(
            f"reward function {name!r} returned {_shown(result[i])} for sample {i}, {_why_bad(result[i])} "
            f"(return None for 'not applicable'); {_describe(batch, i)}. {_SKIP_HINT}"
        )
    log.warning(
        "Reward %r returned NaN, inf or a value outside ±%g for %d sample(s); scored as missing.",
        name,
        REWARD_LIMIT,
        len(bad),
    )
    return values, len(bad)


def _per_sample(
    fn, name: str, batch: dict[str, list], call: _Call, on_error: str, batch_error: BaseException
) -> tuple[list[float], int]:
    """Re-score one sample at a time to name the culprit (stop) or keep the others' rewards (skip)."""
    n = len(batch["prompts"])
    values, dropped = [], 0
    for i in range(n):
        result = _call_one(fn, batch, i, call)
        failed = isinstance(result, _Failure)
        if not failed:
            (value,), bad = _scores(name, result, 1, index=i)
            failed = bool(bad)
            error: BaseException = ValueError(f"returned {_shown(result[0])}, {_why_bad(result[0])}")
        else:
            error = result.error
        if failed and on_error == "stop":
            raise _error_for(name, error, batch, i) from error
        values.append(nan if failed else value)
        dropped += failed
    if dropped == 0 and on_error == "stop":
        raise _error_for(name, batch_error, batch, None) from batch_error
    if dropped == 0:  # every sample scores alone: only the batch call fails; keep the per-sample scores
        log.warning(
            "Reward %r failed on the batch (%s) but not per sample; used per-sample scores.",
            name,
            _short(repr(batch_error)),
        )
    else:
        log.warning(
            "Reward %r failed on %d of %d sample(s) (%s); scored as missing.",
            name,
            dropped,
            n,
            _short(repr(batch_error)),
        )
    return values, dropped


def _error_for(name: str, error: BaseException, batch: dict[str, list], index: int | None) -> RewardError:
    what = (
        f"timed out ({clause(error)})"
        if isinstance(error, TimeoutError)
        else f"raised {type(error).__name__}: {clause(error)}"
    )
    where = (
        f"on sample {index} of {len(batch['prompts'])}; {_describe(batch, index)}"
        if index is not None
        else f"on the batch of {len(batch['prompts'])} samples (each sample alone scores fine)"
    )
    cls = RewardTimeoutError if isinstance(error, TimeoutError) else RewardError
    return cls(f"reward function {name!r} {what} {where}. {_SKIP_HINT}")


def _describe(batch: dict[str, list], i: int) -> str:
    columns = {k: v[i] for k, v in batch.items() if k not in ("prompts", "completions")}
    text = f"prompt: {_short(batch['prompts'][i])!r}; completion: {_short(batch['completions'][i])!r}"
    return text + (f"; columns: {_short(repr(columns))}" if columns else "")


def _short(text) -> str:
    text = str(text)
    return text if len(text) <= _CHARS_IN_ERRORS else text[:_CHARS_IN_ERRORS] + "…"


def _check_shape(name: str, rewards, n: int) -> None:
    # Unpicklable: what a reward process returned that cannot travel back (a generator, an open file).
    rewards_type = rewards.type_name if isinstance(rewards, Unpicklable) else type(rewards).__name__
    if not isinstance(rewards, list | tuple):
        raise RewardContractError(
            f"reward function {name!r} returned a {rewards_type}; expected a list with one float (or None) "
            f"per completion, {n} here (a generator or an array: wrap it in list(...))."
        )
    if len(rewards) != n:
        raise RewardContractError(
            f"reward function {name!r} returned {len(rewards)} rewards for {n} completions; expected one "
            "float (or None) per completion, in the order of `completions`."
        )


_OUTSIDE = f"outside ±{REWARD_LIMIT:g}, where the float32 reward and advantage math holds (grpo/ranges.py)"


def _why_bad(reward) -> str:
    try:
        finite = math.isfinite(reward)
    except OverflowError:  # an int too large for a float
        finite = True
    return _OUTSIDE if finite else "which is not a finite number"


def _scores(name: str, rewards, n: int, index: int = 0) -> tuple[list[float], list[int]]:
    """The rewards as floats (NaN for None), and the positions of NaN, ±inf or out-of-range values."""
    _check_shape(name, rewards, n)
    values, bad = [], []
    for i, reward in enumerate(rewards):
        if reward is None:
            values.append(nan)
            continue
        if isinstance(reward, Unpicklable) or not isinstance(reward, numbers.Real):
            shown = (
                reward.type_name
                if isinstance(reward, Unpicklable)
                else f"{_shown(reward)} ({type(reward).__name__})"
            )
            raise RewardContractError(
                f"reward function {name!r} returned {shown} for sample {index + i}; expected a float, int, "
                "bool or None"
            )
        try:
            values.append(check_range(float(reward) if isinstance(reward, bool) else reward, "reward",
                                      -REWARD_LIMIT, REWARD_LIMIT))  # fmt: skip
        except OutOfRangeError:
            values.append(nan)
            bad.append(i)
    return values, bad


def _shown(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return _short(repr(value))
