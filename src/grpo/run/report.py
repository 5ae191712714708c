"""A run report: one self-contained HTML page (plots inlined) plus the PNG plots, from a run's own logs.

    grpo report runs/2025-01-01_12-00-00          # also written automatically at the end of `grpo train`

Reads `metrics.jsonl`, `samples.jsonl` and `config.yaml` in the run directory and writes `report/`:
`index.html` and one PNG per panel (reward per function, held-out accuracy before/during/after, KL,
completion length, clip fraction, entropy, tokens/s, and the dynamic-sampling pass rate when logged),
with a table of sample completions, their rewards and advantages.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.config import EVAL_HOLDOUT, ConfigError
from grpo.config.yaml_limits import load_yaml
from grpo.files import own_dir, write_bytes, write_text

SAMPLES_SHOWN = 24


@dataclass
class Panel:
    file: str
    title: str
    series: list[tuple[str, str]]  # (metric key, legend label)
    ylabel: str = ""


PANELS = [
    Panel("reward.png", "Reward (total and per function)", [("reward", "total")], "reward"),
    Panel("accuracy.png", "Held-out accuracy", [("eval/accuracy", "accuracy")], "accuracy"),
    Panel("kl.png", "KL to the reference", [("kl", "KL (k3)")], "nats/token"),
    Panel(
        "completion_length.png",
        "Completion length",
        [("completion_len/mean", "mean"), ("completion_len/max", "max"), ("completion_len/min", "min")],
        "tokens",
    ),
    Panel(
        "clip_fraction.png",
        "Clipped tokens",
        [("clip/low_frac", "low (ρ < 1−ε, Â < 0)"), ("clip/high_frac", "high (ρ > 1+ε, Â > 0)")],
        "fraction",
    ),
    Panel("entropy.png", "Policy entropy", [("entropy", "entropy")], "nats/token"),
    Panel(
        "episodes.png",
        "Episodes (multi-turn)",
        [
            ("episode/tool_call_frac", "episodes calling a tool"),
            ("episode/truncated_frac", "truncated by a cap"),
            ("episode/tool_errors", "tool errors per episode"),
        ],
        "fraction / count",
    ),
    Panel("tokens_per_s.png", "Throughput", [("tokens_per_s", "completion tokens / s")], "tokens/s"),
    Panel(
        "groups.png",
        "Groups with reward spread",
        [
            ("groups/informative_frac", "informative / generated"),
            ("frac_zero_std_groups", "zero-spread in batch"),
        ],
        "fraction",
    ),
]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a log, line by line. A line that is not one (cut short by a crash, still being
    written by a live run, or not UTF-8) is skipped, and the rest kept."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [
        (r["step"], r[key])
        for r in rows
        if isinstance(r.get(key), int | float) and isinstance(r.get("step"), int | float)
    ]
    return [s for s, _ in points], [v for _, v in points]


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the plots and index.html; returns the path of index.html."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    if out_dir:  # the user's own choice of directory, link or not
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        out_dir = own_dir(run_dir / "report")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise ConfigError(
            f"{run_dir / 'metrics.jsonl'} has no metrics to report (no step has been logged yet, "
            "or no line of it is a JSON object)."
        )
    reward_keys = sorted({k for r in rows for k in r if k.startswith("reward/") and k != "reward/skipped"})
    figures = []
    for panel in PANELS:
        wanted = panel.series + (
            [(k, k.removeprefix("reward/")) for k in reward_keys] if panel.file == "reward.png" else []
        )
        drawn = [(label, *series(rows, key)) for key, label in wanted]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for label, steps, values in drawn:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=_plain(label))
        if panel.file == "accuracy.png":
            _mark_eval_phases(ax, rows)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
        plt.close(fig)
        write_bytes(out_dir / panel.file, png.getvalue())
        figures.append(panel)
    page = out_dir / "index.html"
    write_text(page, _html(run_dir, out_dir, rows, figures))
    return page


def _plain(label: str) -> str:
    """A metric name as matplotlib shows it literally: a `$` pair would be parsed as mathtext (and raise on
    `reward/$\\frac$`); a leading `_` hides a legend entry."""
    label = label.replace("$", r"\$")
    return f" {label}" if label.startswith("_") else label


def _mark_eval_phases(ax, rows: list[dict[str, Any]]) -> None:
    for key, label, marker in (
        ("eval/accuracy_before", "before", "s"),
        ("eval/accuracy_after", "after", "D"),
    ):
        steps, values = series(rows, key)
        if steps:
            ax.scatter(steps, values, marker=marker, s=60, zorder=3, label=f"{label}: {values[-1]:.1%}")


def _summary(run_dir: Path, rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    try:
        config = load_yaml((run_dir / "config.yaml").read_text(encoding="utf-8"), "config.yaml")
    except (OSError, UnicodeDecodeError, ConfigError):  # missing or damaged: the summary shows '?'
        config = None
    config = config if isinstance(config, dict) else {}

    def section_of(name: str) -> dict:
        return config.get(name) if isinstance(config.get(name), dict) else {}

    def get(section: str, key: str) -> str:
        return str(section_of(section).get(key, "?"))

    data = section_of("data")
    trained_on = str(data.get("hf_path") or data.get("dataset") or "?")
    items = [
        ("model", get("model", "name_or_path")),
        ("dataset", trained_on),
        ("evaluation set", _eval_set(data.get("eval_dataset"), trained_on, rows)),
        ("rewards", ", ".join(map(str, section_of("algorithm").get("reward_funcs") or [])) or "?"),
        *[(name, str(value)) for name, value in _agent_parts(section_of("env"))],
        (
            "prompts × generations",
            f"{get('train', 'prompts_per_step')} × {get('generation', 'num_generations')}",
        ),
        ("learning rate", get("optim", "learning_rate")),
        ("β (KL)", get("algorithm", "beta")),
        ("loss", get("algorithm", "loss_variant")),
        ("dynamic sampling", get("algorithm", "dynamic_sampling")),
    ]
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int | float) and "reward" in r]
    if steps:
        items.append(("steps logged", f"{min(steps)}–{max(steps)}"))
    for key, label in (
        ("eval/accuracy_before", "accuracy before"),
        ("eval/accuracy_during", "accuracy at the last evaluation during training"),
        ("eval/accuracy_after", "accuracy after"),
    ):
        _, values = series(rows, key)
        if values:
            items.append((label, f"{values[-1]:.1%}"))
    last = next((r for r in reversed(rows) if "reward" in r), {})
    for key in ("reward", "kl", "entropy", "tokens_per_s"):
        if isinstance(last.get(key), int | float):
            items.append((f"last {key}", f"{last[key]:.4g}"))
    return items


def _agent_parts(env: dict) -> list[tuple[str, str]]:
    """The tools and environment episodes ran with, when there were any (a one-turn run shows neither)."""
    tools = env.get("tools") or []
    shown = [("tools", ", ".join(map(str, tools)))] if tools else []
    return shown + ([("environment", env["environment"])] if env.get("environment") else [])


def _completion_html(sample: dict) -> str:
    """A completion, or a multi-turn episode's whole trajectory with each message's role."""
    messages = sample.get("messages")
    if not isinstance(messages, list):
        return html.escape(str(sample.get("completion", "")))
    parts = []
    for m in messages:
        m = m if isinstance(m, dict) else {"content": m}
        calls = m.get("tool_calls") or []
        text = str(m.get("content") or "") + "".join(
            f"\n→ {c.get('name')}({json.dumps(c.get('arguments'))})" for c in calls if isinstance(c, dict)
        )
        parts.append(f"<b>{html.escape(str(m.get('role', '?')))}</b>: {html.escape(text)}")
    return "\n".join(parts)


def _eval_set(spec: Any, trained_on: str, rows: list[dict[str, Any]]) -> str:
    """data.eval_dataset as the run used it, with its size (eval/n of the last evaluation)."""
    sizes = [r["eval/n"] for r in rows if isinstance(r.get("eval/n"), int | float)]
    size = f" ({int(sizes[-1])} rows)" if sizes else ""
    if spec == EVAL_HOLDOUT:
        return f"a held-out slice of {trained_on}, not trained on{size}"
    return f"{spec}{size}" if spec else "none"


def _html(run_dir: Path, out_dir: Path, rows: list[dict[str, Any]], figures: list[Panel]) -> str:
    esc = html.escape
    images = "\n".join(
        f'<figure><img alt="{esc(p.title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out_dir / p.file).read_bytes()).decode()}"><figcaption>{esc(p.title)} '
        f'(<a href="{p.file}">{p.file}</a>)</figcaption></figure>'
        for p in figures
    )
    summary = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary(run_dir, rows))
    samples = read_jsonl(run_dir / "samples.jsonl")[-SAMPLES_SHOWN:]
    names = sorted({str(n) for s in samples for n in _mapping(s.get("rewards"))})
    head = "".join(f"<th>{esc(n)}</th>" for n in names)
    body = "".join(
        f"<tr><td>{esc(str(s.get('step')))}</td><td class=text>{esc(str(s.get('prompt', ''))[:300])}</td>"
        f"<td class=text>{_completion_html(s)}</td><td>{_fmt(s.get('reward'))}</td>"
        + "".join(f"<td>{_fmt(_mapping(s.get('rewards')).get(n))}</td>" for n in names)
        + f"<td>{_fmt(s.get('advantage'))}</td>"
        + f"<td>{esc(str(s.get('length', '')))}{' ✂' if s.get('truncated') is True else ''}</td></tr>"
        for s in reversed(samples)
    )
    table = (
        f"<table class=samples><tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th>{head}"
        f"<th>advantage</th><th>tokens</th></tr>{body}</table>"
        if samples
        else "<p>No samples.jsonl in this run (train.log_samples = 0).</p>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>grpo run report: {esc(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.15em; margin-top: 1.5em; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 3px 7px; vertical-align: top; }}
table.summary th {{ text-align: left; background: #f4f4f4; }}
.plots {{ display: flex; flex-wrap: wrap; gap: 10px; }}
figure {{ margin: 0; }} figure img {{ width: 480px; border: 1px solid #ddd; }}
figcaption {{ font-size: 0.8em; color: #555; }}
table.samples td.text {{ white-space: pre-wrap; font-family: monospace; font-size: 0.8em; max-width: 420px; }}
table.samples td {{ font-size: 0.85em; }}
</style></head><body>
<h1>grpo run report: {esc(run_dir.name)}</h1>
<table class=summary>{summary}</table>
<h2>Training curves</h2>
<div class=plots>{images}</div>
<h2>Sample completions (latest first)</h2>
{table}
</body></html>
"""


def _mapping(value: Any) -> dict:
    """A sample's per-function rewards; anything else a tampered file holds there shows as nothing."""
    return value if isinstance(value, dict) else {}


def _fmt(value: Any) -> str:
    return (
        f"{value:.3g}"
        if isinstance(value, int | float) and not isinstance(value, bool)
        else html.escape(str(value))
    )
