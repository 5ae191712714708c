"""Exact resume (mid-epoch and at an epoch boundary), graceful stop on SIGINT/SIGTERM, the second signal,
and non-finite steps: skipped, counted, then a stop with a checkpoint."""

import signal
import threading
import time

import pytest
import torch

import grpo.learner
from grpo import GRPOConfig, GRPOTrainer
from grpo.run.lifecycle import TrainingStopped
from grpo.train import TrainingHalted
from tests import tiny_run
from tests.tiny_run import letter_score, metrics, same_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {"model": tiny_run.make_model_dir(root / "model"), "root": root}


class SignalAt:
    """letter_score, plus: send `signals` to this process while step `step` is being scored."""

    __name__ = "letter_score"

    def __init__(self, step: int, *signals: int):
        self.step, self.signals, self.calls = step, signals, 0

    def __call__(self, prompts, completions, **columns):
        self.calls += 1
        if self.calls == self.step:
            for sig in self.signals:
                # Rewards run on a worker thread (algorithm.reward_timeout) and Python runs handlers on the
                # main thread: signal that thread, as a terminal's Ctrl-C would, one signal at a time.
                signal.pthread_kill(threading.main_thread().ident, sig)
                time.sleep(0.3)
        return letter_score(prompts, completions, **columns)


def train(assets, rows, out, reward=letter_score, **overrides):
    data = tiny_run.write_dataset(assets["root"] / f"data{rows}.jsonl", rows)
    cfg = GRPOConfig(**tiny_run.config(assets["model"], data, out, **overrides))
    trainer = GRPOTrainer(config=cfg, reward_funcs=[reward, "gsm8k_format"])
    try:
        return trainer, trainer.train()
    except TrainingStopped as stopped:  # a stop signal: saved, then raised to the caller (issue 33)
        return trainer, stopped


@pytest.mark.parametrize(
    "rows,length,stop_at,sig,position",
    [
        (5, {"steps": 4}, 2, signal.SIGINT, {"epoch": 0, "position": 4}),  # mid-epoch: 4 of 5 prompts used
        (
            6,
            {"num_epochs": 2},
            3,
            signal.SIGTERM,
            {"epoch": 0, "position": 6},
        ),  # exactly at the epoch boundary
    ],
    ids=["mid_epoch", "epoch_boundary"],
)
def test_stop_and_resume_equals_an_uninterrupted_run(assets, tmp_path, rows, length, stop_at, sig, position):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(assets, rows, straight, **length)
    trainer, stopped = train(assets, rows, split, reward=SignalAt(stop_at, sig), **length)
    assert trainer.stop_signal == sig
    assert isinstance(stopped, TrainingStopped) and (stopped.signal, stopped.step) == (sig, stop_at)
    assert {p.name for p in split.glob("checkpoint-*")} == {f"checkpoint-{i}" for i in range(1, stop_at + 1)}
    assert not (split / "final_model").exists()
    log = (split / "train.log").read_text()
    assert f"Stopped at step {stop_at} of" in log and "trainer.train(resume_from_checkpoint=True)" in log
    state = torch.load(split / f"checkpoint-{stop_at}" / "training_state.pt", weights_only=True)
    assert {k: state["data"][k] for k in ("epoch", "position")} == position
    # the same reward object as the stopped run (config.yaml records it: issue 33), signalling no more
    train(assets, rows, split, reward=SignalAt(0), resume="latest", **length)
    assert same_weights(straight / "final_model", split / "final_model")  # bitwise
    assert metrics(split) == metrics(straight)  # every logged value, steps appended once each
    total = length.get("steps") or 6
    assert [m["step"] for m in metrics(split)] == list(range(1, total + 1))


def test_a_second_signal_stops_at_once_without_saving(assets, tmp_path):
    out = tmp_path / "run"
    # Whatever the handler was (default_int_handler, or SIG_IGN when pytest runs as a background job).
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(assets, 6, out, steps=4, reward=SignalAt(2, signal.SIGINT, signal.SIGINT))
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-1"]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    train(assets, 6, out, steps=4, reward=SignalAt(0), resume="latest")
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run_with_a_checkpoint(
    assets, tmp_path, monkeypatch
):
    make_real = grpo.learner.make_policy_loss  # the learner binds its loss once (algorithm/loss.py)
    calls = []

    def make_poisoned(algorithm):
        real = make_real(algorithm)

        def poisoned(*args, **kwargs):
            out = real(*args, **kwargs)
            calls.append(1)
            if len(calls) >= 2:  # from step 2 on
                out.loss = out.loss * float("nan")
            return out

        return poisoned

    monkeypatch.setattr(grpo.learner, "make_policy_loss", make_poisoned)
    out = tmp_path / "run"
    with pytest.raises(
        TrainingHalted,
        match=r"2 steps in a row had a non-finite loss or gradient \(last: step 3\); "
        r"stopped with checkpoint .*checkpoint-3\. .*train.stop_after_nonfinite_steps",
    ):
        train(assets, 6, out, steps=6, stop_after_nonfinite_steps=2)
    logged = metrics(out)
    assert [m["skipped_nonfinite"] for m in logged] == [0.0, 1.0, 1.0]
    assert [m["nonfinite_steps_total"] for m in logged] == [0, 1, 2]
    assert same_weights(out / "checkpoint-1", out / "checkpoint-3")  # skipped steps changed nothing
    state = torch.load(out / "checkpoint-3" / "training_state.pt", weights_only=True)
    assert state["nonfinite_in_a_row"] == 2 and state["nonfinite_total"] == 2


TERM_AT = None  # set per test: the reward (by import path) that sends the first SIGTERM


def test_a_second_signal_during_the_stop_checkpoint_exits_130_and_says_so(
    assets, tmp_path, monkeypatch, capsys
):
    import yaml

    import grpo.checkpoint.store
    from grpo import cli

    out, data = tmp_path / "run", tiny_run.write_dataset(tmp_path / "data.jsonl", 6)
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "TERM_AT", SignalAt(3, signal.SIGTERM))
    real_point = grpo.checkpoint.store._fault_point

    def second_signal_inside_the_stop_save(path, point):
        if path.name == "checkpoint-3" and point == "state":  # weights and state written, no manifest yet
            signal.raise_signal(signal.SIGTERM)
        real_point(path, point)

    monkeypatch.setattr(grpo.checkpoint.store, "_fault_point", second_signal_inside_the_stop_save)
    settings = tiny_run.config(
        assets["model"],
        data,
        out,
        steps=6,
        save_steps=2,
        reward_funcs=[f"{__name__}:TERM_AT", "gsm8k_format"],
        # TERM_AT counts its calls and signals the trainer's thread: named by path, it must be kept in-process
        reward_isolation="thread",
    )
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(settings))

    def outside_the_run(signum, frame):  # where the signal lands if the run's own handler is not installed
        raise AssertionError("the second SIGTERM reached the handler from before the run")

    before = signal.signal(signal.SIGTERM, outside_the_run)
    try:
        assert cli.main(["train", "--config", str(config)]) == 130
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"grpo train: stopped at once, without saving; grpo train --resume --output-dir {out} continues the "
        "run from its last checkpoint."
    )
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # no .tmp left behind
    assert grpo.checkpoint.store.verify_checkpoint(out / "checkpoint-2") is None
