"""Runs built in Python, as a script or a notebook builds them (issue 33): what they write down is what ran,
and a CLI resume of one either reproduces it or refuses, saying how to resume from Python."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from grpo import GRPOConfig, GRPOTrainer, TrainingStopped
from grpo.cli import main
from grpo.config import ConfigError
from grpo.config.yaml_limits import load_yaml
from grpo.run.runlock import RunLock
from tests import tiny_run

pytestmark = pytest.mark.slow


def _rows(n: int = 6) -> list[dict]:
    return [{"prompt": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(n)]


def _args(model: Path, out: Path, **overrides) -> GRPOConfig:
    settings = {"steps": 1, "eval_before": False, "eval_after": False, **overrides}
    settings = tiny_run.config(model, settings.pop("dataset", None), out, **settings)
    if settings["dataset"] == "None":  # the data is passed as train_dataset=
        del settings["dataset"]
    return GRPOConfig(**settings)


def _saved(run_dir: Path) -> dict:
    return load_yaml((run_dir / "config.yaml").read_text(), "config.yaml")


def test_a_python_run_records_its_data_rewards_and_tools_and_a_cli_resume_refuses(tmp_path, capsys):
    from grpo.agents.calculator import calculator
    from grpo.rewards.math import gsm8k_correctness

    def in_script(prompts, completions, **_):
        return [0.5] * len(prompts)

    out = tmp_path / "run"
    trainer = GRPOTrainer(
        model="tiny-tools-lm",
        args=_args("tiny-tools-lm", out),
        train_dataset=_rows(),
        reward_funcs=[in_script, gsm8k_correctness, "gsm8k_format"],
        tools=[calculator],
    )
    trainer.train()
    saved = _saved(out)
    # the rows themselves (count and digest), not the preset's dataset
    assert saved["data"]["dataset"].startswith("<in-memory train_dataset: 6 rows, sha256 ")
    assert saved["data"]["hf_path"] is None
    assert saved["algorithm"]["reward_funcs"] == [
        "<test_a_python_run_records_its_data_rewards_and_tools_and_a_cli_resume_refuses.<locals>.in_script "
        "from tests.integration.test_python_runs, not importable>",
        "grpo.rewards.math:gsm8k_correctness",  # importable: by its path
        "gsm8k_format",
    ]
    assert saved["env"]["tools"] == ["grpo.agents.calculator:calculator"]
    page = (out / "report" / "index.html").read_text()
    assert "in-memory train_dataset: 6 rows" in page and "grpo.rewards.math:gsm8k_correctness" in page
    assert "grpo.agents.calculator:calculator" in page

    capsys.readouterr()
    code = main(["train", "--resume", "--output-dir", str(out), "train.steps=2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "data.dataset = <in-memory train_dataset: 6 rows" in err and "in_script" in err
    assert "train(resume_from_checkpoint=True)" in err
    assert "gsm8k_correctness" not in err.split("rebuild:")[1].split("A CLI")[0]  # importable: not a problem


def test_a_cli_resume_of_a_python_run_with_importable_parts_reproduces_it(tmp_path):
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 6)
    rewards = [tiny_run.letter_score, "gsm8k_format"]

    whole, first = tmp_path / "whole", tmp_path / "pieces"
    for out, steps in ((whole, 2), (first, 1)):
        args = _args(model, out, steps=steps, dataset=str(data))
        GRPOTrainer(model=str(model), args=args, reward_funcs=rewards).train()
    assert _saved(first)["algorithm"]["reward_funcs"] == ["tests.tiny_run:letter_score", "gsm8k_format"]

    assert main(["train", "--resume", "--output-dir", str(first), "train.steps=2"]) == 0
    assert tiny_run.same_weights(whole / "final_model", first / "final_model")


class CtrlCAt:
    """letter_score, and at its n-th call a SIGINT to the main thread, as a terminal's Ctrl-C."""

    def __init__(self, call: int):
        self.call, self.calls = call, 0

    def __call__(self, prompts, completions, **columns):
        self.calls += 1
        if self.calls == self.call:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.3)
        return tiny_run.letter_score(prompts, completions, **columns)


def test_ctrl_c_saves_then_raises_and_python_resumes_the_way_trl_does(tmp_path):
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = str(tiny_run.write_dataset(tmp_path / "data.jsonl", 6))
    straight, out = tmp_path / "straight", tmp_path / "run"

    def trainer(out: Path, ctrl_c_at: int = 0, **settings) -> GRPOTrainer:
        args = _args(model, out, **{"steps": 3, "dataset": data, **settings})
        return GRPOTrainer(model=str(model), args=args, reward_funcs=[CtrlCAt(ctrl_c_at), "gsm8k_format"])

    trainer(straight).train()
    after_train = []
    with pytest.raises(KeyboardInterrupt) as stopped:  # as TRL lets it through: a script stops here
        trainer(out, ctrl_c_at=2).train()
        after_train.append("ran")
    assert not after_train and isinstance(stopped.value, TrainingStopped)
    assert (stopped.value.signal, stopped.value.step) == (signal.SIGINT, 2)
    assert stopped.value.checkpoint == out / "checkpoint-2" and stopped.value.summary["reward"] >= 0
    assert "Resume it with: trainer.train(resume_from_checkpoint=True)" in str(stopped.value)
    assert "grpo train --resume" not in (out / "train.log").read_text()  # the Python way, not the CLI's

    # the script run again over its own unfinished run: told how to resume in Python, not with a CLI flag
    again = trainer(out)
    with pytest.raises(ConfigError, match=r"already holds a run .*train\(resume_from_checkpoint=True\)"):
        again.train()
    again.train(resume_from_checkpoint=True)  # TRL's spelling: the newest checkpoint
    assert tiny_run.same_weights(straight / "final_model", out / "final_model")

    # GRPOConfig(resume_from_checkpoint=path) and train(resume_from_checkpoint=path) name one checkpoint
    extended = trainer(out, steps=4, resume_from_checkpoint=str(out / "checkpoint-3"))
    assert extended.cfg.train.resume == str(out / "checkpoint-3")
    extended.train()
    assert [m["step"] for m in tiny_run.metrics(out)] == [1, 2, 3, 4]
    trainer(out, steps=4).train(resume_from_checkpoint=str(out / "checkpoint-4"))  # done: nothing to train


def test_a_new_trainer_in_the_same_process_takes_the_run_directory_over(tmp_path):
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = str(tiny_run.write_dataset(tmp_path / "data.jsonl", 4))
    out = tmp_path / "run"
    first = GRPOTrainer(model=str(model), args=_args(model, out, dataset=data))  # the notebook cell, run once
    second = GRPOTrainer(model=str(model), args=_args(model, out, dataset=data))  # ... and again
    assert second.parts.lock.held and not first.parts.lock.held
    second.train()
    assert (out / "final_model").is_dir()
    # A lock held here by something other than a trainer is refused, and never with "kill <this pid>".
    (tmp_path / "elsewhere").mkdir()
    other = RunLock(tmp_path / "elsewhere").acquire()
    with pytest.raises(ConfigError) as refused:
        GRPOTrainer(model=str(model), args=_args(model, tmp_path / "elsewhere", dataset=data))
    message = str(refused.value)
    assert f"kill {os.getpid()}" not in message and "in use by another grpo run" in message
    other.release()
