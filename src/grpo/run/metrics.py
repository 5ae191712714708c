"""Where metrics go: console lines, metrics.jsonl, TensorBoard, W&B, and a stage timer.

metrics.jsonl is opened in append mode so a resumed run continues the same file. Lines past the step
a run resumes from (written by a process killed before its next checkpoint) are dropped first, and
TensorBoard purges its events past that step, so each step is logged once, as the resumed run logs it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grpo.algorithm.advantages import episode_rows, group_reward_stats, per_episode
from grpo.algorithm.importance import mismatch_metrics, sampler_ess
from grpo.checkpoint.store import CheckpointError
from grpo.config import ConfigError
from grpo.distributed.runtime import Runtime
from grpo.files import append_text, open_append, own_dir, refuse_link, write_text
from grpo.records import Rollouts, ScoredRollouts
from grpo.redact import argv_redacted
from grpo.run.console import FILE_ONLY

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


class SilentLogger:
    """The metrics logger of ranks other than 0: rank 0 writes for everyone."""

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        pass

    def log_samples(self, step: int, records: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


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
            # Rows logged past the resumed step by a killed process would appear twice.
            keep_until_step(path, start_step)
        self.jsonl = open_append(self.run_dir / "metrics.jsonl")
        self.tb = None
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = own_dir(self.run_dir / "tensorboard")
            self.tb = SummaryWriter(log_dir=str(tb_dir), purge_step=start_step + 1)
        self.wandb = None
        if cfg.train.use_wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError(
                    "use_wandb is on but wandb is not installed: pip install 'grpo[wandb]'."
                ) from e
            with argv_redacted():  # W&B records the command line in its files
                self.wandb = wandb.init(
                    project=cfg.train.wandb_project,
                    dir=str(own_dir(self.run_dir / "wandb").parent),
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
        # train.log always has the step's line; the console has it unless a progress bar stands for it
        log.info("step %d | %s", step, format_metrics(clean), extra=None if console else FILE_ONLY)

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        """Append sample completions (with rewards and advantages) to samples.jsonl, for the report."""
        if not records:
            return
        append_text(
            self.run_dir / "samples.jsonl",
            "".join(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in records),
        )

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def keep_until_step(path: Path, step: int) -> None:
    """Drop the lines of a metrics.jsonl or samples.jsonl logged after `step` (all of them for a fresh
    start), atomically."""
    refuse_link(path)
    if not path.is_file():
        return
    kept, unreadable, logged_steps = [], 0, 0
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
        logged_steps += 1
    if unreadable and step:
        log.warning(
            "%s: dropped %d line(s) that were not JSON objects with a step number (cut short by a "
            "kill, or damaged).",
            path,
            unreadable,
        )
    if not step and logged_steps:
        _set_aside(path, logged_steps)
        return
    write_text(path, "".join(kept))


def _set_aside(path: Path, lines: int) -> None:
    """A fresh start where a run was killed before its first checkpoint (nothing to resume): its log is
    kept under a new name, never emptied."""
    n = 1
    while (aside := path.with_name(f"{path.stem}.before-{n}{path.suffix}")).exists() or aside.is_symlink():
        n += 1
    path.rename(aside)
    log.warning(
        "%s held %d line(s) of an earlier run with no checkpoint to resume; kept as %s, and this run "
        "starts a new %s.",
        path,
        lines,
        aside.name,
        path.name,
    )


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


def sample_records(scored: ScoredRollouts, advantages: torch.Tensor, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` completions of one step, one per group first (so several prompts show), with the
    total reward, each function's reward and the advantage."""
    if limit <= 0:
        return []
    group = scored.rollouts.group_ids.tolist()
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
        if scored.rollouts.episodes is not None:  # the whole trajectory, with roles
            episode = scored.rollouts.episodes[i]
            records[-1].update(
                {
                    "messages": [_plain_message(m) for m in episode.messages],
                    "turns": episode.turns,
                    "ended_by": episode.ended_by,
                    "sampled_tokens": int(scored.rollouts.sampled_lengths[i]),
                }
            )
    return records


def _plain_message(message: dict) -> dict:
    """A message as JSON can hold it (tool calls as name + arguments)."""
    out = {"role": str(message.get("role")), "content": str(message.get("content") or "")}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": c["function"].get("arguments")} for c in calls
        ]
    if message.get("name"):
        out["name"] = str(message["name"])
    return out


class StepReport:
    """Where each step's metrics go: the progress bar, and (rank 0) the console, metrics.jsonl, TensorBoard,
    W&B and samples.jsonl."""

    def __init__(self, run_dir: Path, cfg, rt: Runtime, start_step: int, total_steps: int):
        self.t, self.total = cfg.train, total_steps
        self.logger = MetricsLogger(run_dir, cfg, cfg.to_dict(), start_step) if rt.is_main else SilentLogger()
        self.quiet = not self.t.progress_bar or not rt.is_main
        self.bar = tqdm(
            total=total_steps, initial=start_step, disable=self.quiet, desc="grpo", dynamic_ncols=True
        )
        self.show_kl = cfg.algorithm.beta > 0  # β = 0: no KL term, so a KL column would read 0 throughout
        self.first_reward: float | None = None  # this process's first step, for the closing line

    def step(
        self, step: int, metrics: dict[str, float], scored: ScoredRollouts, advantages: torch.Tensor
    ) -> None:
        """One training step's line (every train.logging_steps, and the last), and sample completions."""
        if self.first_reward is None:
            self.first_reward = metrics["reward"]
        self.bar.update(1)
        shown = {"reward": f"{metrics['reward']:.3f}"}
        if self.show_kl:
            shown["kl"] = f"{metrics['kl']:.3g}"
        self.bar.set_postfix(shown)
        if step % self.t.logging_steps and step != self.total:
            return
        # with the bar on, its one-line summary below stands for the step (once, the last step too)
        self.logger.log(step, metrics, console=not self.t.progress_bar)
        self.logger.log_samples(step, sample_records(scored, advantages, self.t.log_samples))
        if self.t.progress_bar:
            kl = f"| kl {metrics['kl']:.4f} " if self.show_kl else ""
            self.bar.write(
                f"step {step}: reward {metrics['reward']:.3f} ± {metrics['reward_std']:.3f} "
                f"{kl}| len {metrics['completion_len/mean']:.1f} | {metrics['time/step']:.2f}s"
            )

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        self.logger.log(step, metrics, console=console)

    @contextmanager
    def evaluating(self, when: str, rows: int):
        """A bar for one evaluation (`eval before`, rows done of `rows`), gone when it ends; yields the
        callback evaluation.evaluate reports finished rows to. Rows finish a whole generate() batch at a
        time (train.eval_batch_size), so on a terminal the bar is also redrawn every second: its clock shows
        the work (in a log file that would be a line a second)."""
        bar = tqdm(
            total=rows,
            desc=f"eval {when}",
            unit="prompt",
            leave=False,
            disable=self.quiet,
            dynamic_ncols=True,
        )
        done = threading.Event()
        if not self.quiet and sys.stderr.isatty():
            threading.Thread(target=_redraw_until, args=(bar, done), daemon=True).start()

        def update(rows_done: int) -> None:
            bar.update(rows_done)
            bar.refresh()  # a batch is seconds of work: always show it, not only after tqdm's mininterval

        try:
            yield update
        finally:
            done.set()
            bar.close()

    def close_bar(self) -> None:
        self.bar.close()

    def close(self) -> None:
        self.logger.close()


def _redraw_until(bar, done: threading.Event) -> None:
    while not done.wait(1.0):
        bar.refresh()


# -- per-step numbers ------------------------------------------------------------------------------
def step_metrics(
    scored: ScoredRollouts, advantages: torch.Tensor, sampling_stats: dict, learner_stats: dict
) -> dict[str, float]:
    """What the rollouts, rewards, advantages [N] and the update say about one step."""
    return {
        **reward_metrics(scored),
        **sampling_stats,
        **group_reward_stats(*_by_episode(scored)),
        "advantage/mean": advantages.mean().item(),
        "advantage/std": advantages.std().item(),
        "advantage/abs_max": advantages.abs().max().item(),
        **learner_stats,
        **rollout_metrics(scored.rollouts),
    }


def eval_metrics(result, when: str, seconds: float) -> dict[str, float]:
    """An evaluation.EvalResult as metrics; `when` is before, during or after training."""
    return {
        f"eval/accuracy_{when}": result.accuracy,
        "eval/accuracy": result.accuracy,
        "eval/n": float(result.n),
        "time/eval": seconds,
        **{f"eval/{k}": v for k, v in result.extra.items()},
    }


def _by_episode(scored: ScoredRollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards [E] and group ids [E] with each episode once: an agent's forked episode is several rows that
    share its reward, and counts once (as in its advantage, algorithm/advantages.py)."""
    rows = episode_rows(scored.rollouts)
    if rows is None:
        return scored.rewards, scored.rollouts.group_ids  # [N], [N]
    return per_episode(scored.rewards, rows), scored.rollouts.group_ids[rows.first]  # [E], [E]


def reward_metrics(scored: ScoredRollouts) -> dict[str, float]:
    rewards, scores = _by_episode(scored)[0], scored.scores  # [E], per function [N, F]
    rows = episode_rows(scored.rollouts)
    per_function = scores.per_function if rows is None else scores.per_function[rows.first]  # [E, F]
    return {
        "reward": nanmean(rewards),
        "reward_std": nanstd(rewards),
        **{f"reward/{n}": nanmean(per_function[:, j]) for j, n in enumerate(scores.names)},
        "reward/skipped": float(scores.skipped),
        "reward/not_scored": float(scores.none_applicable),
        **scores.logged,
    }


def rollout_metrics(rollouts: Rollouts) -> dict[str, float]:
    lengths = rollouts.lengths.float()  # [N]
    metrics = {
        "completion_len/mean": lengths.mean().item(),
        "completion_len/max": lengths.max().item(),
        "completion_len/min": lengths.min().item(),
        "truncated_frac": rollouts.truncated.float().mean().item(),
    }
    if rollouts.episodes is not None:
        metrics.update(episode_metrics(rollouts))
    return metrics


TOOL_ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
EPISODE_ENDINGS = ("answer", "done", "max_turns", "max_tokens", "turn_length", "template")


def episode_metrics(rollouts: Rollouts) -> dict[str, float]:
    """Multi-turn episodes: turns, tool calls and their errors by kind, how episodes ended, and how many of
    the completion tokens the policy sampled versus the environment injected (means per episode). An agent's
    forked episode (several rows, one Episode) counts once; its rows' tokens all count."""
    episodes = list({id(e): e for e in rollouts.episodes or []}.values())
    n = max(len(episodes), 1)
    sampled = rollouts.loss_mask.sum().item()
    injected = rollouts.completion_mask.sum().item() - sampled
    metrics = {
        "episode/turns": sum(e.turns for e in episodes) / n,
        "episode/tool_calls": sum(e.tool_calls for e in episodes) / n,
        "episode/tool_call_frac": sum(e.tool_calls > 0 for e in episodes) / n,
        "episode/truncated_frac": sum(e.truncated for e in episodes) / n,
        "episode/sampled_tokens": sampled / n,
        "episode/injected_tokens": injected / n,
        "episode/tool_errors": sum(sum(e.tool_errors.values()) for e in episodes) / n,
    }
    # A fixed set of keys, so that every process reduces the same metrics.
    for kind in TOOL_ERROR_KINDS:
        metrics[f"episode/tool_errors/{kind}"] = sum(e.tool_errors.get(kind, 0) for e in episodes) / n
    for reason in EPISODE_ENDINGS:
        metrics[f"episode/ended_by/{reason}"] = sum(e.ended_by == reason for e in episodes) / n
    rewards = [e.env_reward for e in episodes if e.env_reward is not None]
    if rewards:
        metrics["episode/env_reward"] = sum(rewards) / len(rewards)
    return metrics


def sampler_metrics(
    sampling_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, mask: torch.Tensor, importance: dict
) -> dict[str, float]:
    """How far the sampler's log-probs [N, T] are from the learner's π_old [N, T] on the mask [N, T]: the
    mismatch metrics, and is/ess when the learner's importance-weight metrics (`importance`) have none
    (it weighed no token: on-policy), so every run logs how close its sampler is."""
    metrics = mismatch_metrics(sampling_logprobs, old_logprobs, mask)
    if "is/ess" not in importance:
        metrics["is/ess"] = sampler_ess(old_logprobs, sampling_logprobs, mask)
    return metrics


def nanmean(x: torch.Tensor) -> float:
    return x.nanmean().item() if not torch.isnan(x).all() else float("nan")


def nanstd(x: torch.Tensor) -> float:
    scored = x[~x.isnan()]  # [M] samples some reward function scored
    return scored.std().item() if scored.numel() > 1 else float("nan")


# -- across processes ------------------------------------------------------------------------------
def reduction(key: str) -> str:
    """How a metric combines over ranks, by its name: extremes and times by max/min, throughputs and
    counts by sum, the rest by the mean (exact for means over equal-sized shards, which every step has)."""
    if key.endswith("/max") or key.startswith("time/") or key in ("rollout/staleness_max",):
        return "max"
    if key.endswith("/min"):
        return "min"
    if key in ("tokens_per_s",) or key.startswith("count/"):
        return "sum"
    return "mean"


def reduce_metrics(rt: Runtime, metrics: dict[str, float]) -> dict[str, float]:
    """Per-rank metrics → global ones (one all-reduce per kind of reduction)."""
    if not rt.active:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    how = [reduction(k) for k in keys]
    out = dict(metrics)
    for op in ("sum", "max", "min"):
        pick = [i for i, h in enumerate(how) if h == op or (op == "sum" and h == "mean")]
        if not pick:
            continue
        part = rt.all_reduce(values[pick].clone(), op)
        for j, i in enumerate(pick):
            v = part[j].item()
            out[keys[i]] = v / rt.world_size if how[i] == "mean" else v
    return out
