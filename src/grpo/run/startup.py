"""What a start decides before reading the data (RunSettings.decided, config/settings.py): the CPU threads,
the run name, and where passed-in models came from."""

from __future__ import annotations

from typing import Any

from grpo.config import GRPOConfig
from grpo.run.rundir import decide_run_name

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what torch itself reads at start-up


def cpu_threads(cfg: GRPOConfig, environ) -> tuple[int | None, str]:
    """torch's CPU thread count for the run and where it comes from: train.num_threads when the user set
    it; else the environment's OMP_NUM_THREADS / MKL_NUM_THREADS, which a preset's value must not silently
    override (the tiny_math preset's 2 assumes an idle 2-core machine); else the preset's; else torch's
    own choice (None)."""
    n = cfg.train.num_threads
    if n and "train.num_threads" in cfg.explicit_keys:
        return n, "train.num_threads"
    for name in THREAD_ENV:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"{name}={value}" + (
                f"; the preset's train.num_threads = {n} is not used" if n and n != int(value) else ""
            )
    return n, "train.num_threads from the config; OMP_NUM_THREADS or train.num_threads=N changes it"


def start_decisions(
    cfg: GRPOConfig, environ, *, model=None, tokenizer=None, ref_model=None
) -> dict[str, Any]:
    """What the start decides before the data (RunSettings.decided): the CPU threads, the run name, and
    config.yaml's record of where passed-in models came from (not the bundled default)."""
    decided: dict[str, Any] = {}
    threads, _ = cpu_threads(cfg, environ)
    if threads:
        decided["train.num_threads"] = threads  # what ran, in config.yaml and for Ray's workers
    for key, value in (("tokenizer_path", tokenizer), ("name_or_path", model), ("ref_model_path", ref_model)):
        if isinstance(value, str):  # a name or path passed in place of an object
            decided[f"model.{key}"] = value
        elif value is not None:  # an object: where it came from
            decided[f"model.{key}"] = (
                getattr(value, "name_or_path", None) or f"<{type(value).__name__} object>"
            )
    if (name := decide_run_name(cfg)) != cfg.train.run_name:
        decided["train.run_name"] = name
    return decided
