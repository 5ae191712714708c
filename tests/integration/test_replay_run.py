"""A whole run with replay (model/replay.py) is the run without it, to float32 rounding: same losses, and
the weights as `assert_same_training` says; and replay did serve every update's micro-batches."""

from __future__ import annotations

import pytest

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
    for replay in (False, True):
        out = tmp_path / f"run-{replay}"
        settings = tiny_run.config(model, data, out, steps=2, save_steps=0, report=False)
        cfg = GRPOConfig(**settings, replay_rollout_forward=replay)
        summary = GRPOTrainer(config=cfg).train()
        runs[replay] = (
            [m["loss"] for m in tiny_run.metrics(out) if "loss" in m],
            tiny_run.weights(out / "final_model"),
        )
        assert summary
        if replay is False:
            assert not replayed
    assert len(replayed) == 2  # one micro-batch an update (gradient_accumulation_steps 1), two steps
    assert len(runs[True][0]) == 2
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5, abs=1e-7)
    assert_same_training(tiny_run.weights(model), runs[False][1], runs[True][1])
