"""Which weights sampled each token, on a Ray rollout actor.

An actor's engine is wrapped in `VersionedEngine`: new weights load between engine calls, never during one
(one lock), and every Rollouts an engine call returns carries, on each sampled token, the version of the
weights that sampled it (`Rollouts.weight_version`, the learner step that made them). A single turn is one
engine call, so its rows hold one version. An agent's episode through the gateway is many engine calls, and
under `rollout.mode=async` the learner's new weights may land between two of them: its rows can mix
versions. The source then reads each row's *oldest* token (`row_lags`), and an episode with a row older
than `max_staleness` is dropped and counted (`drop_stale`), as a whole stale batch is.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading

import torch

from grpo.records import Rollouts

_NONE = torch.iinfo(torch.long).max  # "no sampled token" when taking a row's oldest version


class VersionedEngine:
    """A RolloutEngine whose calls and weight loads exclude each other, and whose Rollouts say which weights
    sampled them. Everything else (flags, close, ...) is the wrapped engine's own."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.RLock()  # re-entrant: a runner holding it for a whole step still calls through
        self.version = -1  # no weights loaded yet

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def load(self, named_tensors, version: int) -> None:
        """The learner's weights of step `version`: after the engine call in progress, before the next."""
        with self.lock:
            self.engine.load_weights(named_tensors)
            self.version = version

    def generate(self, *args, on_step=None, **kwargs) -> Rollouts:
        return self._call(self.engine.generate, args, kwargs, on_step)

    def continue_rows(self, *args, on_step=None, **kwargs) -> Rollouts:
        return self._call(self.engine.continue_rows, args, kwargs, on_step)

    def _call(self, method, args: tuple, kwargs: dict, on_step) -> Rollouts:
        if on_step is not None and _takes_on_step(method):  # the gateway streams the native engine's steps
            kwargs = {**kwargs, "on_step": on_step}
        with self.lock:
            out = method(*args, **kwargs)
            version = self.version
        sampled = out.loss_mask > 0  # [N, T]
        stamp = torch.where(sampled, version, -1).long()  # [N, T]
        return dataclasses.replace(out, weight_version=stamp)


def _takes_on_step(method) -> bool:
    try:
        return "on_step" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def row_lags(rollouts: Rollouts, version: int) -> torch.Tensor | None:
    """[N] long: learner steps between `version` and the oldest weights that sampled a token of each row (0
    for a row with no sampled token); None when the rollouts carry no versions."""
    stamps = rollouts.weight_version  # [N, T]
    if stamps is None:
        return None
    sampled = (rollouts.loss_mask > 0) & (stamps >= 0)  # [N, T]
    oldest = torch.where(sampled, stamps, _NONE).min(-1).values  # [N]
    return torch.where(oldest == _NONE, 0, version - oldest)  # [N]


def mixed_rows(rollouts: Rollouts) -> int:
    """Rows whose sampled tokens came from more than one weight version (a weight update landed mid-row)."""
    stamps = rollouts.weight_version  # [N, T]
    if stamps is None:
        return 0
    sampled = (rollouts.loss_mask > 0) & (stamps >= 0)  # [N, T]
    oldest = torch.where(sampled, stamps, _NONE).min(-1).values  # [N]
    newest = torch.where(sampled, stamps, -1).max(-1).values  # [N]
    return int(((newest >= 0) & (newest != oldest)).sum())


def drop_stale(rollouts: Rollouts, lags: torch.Tensor, max_staleness: int) -> tuple[Rollouts, int]:
    """Every episode with a row older than max_staleness dropped: its reward NaN (left out of its group's
    baseline, advantage 0, as env.failed_episode=drop does) and its rows' loss mask 0 (nothing of it is
    trained on). Returns the rollouts and how many rows were dropped. Needs `episodes` (agent rows)."""
    stale_ids = {
        id(e) for e, lag in zip(rollouts.episodes, lags.tolist(), strict=True) if lag > max_staleness
    }
    keep = torch.tensor([id(e) not in stale_ids for e in rollouts.episodes])  # [N] bool
    copies = {i: None for i in stale_ids}
    episodes = []
    for e in rollouts.episodes:  # the rows of one episode share its record: replaced once, shared again
        if id(e) in copies:
            copies[id(e)] = copies[id(e)] or dataclasses.replace(e, final_reward=math.nan, env_reward=None)
            e = copies[id(e)]
        episodes.append(e)
    loss_mask = rollouts.loss_mask * keep[:, None].to(rollouts.loss_mask.dtype)  # [N, T]
    dropped = dataclasses.replace(
        rollouts,
        loss_mask=loss_mask,
        sampling_logprobs=rollouts.sampling_logprobs * keep[:, None],
        episodes=episodes,
    )
    return dropped, int((~keep).sum())


def with_versions(rollouts: Rollouts, stamps: list[list[int]]) -> Rollouts:
    """`rollouts` with each row's per-token versions (`stamps[r]` for row r's ids, -1 where not sampled); as
    given when no token has a version (an engine in the learner's process samples with its weights)."""
    if all(v < 0 for row in stamps for v in row):
        return rollouts
    table = torch.full(rollouts.completion_ids.shape, -1, dtype=torch.long)  # [N, T]
    for r, row in enumerate(stamps):
        table[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    return dataclasses.replace(rollouts, weight_version=table)
