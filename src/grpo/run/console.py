"""What the console shows: the log handler, and the lines a run and a sweep end with.

The log handler writes to whatever `sys.stderr` is when a line is logged.

A `StreamHandler(sys.stderr)` keeps the stream it was built with. When that stream is later replaced and
closed (pytest's capture between tests, a notebook cell's output, a second `GRPOTrainer` in the same
process), every log line becomes a "--- Logging error ---" traceback instead of a message.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FILE_ONLY = {"file_only": True}  # log(..., extra=FILE_ONLY): train.log's copy of what a progress bar shows
_startup: dict[str, list | None] = {"records": None}


def begin_startup_log() -> None:
    """A trainer starts: keep the console's lines (device roles, threads) until its train.log opens."""
    _startup["records"] = []


def take_startup_log() -> list[logging.LogRecord]:
    """The lines kept since begin_startup_log(), for the run's train.log; keeping stops."""
    records, _startup["records"] = _startup["records"] or [], None
    return records


class StderrHandler(logging.StreamHandler):
    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "file_only", False):
            return
        super().emit(record)
        if _startup["records"] is not None:
            _startup["records"].append(record)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        # StreamHandler.__init__ and setStream assign the stream; the property always reads it afresh.
        pass


# -- how a person resumes: the command line's way, or Python's ------------------------------------------
_front = {"name": "python"}  # `grpo train` sets "cli": messages then show the command to type


def set_front(name: str) -> None:
    """Which front end is running: "cli" (`grpo train`) or "python" (a GRPOTrainer built in user code)."""
    _front["name"] = name


def from_cli() -> bool:
    return _front["name"] == "cli"


def resume_hint(run_dir: Path | str) -> str:
    """How to continue the run in `run_dir`, in the words of the front end that started it."""
    if from_cli():
        return (
            f"grpo train --resume --output-dir {run_dir} (the run's own config.yaml; add overrides to "
            "change it)"
        )
    return (
        "trainer.train(resume_from_checkpoint=True) on a GRPOTrainer built as this one was (the same "
        f"model, data, rewards and tools; output_dir={str(run_dir)!r}), or GRPOConfig(..., "
        "resume_from_checkpoint=True)"
    )


# -- what a person reads at the end ---------------------------------------------------------------------
def duration(seconds: float) -> str:
    """2m14s, 45s, 1h03m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def outcome(summary: dict[str, float], first_reward: float | None, eval_set: bool | None = None) -> str:
    """The run's headline number: what the held-out evaluations measured (before → after, or the last one
    during training, or only the one before), else the training reward. `eval_set`: the run had an evaluation
    set (False or None: say "no evaluation set"; True: say that no evaluation ran)."""
    before, during, after = (summary.get(f"eval/accuracy_{when}") for when in ("before", "during", "after"))
    last = after if after is not None else during
    if last is not None:
        shown = f"held-out accuracy {last:.1%}"
        if before is not None:
            shown = f"held-out accuracy {before:.1%} → {last:.1%} ({100 * (last - before):+.1f})"
        # no evaluation after training: say that the number is the last one during it
        return shown if after is not None else f"{shown} at the last evaluation during training, none after"
    reward = summary.get("reward")
    trained = "no steps run" if reward is None else f"mean reward {_reward_change(first_reward, reward)}"
    if before is not None:
        return f"held-out accuracy {before:.1%} before training, no evaluation after; {trained}"
    if reward is None:
        return trained
    return f"{trained} ({'no evaluation ran' if eval_set else 'no evaluation set'})"


def _reward_change(first: float | None, last: float) -> str:
    return f"{first:.3f} → {last:.3f}" if first is not None else f"{last:.3f}"


def result_line(
    summary: dict[str, float],
    first_reward: float | None,
    seconds: float,
    model: Path,
    report: Path | None,
    eval_set: bool | None = None,
) -> str:
    """The one line a run ends with, e.g. `held-out accuracy 39.6% → 75.6% (+36.0) in 2m14s; model in
    runs/x/final_model; report runs/x/report/index.html`. `eval_set`: see `outcome`."""
    parts = [f"{outcome(summary, first_reward, eval_set)} in {duration(seconds)}", f"model in {model}"]
    if report is not None:
        parts.append(f"report {report}")
    return "; ".join(parts)


def final_metric(summary: dict[str, float]) -> tuple[str, float | None]:
    """(name, value) of the number a sweep compares runs by: the held-out accuracy after training (else the
    last one during it), else the reward. Never the accuracy before training: it says nothing of the run."""
    for key in ("eval/accuracy_after", "eval/accuracy_during"):
        if summary.get(key) is not None:
            return "held-out accuracy", summary[key]
    return "final reward", summary.get("reward")


def sweep_table(runs: list[tuple[dict[str, str], dict[str, float], Path]]) -> str:
    """A `--multirun` sweep's runs side by side: the value(s) swept → the final metric, and each run's
    directory. `runs`: (the run's overrides, its train() summary, its run directory)."""
    keys = [k for k in runs[0][0] if len({r[0].get(k) for r in runs}) > 1] or list(runs[0][0])[:1]
    names = {final_metric(summary)[0] for _, summary, _ in runs}
    metric = names.pop() if len(names) == 1 else "final metric"
    # Equal headline numbers (a tiny eval set, a hard task) hide what tells runs apart: then the training
    # reward and, for agents, how often episodes called a tool are shown beside them.
    values = [final_metric(summary)[1] for _, summary, _ in runs]
    tied = len(runs) > 1 and len(set(values)) == 1
    extra = [
        (key, label)
        for key, label in (("reward", "final reward"), ("episode/tool_call_frac", "tool-call rate"))
        if tied
        and (key != "reward" or metric != "final reward")  # not the reward twice
        and any(summary.get(key) is not None for _, summary, _ in runs)
    ]
    rows = [[*keys, metric, *(label for _, label in extra), "run dir"]]
    for overrides, summary, run_dir in runs:
        name, value = final_metric(summary)
        shown = "-" if value is None else f"{value:.1%}" if name == "held-out accuracy" else f"{value:.3f}"
        more = [
            "-"
            if summary.get(key) is None
            else f"{summary[key]:.1%}"
            if key == "episode/tool_call_frac"
            else f"{summary[key]:.3f}"
            for key, _ in extra
        ]
        rows.append([*(str(overrides.get(k, "")) for k in keys), shown, *more, str(run_dir)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
