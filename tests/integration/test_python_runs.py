"""Runs built in Python, as a script or a notebook builds them (issue 33): what they write down is what ran,
and a CLI resume of one either reproduces it or refuses, saying how to resume from Python."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

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
        args=_args("tiny-tools-lm", out, max_prompt_length=256, report=True),
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

    # grpo eval of the tool-trained model reads its run's config (the tools) and names what it evaluated
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "final_model"), "--limit", "2", "--json"]) == 0
    printed = capsys.readouterr()
    result = json.loads(printed.out.strip().splitlines()[-1])
    assert result["tools"] == ["grpo.agents.calculator:calculator"] and result["dataset"] == "tiny_math:test"
    assert "on tiny_math:test (2 rows), with tools: grpo.agents.calculator:calculator" in printed.err

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
    built_with = again.settings
    again.train(resume_from_checkpoint=True)  # TRL's spelling: the newest checkpoint
    # the choice is a decision of the run's settings, not a write into the config it was built with
    assert built_with.config.train.resume is None and again.settings.decided["train.resume"] == "latest"
    assert again.args is again.settings.config and again.args.train.resume == "latest"
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


def multiply(a: int, b: int) -> int:
    """Multiply two integers (TRL's documentation example tool).

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def _trl_args(out: Path, **kwargs) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
        max_steps=1, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        eval_before=False, eval_after=False, report=False, num_threads=1, **kwargs,
    )  # fmt: skip


def test_a_trl_style_agent_run_with_the_bundled_tool_model_says_what_it_can_call(tmp_path):
    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(
            model="tiny-tools-lm", args=_trl_args(out), train_dataset=_rows(4), tools=[multiply],
            reward_funcs=["gsm8k_format"],
        )  # fmt: skip
    assert not [w for w in seen if "gradient_checkpointing_enable" in str(w.message)]
    trainer.train()
    log = (out / "train.log").read_text()
    # max_completion_length is per turn here, and said in the user's (TRL's) words
    assert "max_completion_length = 8 tokens per assistant turn (in TRL it caps the whole episode" in log
    assert "holds up to 32 tokens after its prompt (env.max_turns 4 × max_completion_length)" in log
    # the bundled model calls only calculator(expression): said before the first step, with the way out
    assert "only ever shown calling calculator(expression)" in log and "multiply(a, b)" in log
    assert "def calculator(expression: str) -> str" in log
    assert (out / "config.yaml").read_text().count("tests.integration.test_python_runs:multiply") == 1


def test_trl_defaults_the_user_never_set_are_not_given_and_messages_use_trl_names(tmp_path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("grpo").addHandler(handler)
    try:
        args = GRPOConfig(max_steps=5, per_device_train_batch_size=4, num_generations=4)
        assert "were given" not in " ".join(r.getMessage() for r in records)  # num_train_epochs=3 is TRL's
        assert {"train.num_epochs", "train.gradient_accumulation_steps"}.isdisjoint(args.explicit_keys)
        assert args.train.steps == 5 and args.train.num_epochs == 3.0  # TRL's default still recorded
        GRPOConfig(max_steps=5, num_train_epochs=2, per_device_train_batch_size=4, num_generations=4)
        said = " ".join(r.getMessage() for r in records)
        assert "both num_train_epochs = 2.0 and max_steps = 5 were given; max_steps wins" in said
    finally:
        logging.getLogger("grpo").removeHandler(handler)


def test_trl_trainer_arguments_without_a_counterpart_say_why_and_what_is_nearest():
    with pytest.raises(ConfigError, match=r"quantization_config=\.\.\.\) is not supported: .*peft_config="):
        GRPOTrainer(quantization_config=object())
    with pytest.raises(TypeError, match="did you mean 'environment_factory'"):
        GRPOTrainer(environmnet_factory=object)


def test_train_log_has_the_console_lines_and_a_resumed_result_line_is_the_whole_run(tmp_path, capsys):
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = str(tiny_run.write_dataset(tmp_path / "data.jsonl", 6))
    out = tmp_path / "run"
    settings = {"dataset": data, "progress_bar": True, "eval_before": True, "eval_after": True,
                "eval_dataset": data, "eval_max_samples": 2}  # fmt: skip
    GRPOTrainer(model=str(model), args=_args(model, out, steps=1, **settings)).train()
    log = (out / "train.log").read_text()
    assert "CPU threads: 1" in log and "Device roles:" in log  # said before the run directory was known
    assert "step 1 | reward" in log  # the progress bar's step, in full
    first = [line for line in log.splitlines() if "held-out accuracy" in line and "→" in line]
    assert first and " in " in first[0]
    GRPOTrainer(model=str(model), args=_args(model, out, steps=2, **settings)).train(
        resume_from_checkpoint=True
    )
    last = (out / "train.log").read_text().splitlines()[-1]
    before = first[0].split("held-out accuracy ")[1].split(" → ")[0]
    assert f"held-out accuracy {before} → " in last  # "before →" from the first piece
    state = torch.load(out / "final_model" / "training_state.pt", weights_only=True)
    first_piece = torch.load(out / "checkpoint-1" / "training_state.pt", weights_only=True)
    assert state["elapsed_s"] > first_piece["elapsed_s"] > 0  # the whole run's time, carried on


def test_a_context_overflow_of_a_trl_style_config_names_max_completion_length(tmp_path):
    model = tiny_run.make_model_dir(tmp_path / "model")  # 256 positions
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, num_generations=2,
        max_completion_length=300, max_prompt_length=96, max_steps=1, use_cpu=True,
    )  # fmt: skip
    named = r"plus max_completion_length \(300\) is .*Lower max_completion_length"
    with pytest.raises(ConfigError, match=named):
        GRPOTrainer(model=str(model), args=args, train_dataset=_rows(), reward_funcs=["gsm8k_format"])
