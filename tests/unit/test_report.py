"""`grpo report`: plots and a self-contained HTML page from a run's logs; rendered in headless Chromium."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from grpo.cli import main as cli
from grpo.run.report import write_report


def fake_run(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "eval/accuracy_before": 0.25, "eval/accuracy": 0.25}]
    for step in range(1, 11):
        lines.append(
            {
                "step": step,
                "reward": 0.2 + 0.05 * step,
                "reward/gsm8k_correctness": 0.1 + 0.05 * step,
                "reward/gsm8k_format": 1.0,
                "kl": 0.001 * step,
                "completion_len/mean": 20 - step / 2,
                "completion_len/max": 30,
                "completion_len/min": 8,
                "clip/low_frac": 0.0,
                "clip/high_frac": 0.01,
                "entropy": 0.3 - 0.01 * step,
                "tokens_per_s": 250 + step,
                "groups/informative_frac": 0.5,
                "frac_zero_std_groups": 0.5,
                "loss": float("nan"),
            }
        )
        if step == 5:
            lines.append({"step": 5, "eval/accuracy_during": 0.3, "eval/accuracy": 0.3})
    lines.append({"step": 10, "eval/accuracy_after": 0.4, "eval/accuracy": 0.4})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 11, "rew')
    samples = [
        {
            "step": 10,
            "prompt": "What is 2+2?",
            "completion": "<answer>4</answer>",
            "reward": 1.1,
            "advantage": 0.9,
            "rewards": {"gsm8k_correctness": 1.0, "gsm8k_format": 1.0},
            "length": 5,
            "truncated": False,
        }
    ]
    (run_dir / "samples.jsonl").write_text(json.dumps(samples[0]) + "\n")
    (run_dir / "config.yaml").write_text("model: {name_or_path: tiny-math-lm}\ndata: {dataset: tiny_math}\n")
    return run_dir


def test_report_writes_plots_and_a_self_contained_page(tmp_path):
    page = write_report(fake_run(tmp_path / "run"))
    names = {p.name for p in page.parent.iterdir()}
    assert {
        "reward.png",
        "accuracy.png",
        "kl.png",
        "completion_length.png",
        "clip_fraction.png",
        "entropy.png",
        "tokens_per_s.png",
        "groups.png",
        "index.html",
    } <= names
    text = page.read_text()
    assert text.count('src="data:image/png;base64,') == 8  # every plot inlined: the page stands alone
    assert "&lt;answer&gt;4&lt;/answer&gt;" in text  # completions are escaped, not rendered as HTML
    assert "accuracy before</th><td>25.0%" in text and "accuracy after</th><td>40.0%" in text
    assert "gsm8k_correctness" in text and "advantage" in text


def test_report_cli_and_a_clear_error_without_metrics(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    assert cli(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip().endswith("index.html")
    assert cli(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed")
def test_report_renders_in_headless_chromium(tmp_path):
    run = fake_run(tmp_path / "run")
    write_report(run)
    shot = tmp_path / "shot.png"
    script = Path(__file__).parents[2] / "scripts" / "screenshot_report.sh"
    subprocess.run(["bash", str(script), str(run), str(shot)], check=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 50_000  # a page of plots, not a blank or error page
