"""A whole run with replay (model/replay.py) is the run without it, to float32 rounding: same losses, and
the weights as `assert_same_training` says; and replay did serve every update's micro-batches."""

from __future__ import annotations

import pytest
import torch

import grpo.model.packed
from grpo import GRPOConfig, GRPOTrainer
from tests import tiny_run
from tests.integration.test_single_turn_unchanged import assert_same_training


def test_a_run_with_replay_trains_as_the_run_without(tmp_path, monkeypatch):
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 6)
    replayed = []
    real = grpo.model.packed.replayed_hidden

    def counting(*args, **kwargs):
        replayed.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo.model.packed, "replayed_hidden", counting)
    runs = {}
    for replay in (False, None):  # None: the default, on where it holds
        out = tmp_path / f"run-{replay}"
        settings = tiny_run.config(model, data, out, steps=2, save_steps=0, report=False)
        cfg = GRPOConfig(**settings, replay_rollout_forward=replay)
        summary = GRPOTrainer(config=cfg).train()
        runs[replay] = (
            [m["loss"] for m in tiny_run.metrics(out) if "loss" in m],
            tiny_run.weights(out / "final_model"),
        )
        assert summary
        said = [m.get("replay/frac") for m in tiny_run.metrics(out) if "loss" in m]
        assert said == ([None, None] if replay is False else [1.0, 1.0])  # the metric says what happened
        if replay is False:
            assert not replayed
    assert len(replayed) == 2  # one micro-batch an update (gradient_accumulation_steps 1), two steps
    assert len(runs[None][0]) == 2
    assert runs[None][0] == pytest.approx(runs[False][0], rel=1e-5, abs=1e-7)
    assert_same_training(tiny_run.weights(model), runs[False][1], runs[None][1])


def no_signal(prompts, completions, **_):
    return [None] * len(completions)


def test_a_run_with_replay_and_no_reward_signal_keeps_the_starting_weights_bitwise(tmp_path, monkeypatch):
    # Before the reference was the update's own log-probs while the weights are π_ref's, the replayed
    # log-probs (decode GEMM shapes) differed from the reference forward's by float32 rounding: a KL
    # gradient of ~1e-9 that AdamW normalised into a weight change on a step with no signal.
    import grpo.learner
    from grpo.train import TrainingHalted

    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 4)
    replayed, referenced = [], []
    real = grpo.model.packed.replayed_hidden
    monkeypatch.setattr(
        grpo.model.packed, "replayed_hidden", lambda *a, **k: replayed.append(1) or real(*a, **k)
    )
    ref = grpo.learner.Learner.reference_logprobs
    monkeypatch.setattr(
        grpo.learner.Learner, "reference_logprobs", lambda *a, **k: referenced.append(1) or ref(*a, **k)
    )
    out = tmp_path / "run"
    no_rewards = [f"{__name__}:no_signal"]
    settings = tiny_run.config(model, data, out, steps=2, save_steps=0, report=False, reward_funcs=no_rewards)
    cfg = GRPOConfig(**settings, replay_rollout_forward=True)
    with pytest.raises(TrainingHalted, match="none could train"):
        GRPOTrainer(config=cfg).train()
    assert len(replayed) == 2 and not referenced  # replayed; π_ref = the policy at both steps
    start, final = tiny_run.weights(model), tiny_run.weights(out / "final_model")
    assert start.keys() == final.keys()
    assert all(torch.equal(start[k], final[k]) for k in start)
