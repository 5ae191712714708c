"""What `grpo train` shows a new user, as a user's shell sees it (a real process): the evaluation set and the
thread count at start-up, one line per step (the last one once), no KL column when β = 0, a bar during
each evaluation, one result line at the end, a sweep's table; and the saved model answers through its chat
template as the README's Outputs section shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SRC = str(Path(__file__).parents[2] / "src")
SIZES = ["--batch-size", "4", "--num-generations", "4", "--max-new-tokens", "24"]
SIZES += ["--logging-steps", "1", "--tensorboard", "false", "data.eval_max_samples=8"]
SMALL = ["--steps", "2", *SIZES]


def grpo(
    *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "grpo", *argv],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": SRC, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The bundled demo, shortened: the tiny_math preset (β = 0, 2 threads), OMP_NUM_THREADS=1 set."""
    out = tmp_path_factory.mktemp("demo") / "run"
    done = grpo("train", *SMALL, "--output-dir", str(out), env={"OMP_NUM_THREADS": "1"})
    return out, done.stderr, done.stdout  # the bar's step lines go to stdout (tqdm.write), the log to stderr


def test_start_up_names_the_evaluation_set_and_the_thread_count_the_environment_asked_for(demo):
    _, log, _ = demo
    assert "CPU threads: 1 (OMP_NUM_THREADS=1; the preset's train.num_threads = 2 is not used)." in log
    assert "Evaluation: tiny_math:test (8 rows), greedy pass@1, before, after training" in log
    assert "Held-out accuracy before training: " in log and "(8 problems of tiny_math:test, greedy)" in log


def test_each_step_prints_once_without_a_kl_column_when_beta_is_0_and_evaluations_show_a_bar(demo):
    _, err, out = demo
    log = err + out
    assert (
        len(re.findall(r"^\s*step 2: reward \d\.\d{3} ± \d\.\d{3} \| len [\d.]+ \| [\d.]+s$", log, re.M)) == 1
    )
    assert len(re.findall(r"step 1: reward", log)) == 1
    assert (
        "step 2 | reward" not in log
    )  # the full metrics line is for runs without the bar (and in the files)
    assert "kl=" not in log and "| kl " not in log
    assert "eval before:" in log and "eval after:" in log and "8/8" in log


def test_the_run_ends_with_one_result_line(demo):
    out, log, _ = demo
    last = log.strip().splitlines()[-1]
    pattern = (
        r"held-out accuracy (\d+\.\d)% → (\d+\.\d)% \(([+-]\d+\.\d)\) in \d+(m\d\d)?s; "
        f"model in {re.escape(str(out / 'final_model'))}; "
        f"report {re.escape(str(out / 'report' / 'index.html'))}"
    )
    match = re.fullmatch(pattern, last)
    assert match, last
    before, after, change = map(float, match.groups()[:3])
    assert abs(after - before - change) < 0.11
    assert (out / "report" / "index.html").is_file()


def test_the_final_model_answers_through_its_chat_template_as_the_readme_shows(demo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, _ = demo
    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(out / "final_model")
    messages = [{"role": "user", "content": "Tom has 12 apples and gives away 5. How many are left?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    outputs = model.generate(**inputs, max_new_tokens=100, do_sample=False)
    new = outputs[0, inputs["input_ids"].shape[1] :]
    response = tokenizer.decode(new, skip_special_tokens=True)
    assert re.search(r"#### \d+$", response), response
    assert (
        new[-1].item() == tokenizer.eos_token_id == model.generation_config.eos_token_id
    )  # stopped at <|end|>
    assert len(new) < 100


def test_a_sweep_ends_with_a_table_of_its_runs(tmp_path):
    sweep = tmp_path / "sweep"
    # The table is what is checked, not the runs: the smallest run (2×2 completions of 8 tokens, one
    # thread, no report plots) gives it as well as the demo's sizes do, in a fraction of the time.
    off = ["train.eval_before=false", "train.eval_after=false", "--steps", "1", "train.report=false"]
    off += ["--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "8", "train.num_threads=1"]
    off += ["--logging-steps", "1", "--tensorboard", "false"]
    done = grpo("train", "--multirun", *off, "optimizer.lr=1e-4,3e-5", "--output-dir", str(sweep))
    lines = done.stdout.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("Sweep ")) :]
    assert lines[0] == f"Sweep {sweep} (2 runs; also in {sweep / 'results.txt'}):"
    assert re.fullmatch(r"optimizer\.lr\s+final reward\s+run dir", lines[1])
    assert re.fullmatch(rf"1e-4\s+\d\.\d{{3}}\s+{re.escape(str(sweep / '0'))}", lines[2])
    assert re.fullmatch(rf"3e-5\s+\d\.\d{{3}}\s+{re.escape(str(sweep / '1'))}", lines[3])
    assert (sweep / "results.txt").read_text().splitlines() == lines[1:]


def test_trl_style_eval_steps_equal_to_max_steps_still_evaluates_the_last_step(tmp_path):
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.config import DataConfig
    from grpo.data import load_rows

    rows = load_rows("tiny_math:test", DataConfig())[:8]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        gradient_checkpointing=False,
        report=False,
        progress_bar=False,
        num_threads=1,
    )
    trainer = GRPOTrainer(
        model="tiny-math-lm",
        reward_funcs=["gsm8k_correctness"],
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
    )
    summary = trainer.train()
    assert summary["eval/n"] == 8.0 and "eval/accuracy_after" in summary


class StopOnce:
    """A reward that sends SIGTERM (as Ctrl-C would SIGINT) the first time it scores step `at`, once."""

    __name__ = "stop_once"

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, prompts, completions, **_):
        self.calls += 1
        if self.calls == self.at:
            import signal

            signal.raise_signal(signal.SIGTERM)
        return [float(len(c) % 3) for c in completions]


STOP = StopOnce(at=2)


def test_the_hint_printed_when_a_run_stops_resumes_that_run_not_the_preset(tmp_path, capsys):
    from grpo.cli import main

    out = tmp_path / "run"
    argv = [*SIZES, "--steps", "3", "--save-steps", "1", "train.eval_before=false", "train.eval_after=false"]
    # In-process, so that the reward's signal reaches the trainer (by path it would run in a child process).
    argv += [
        "--output-dir",
        str(out),
        f"algorithm.reward_funcs={__name__}:STOP",
        "algorithm.reward_isolation=thread",
    ]
    assert main(["train", *argv]) == 128 + 15  # stopped by the SIGTERM after step 2, checkpoint saved
    hint = re.search(r"Resume it with: (grpo train [^(]+) \(", capsys.readouterr().err)
    assert hint and hint.group(1) == f"grpo train --resume --output-dir {out}"
    assert main(hint.group(1).split()[1:]) == 0  # the command as printed, nothing added
    err = capsys.readouterr().err
    assert f"Resuming with {out / 'config.yaml'} (the run's own settings)" in err
    assert "Resumed from" in err and "checkpoint-2 (step 2)" in err
    steps = [int(x) for x in re.findall(r'"step": (\d+)', (out / "metrics.jsonl").read_text())]
    assert max(steps) == 3  # the 3-step run finished; not the tiny_math preset's 80 steps
