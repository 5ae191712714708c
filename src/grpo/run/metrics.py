"""Where metrics go: console lines, metrics.jsonl, TensorBoard, W&B, and a stage timer.

metrics.jsonl is opened in append mode so a resumed run continues the same file. Lines past the step
a run resumes from (written by a process killed before its next checkpoint) are dropped first, and
TensorBoard purges its events past that step, so each step is logged once, as the resumed run logs it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpo.config import ConfigError
from grpo.run.checkpoint import CheckpointError

log = logging.getLogger("grpo")

CONSOLE_KEYS = (
    "reward",
    "reward_std",
    "kl",
    "loss",
    "completion_len/mean",
    "entropy",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "time/step",
)


class StageTimer:
    """Seconds per named stage of one step (`with timer("rollout"): ...`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg, config_dict: dict[str, Any], start_step: int = 0):
        self.run_dir = Path(run_dir)
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.run_dir / name
            if path.exists() and not path.is_file():
                raise ConfigError(
                    f"{path} is a directory (or another non-file), where grpo appends its "
                    f"{name.split('.')[0]} log; move it out of the way, then start again."
                )
        keep_until_step(self.run_dir / "metrics.jsonl", start_step)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.tb = None
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        self.wandb = None
        if cfg.train.use_wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError(
                    "use_wandb is on but wandb is not installed: pip install 'grpo[wandb]'."
                ) from e
            self.wandb = wandb.init(
                project=cfg.train.wandb_project,
                dir=str(self.run_dir),
                name=cfg.train.wandb_run_name or self.run_dir.name,
                config=config_dict,
            )

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        if not self.run_dir.is_dir():  # the open log would go on writing into a deleted file, unseen
            raise CheckpointError(
                f"The run directory {self.run_dir} no longer exists (deleted or moved while the "
                f"run was going?); stopped at step {step}. Restore it, then resume with "
                "--resume latest."
            )
        clean = {k: _clean(v) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                if v is not None:
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if console:
            log.info("step %d | %s", step, format_metrics(clean))

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        """Append sample completions (with rewards and advantages) to samples.jsonl, for the report."""
        if not records:
            return
        with open(self.run_dir / "samples.jsonl", "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in records)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def keep_until_step(path: Path, step: int) -> None:
    """Drop the lines of a metrics.jsonl logged after `step` (all of them for a fresh start), atomically."""
    if not path.is_file():
        return
    kept, unreadable = [], 0
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            logged = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):  # ValueError covers bad UTF-8 and bad JSON
            logged = None
        if type(logged) is not int:
            unreadable += bool(raw.strip())  # a line cut short by a kill, or damaged: dropped
            continue
        if step and logged <= step:
            kept.append(line + "\n")
    if unreadable and step:
        log.warning(
            "%s: dropped %d line(s) that were not JSON objects with a step number (cut short by a "
            "kill, or damaged).",
            path,
            unreadable,
        )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def format_metrics(metrics: dict[str, Any], keys: tuple[str, ...] = CONSOLE_KEYS) -> str:
    parts = []
    for k in keys:
        v = metrics.get(k)
        if isinstance(v, float):
            parts.append(f"{k} {v:.4g}")
    for k, v in metrics.items():
        if k.startswith(("reward/", "eval/")) and isinstance(v, float):
            parts.append(f"{k} {v:.3g}")
    return " | ".join(parts)


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a null keeps the line parseable
    return v


def _prompt_text(prompt) -> str:
    from grpo.data import prompt_text  # the last user message of a conversational prompt

    return prompt_text(prompt)


def sample_records(scored, advantages, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` completions of one step, one per group first (so several prompts show), with the
    total reward, each function's reward and the advantage. `scored` is a dapo.ScoredRollouts."""
    if limit <= 0:
        return []
    group = scored.rollouts.prompt_index.tolist()
    firsts = [i for i, g in enumerate(group) if g not in group[:i]]
    order = firsts + [i for i in range(len(group)) if i not in firsts]
    records = []
    for i in order[:limit]:
        records.append(
            {
                "prompt": _prompt_text(scored.prompts.prompts[group[i]]),
                "completion": scored.texts[i],
                "reward": _clean(scored.rewards[i]),
                "advantage": _clean(advantages[i]),
                "rewards": {
                    n: _clean(scored.scores.per_function[i, j]) for j, n in enumerate(scored.scores.names)
                },
                "length": int(scored.rollouts.lengths[i]),
                "truncated": bool(scored.rollouts.truncated[i]),
            }
        )
    return records
