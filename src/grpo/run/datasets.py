"""The run's data: training rows, the evaluation set (its own, a held-out slice, or none) and the reward
functions, checked against each other before any model loads; and the steps the run plans."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from grpo.config import EVAL_HOLDOUT, ConfigError, GRPOConfig
from grpo.data import load_rows, rows_from_dataset
from grpo.data.sources import split_holdout
from grpo.data.tasks import missing_reward_columns, reserved_column_message, scorer_for_rows, task_of_rows
from grpo.rewards import resolve_rewards

log = logging.getLogger("grpo")


class RunData(NamedTuple):
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_funcs: list[Callable]
    # What the data decided (RunSettings.decided): the task's rewards and weights, the evaluation set.
    decided: dict[str, Any]


def load_data_and_rewards(
    cfg: GRPOConfig, train_dataset=None, eval_dataset=None, reward_funcs=None, reward_model=None, token=None
) -> RunData:
    """Training rows, evaluation rows and the reward functions, checked against each other: every column a
    reward needs is in the data. Needs no model, so a bad combination stops the run before one loads.
    `cfg` is only read: what the data decides comes back in `decided`."""
    source = "train_dataset" if train_dataset is not None else (cfg.data.hf_path or cfg.data.dataset)
    train_rows = (
        rows_from_dataset(train_dataset, cfg.data.skip_invalid_rows)
        if train_dataset is not None
        else load_rows(cfg.data.hf_path or cfg.data.dataset, cfg.data, token=token)
    )
    has_model = reward_model is not None or cfg.algorithm.reward_model is not None
    chosen = reward_funcs is not None or "algorithm.reward_funcs" in cfg.explicit_keys
    try:
        funcs = resolve_rewards(
            reward_funcs
            if reward_funcs is not None
            else ([] if reward_model is not None else cfg.algorithm.reward_funcs)
        )
    except (ValueError, ImportError, TypeError) as e:  # an unknown name or a bad import path: say which
        raise ConfigError(f"algorithm.reward_funcs: {e}") from e
    columns = set(train_rows[0]) if train_rows else set()
    clash = reserved_column_message(source, {k for row in train_rows for k in row})
    if clash:
        raise ConfigError(clash)
    missing = missing_reward_columns(funcs, columns)
    task = task_of_rows(train_rows)
    decided: dict[str, Any] = {}
    eval_spec = cfg.data.eval_dataset
    if missing and task is not None and not chosen:
        # A local copy of a task's data (an IFEval .jsonl) is scored the way the task is.
        log.info(
            "%s has %s's columns (%s): rewards %s (set algorithm.reward_funcs to choose others).",
            source,
            task.name,
            ", ".join(task.columns),
            ", ".join(task.reward_funcs),
        )
        funcs = resolve_rewards(list(task.reward_funcs))
        decided["algorithm.reward_funcs"] = list(task.reward_funcs)
        decided["algorithm.reward_weights"] = list(task.reward_weights) if task.reward_weights else None
        if (
            train_dataset is None
            and "data.eval_dataset" not in cfg.explicit_keys
            and eval_spec not in (None, EVAL_HOLDOUT)
        ):
            eval_spec = source  # as the task's own preset does: IFEval evaluates on its prompts
        missing = missing_reward_columns(funcs, columns)
    if missing:
        raise ConfigError(_missing_columns_message(source, missing, columns, has_model))
    eval_spec, holds_out = _holdout_choice(cfg, eval_spec, train_dataset, eval_dataset, train_rows)
    if eval_spec != cfg.data.eval_dataset:
        decided["data.eval_dataset"] = eval_spec
    if holds_out:
        train_rows, held_out = split_holdout(train_rows)
        return RunData(
            train_rows, _scorable(cfg, held_out, f"the held-out slice of {source}"), funcs, decided
        )
    return RunData(train_rows, _eval_rows(cfg, eval_spec, eval_dataset, token), funcs, decided)


def _evaluates(cfg: GRPOConfig) -> bool:
    t = cfg.train
    return bool(t.eval_before or t.eval_after or t.eval_steps)


def _holdout_choice(
    cfg: GRPOConfig, spec: str | None, train_dataset, eval_dataset, train_rows: list[dict]
) -> tuple[str | None, bool]:
    """(the evaluation set's spec, whether it is a held-out slice of the training rows): data.eval_dataset =
    holdout, or a train_dataset object given without an evaluation set while evaluation is on (the built-in
    default set, tiny_math's problems, would say nothing about it). A slice chosen for the user (not set by
    them) that cannot be scored (no answer column) turns evaluation off instead, said in the log."""
    if eval_dataset is not None or not _evaluates(cfg):
        return spec, False
    chosen = "data.eval_dataset" in cfg.explicit_keys
    if train_dataset is not None and not chosen and spec:
        spec = EVAL_HOLDOUT
    if spec != EVAL_HOLDOUT:
        return spec, False
    try:
        scorer_for_rows(train_rows)
    except ValueError as e:
        if chosen:
            raise ConfigError(f"data.eval_dataset = holdout: {e}") from e
        log.warning(
            "No evaluation: the training data cannot be scored as held-out accuracy (%s) Set "
            "data.eval_dataset to an evaluation set to have one.",
            e,
        )
        return None, False
    return spec, True


def eval_set_name(cfg: GRPOConfig, train_source: str) -> str:
    """data.eval_dataset in words: its spec, or which training data a held-out slice comes from."""
    spec = cfg.data.eval_dataset
    return f"the held-out slice of {train_source}" if spec == EVAL_HOLDOUT else spec or "eval_dataset"


def describe_eval_set(cfg: GRPOConfig, name: str, eval_rows: list[dict], train_rows: int) -> str:
    """The evaluation set, its size and schedule, for the start-up log ('Evaluation: ...')."""
    t = cfg.train
    if not eval_rows:
        return "none (data.eval_dataset is unset or evaluation is off)"
    during = 0 < t.eval_steps < planned_steps(cfg, train_rows)
    when = [w for w, on in (("before", t.eval_before), (f"every {t.eval_steps} steps", during),
                            ("after training", t.eval_after)) if on]  # fmt: skip
    size = f"{len(eval_rows)} rows" + (
        f", not trained on; {train_rows} rows left to train on"
        if cfg.data.eval_dataset == EVAL_HOLDOUT
        else ""
    )
    return f"{name} ({size}), greedy pass@1, {', '.join(when)}"


def _missing_columns_message(
    source: str, missing: dict[str, list[str]], columns: set[str], has_model: bool
) -> str:
    needs = "; ".join(
        f"the reward {name} needs the column{'s' * (len(cols) > 1)} {', '.join(map(repr, cols))}"
        for name, cols in missing.items()
    )
    first = next(iter(missing.values()))[0]
    return (
        f"The dataset ({source}) has no {first!r} column: {needs} (the dataset has "
        f"{', '.join(sorted(columns))}). Add the column (SimplePromptDataset(prompts, {first}=[...]), or the "
        f"field {first!r} in every row; "
        f"data.answer_field names another column as the answer), "
        + (
            "or drop the rewards that need it (reward_funcs=[] keeps the reward model alone)."
            if has_model
            else "or score with a reward model (reward_model=... / --reward-model PATH) or rewards that need "
            f"no {first!r} (reward_funcs=[...], --reward-funcs NAME)."
        )
    )


def planned_steps(cfg: GRPOConfig, num_rows: int) -> int:
    """Optimizer steps of the run: train.steps, else num_epochs passes over num_rows prompts."""
    t = cfg.train
    steps = t.steps or max(1, round(t.num_epochs * -(-num_rows // t.prompts_per_step)))
    if cfg.distributed.weight_sync_steps > steps:
        raise ConfigError(
            f"inference_rollouts (distributed.weight_sync_steps) = {cfg.distributed.weight_sync_steps}"
            f" is more than the run's {steps} steps, so the rollout weights would never be updated."
            f" Use a value between 1 and {steps}."
        )
    return steps


def _eval_rows(cfg: GRPOConfig, spec: str | None, eval_dataset, token) -> list[dict[str, Any]]:
    if eval_dataset is not None:
        return _scorable(cfg, rows_from_dataset(eval_dataset, split="test"), "eval_dataset")
    if not spec or not _evaluates(cfg):
        return []
    try:
        rows = load_rows(spec, cfg.data, split="test", token=token)
    except ConfigError as e:  # say that it is the evaluation set, not the training data, that failed
        raise ConfigError(
            f"Could not load the evaluation set data.eval_dataset = {spec}: {str(e).rstrip('.')}. Set "
            "data.eval_dataset to "
            "another set, to 'holdout' (a slice of the training data), or to none (no evaluation)."
        ) from e
    return _scorable(cfg, rows, f"data.eval_dataset = {spec}")


def _scorable(cfg: GRPOConfig, rows: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    try:
        if rows:
            scorer_for_rows(rows)  # found out now, not after the first training steps
    except ValueError as e:
        raise ConfigError(f"The evaluation set ({what}) cannot be scored: {e}") from e
    return rows[: cfg.data.eval_max_samples] if cfg.data.eval_max_samples else rows
