"""Issue 24 on real (tiny) runs: a run that trains nothing never ends with the result line, sizes are
checked before the model loads, a learning rate changed on resume takes effect, stop signals hold while
user code is stuck and during the final save, and what used to be raw tracebacks are one line. Each
fails on 091d311."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import grpo.checkpoint.store
import grpo.run.assemble
from grpo import GRPOConfig, GRPOTrainer, cli
from grpo.checkpoint.store import CheckpointError, verify_checkpoint
from grpo.config import ConfigError
from grpo.train import TrainingHalted
from tests import tiny_run

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RESULT = "; model in "  # the result line a trained run ends with (run/console.py result_line)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("issue24")
    return {
        "model": tiny_run.make_model_dir(root / "model"),
        "data": tiny_run.write_dataset(root / "data.jsonl", 4),
        "root": root,
    }


def settings(assets, out, **overrides):
    return tiny_run.config(assets["model"], assets["data"], out, **{"steps": 1, **overrides})


def cli_run(assets, tmp_path, capsys, **overrides) -> tuple[int, list[str]]:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(settings(assets, tmp_path / "run", **overrides)))
    rc = cli.main(["train", "--config", str(config)])
    captured = capsys.readouterr()
    return rc, (captured.out + captured.err).splitlines()


def no_signal(prompts, completions, **_):
    return [None] * len(completions)


def enormous(prompts, completions, **_):
    return [1e20 * (i % 2) for i in range(len(completions))]


def error_lines(lines: list[str]) -> list[str]:
    return [x for x in lines if x.startswith("grpo train: error:")]


# -- §4: a run that trains nothing, and rewards outside the range -------------------------------------------


def test_every_reward_none_warns_each_step_and_ends_with_an_error_not_done(assets, tmp_path, capsys):
    # 091d311: exit 0, "Done" (today's result line), loss 0 throughout.
    rc, lines = cli_run(assets, tmp_path, capsys, steps=2, reward_funcs=[f"{__name__}:no_signal"])
    assert rc == 1
    assert not any(RESULT in x for x in lines)
    (error,) = error_lines(lines)
    assert "2 step(s) ran and none could train: every reward was None (or skipped) in every step" in error
    warned = [x for x in lines if x.startswith("Step ") and "every reward was None" in x]
    assert [x.split(":")[0] for x in warned] == ["Step 1", "Step 2"]


def test_a_reward_of_1e20_stops_the_run_with_one_error_line(assets, tmp_path, capsys):
    # 091d311: exit 0, "Done" (today's result line), loss 0 and grad 0 (1e20² overflows float32).
    rc, lines = cli_run(assets, tmp_path, capsys, reward_funcs=[f"{__name__}:enormous"])
    assert rc == 1 and not any(RESULT in x for x in lines) and "Traceback" not in "\n".join(lines)
    (error,) = error_lines(lines)
    assert "reward function 'enormous' returned 1e+20 for sample 1, outside ±1e+09" in error


# -- §5: sizes before the model loads ------------------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the sizes were checked")

    monkeypatch.setattr(grpo.run.assemble, "_policy", refuse)


def test_prompt_plus_completion_beyond_the_models_positions_stops_before_loading(
    assets, tmp_path, no_model_load
):
    # 091d311 trained on positions the 256-position model does not have.
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"question": "apples " * 300, "answer": "#### 1"})
        + "\n"
        + json.dumps({"question": "hi", "answer": "#### 2"})
        + "\n"
    )
    cfg = settings(assets, tmp_path / "run", dataset=str(long), max_prompt_length=2048, max_new_tokens=8)
    with pytest.raises(ConfigError) as raised:
        GRPOTrainer(config=GRPOConfig(**cfg))
    message = str(raised.value)
    assert (
        "plus generation.max_new_tokens (8) is" in message
        and "the model has 256 (max_position_embeddings)" in message
    )
    assert "data.max_prompt_length (now 2048) to 248" in message


def test_a_generous_prompt_cap_over_short_prompts_still_runs(assets, tmp_path):
    cfg = settings(assets, tmp_path / "run", max_prompt_length=1000, max_new_tokens=6)
    GRPOTrainer(config=GRPOConfig(**cfg)).train()
    assert (tmp_path / "run" / "final_model").is_dir()


def test_1e8_completions_a_step_stop_before_loading_with_the_numbers(assets, tmp_path, no_model_load):
    # 091d311: an allocator traceback once the step began.
    cfg = settings(assets, tmp_path / "run", batch_size=50_000_000, gradient_accumulation_steps=None)
    with pytest.raises(ConfigError, match=r"= 50000000 × 2 = 100,000,000 completions .* GiB is free"):
        GRPOTrainer(config=GRPOConfig(**cfg))


# -- §6: resume takes the settings it accepts, and freezes only what trains --------------------


def test_a_learning_rate_changed_on_resume_is_the_one_trained_with(assets, tmp_path):
    # 091d311 logged the change and recorded it, but stepped with the checkpoint's learning rate.
    out = tmp_path / "run"
    common = {"lr_scheduler": "constant", "warmup_steps": 0, "save_steps": 1}
    GRPOTrainer(config=GRPOConfig(**settings(assets, out, steps=2, learning_rate=1e-3, **common))).train()
    resumed = settings(
        assets, out, steps=3, learning_rate=5e-2, allow_config_change=True, resume="latest", **common
    )
    GRPOTrainer(config=GRPOConfig(**resumed)).train()
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["lr"] for m in logged if "lr" in m][-1] == pytest.approx(5e-2)
    state = torch.load(out / "checkpoint-3" / "training_state.pt", weights_only=True)
    assert state["learner"]["optimizer"]["param_groups"][0]["lr"] == pytest.approx(5e-2)


def test_resume_accepts_a_change_of_settings_that_train_nothing(assets, tmp_path, capsys):
    # 091d311 refused `train.report` (and log_samples, metric_for_best_model, ...) on resume.
    out = tmp_path / "run"
    GRPOTrainer(config=GRPOConfig(**settings(assets, out, steps=1, report=False))).train()
    again = settings(assets, out, steps=2, report=True, log_samples=3, resume="latest")
    GRPOTrainer(config=GRPOConfig(**again)).train()
    assert (out / "checkpoint-2").is_dir()
    assert RESULT in capsys.readouterr().err


def test_resuming_a_finished_run_trains_nothing_and_says_so(assets, tmp_path, capsys):
    out = tmp_path / "run"
    GRPOTrainer(config=GRPOConfig(**settings(assets, out, steps=1))).train()
    capsys.readouterr()
    GRPOTrainer(config=GRPOConfig(**settings(assets, out, steps=1, resume="latest"))).train()
    err = capsys.readouterr().err
    assert "Nothing to train: the run was already at step 1" in err and RESULT not in err


# -- §7: user code that cannot be stopped in-process, and the raw tracebacks --------------------


STUCK = """
import pathlib, re
def stuck(prompts, completions, **_):
    pathlib.Path(__file__).with_name("started").write_text("x")
    re.match(r"(a+)+$", "a" * 64 + "b")  # hours inside C, holding the GIL
    return [1.0] * len(completions)
"""


def test_sigterm_while_a_reward_is_stuck_in_c_saves_and_exits_143(assets, tmp_path):
    # 091d311: the signal handler never ran (the GIL was held), no checkpoint, only kill -9 ended it.
    (tmp_path / "stuck_reward.py").write_text(STUCK)
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(settings(assets, tmp_path / "run", steps=3, reward_funcs=["stuck_reward:stuck"]))
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), str(tmp_path)])}
    process = subprocess.Popen(
        [sys.executable, "-m", "grpo", "train", "--config", str(config)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline and process.poll() is None, process.stdout.read()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, out
    assert "a reward call still ran 5 s after the stop signal, so it was killed" in out
    assert "Stopped at step 0 of 3 (signal 15); checkpoint" in out
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-0") is None


def test_sigterm_during_the_final_save_lets_it_finish_and_says_so(assets, tmp_path, monkeypatch, capsys):
    # 091d311: exit 143 with no message, and final_model.tmp left behind.
    real_point = grpo.checkpoint.store._fault_point

    def signal_inside_the_final_save(path, point):
        if path.name.startswith("final_model") and point == "state":
            signal.raise_signal(signal.SIGTERM)
        real_point(path, point)

    monkeypatch.setattr(grpo.checkpoint.store, "_fault_point", signal_inside_the_final_save)
    rc, lines = cli_run(assets, tmp_path, capsys, steps=1)
    assert rc == 143
    assert any("Signal 15 arrived during the final save, which completed: 1 steps" in x for x in lines)
    run = tmp_path / "run"
    assert not list(run.glob("*.tmp")) and verify_checkpoint(run / "final_model") is None


def test_a_chat_prompt_with_an_unknown_role_is_a_config_error(assets, tmp_path):
    data = tmp_path / "roles.jsonl"
    rows = [{"prompt": [{"role": "wizard", "content": "hi"}], "answer": "#### 1"}] * 2
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = settings(assets, tmp_path / "run", dataset=str(data))
    with pytest.raises(
        ConfigError, match=r"chat template failed on a prompt with roles \['wizard'\]: .*unknown role"
    ):
        GRPOTrainer(config=GRPOConfig(**cfg))


def test_a_jinja_sandbox_violation_in_a_chat_template_is_a_config_error(assets, tmp_path):
    import shutil

    model = Path(shutil.copytree(assets["model"], tmp_path / "model"))
    (model / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    cfg = settings(assets, tmp_path / "run", model=str(model))
    with pytest.raises(ConfigError, match=r"chat template failed .*SecurityError"):
        GRPOTrainer(config=GRPOConfig(**cfg))


def test_a_completions_column_is_refused_before_the_model_loads(assets, tmp_path, no_model_load):
    # 091d311: a raw ValueError at the first reward call.
    data = tmp_path / "c.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": "q", "answer": "#### 1", "completions": "x"}) + "\n" for _ in range(2)
        )
    )
    with pytest.raises(
        ConfigError, match="has a column named 'completions': reward functions receive that name"
    ):
        GRPOTrainer(config=GRPOConfig(**settings(assets, tmp_path / "run", dataset=str(data))))


def test_a_state_file_missing_its_learner_key_is_refused_by_name(assets, tmp_path):
    # 091d311: KeyError: 'learner'.
    out = tmp_path / "run"
    GRPOTrainer(config=GRPOConfig(**settings(assets, out, steps=1))).train()
    state_file = out / "checkpoint-1" / "training_state.pt"
    state = torch.load(state_file, weights_only=True)
    del state["learner"]
    torch.save(state, state_file)
    grpo.checkpoint.store.write_manifest(out / "checkpoint-1")  # a consistent, hand-edited checkpoint
    trainer = GRPOTrainer(
        config=GRPOConfig(**settings(assets, out, steps=2, resume=str(out / "checkpoint-1")))
    )
    with pytest.raises(
        CheckpointError, match=r"its training_state\.pt lacks learner, which a resume restores"
    ):
        trainer.train()


def test_training_halted_is_what_nothing_trained_raises_in_python(assets, tmp_path):
    cfg = GRPOConfig(**settings(assets, tmp_path / "run", steps=1))
    with pytest.raises(TrainingHalted, match="none could train"):
        GRPOTrainer(config=cfg, reward_funcs=[no_signal]).train()
