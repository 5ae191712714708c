"""The rollout source owns its engine: it builds it (nothing else does), evaluates with it, and closes it
when the run ends, however it ends. The Ray source evaluates on an actor that holds the newest weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import grpo.rollout
from grpo import GRPOConfig, GRPOTrainer
from grpo.rollout.native import NativeEngine
from grpo.rollout.ray import RayRollout
from tests import tiny_run


def _trainer(tmp_path, **overrides) -> GRPOTrainer:
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 8)
    cfg = GRPOConfig(**tiny_run.config(model, data, tmp_path / "run", steps=1, **overrides))
    return GRPOTrainer(config=cfg)


class ClosingEngine(NativeEngine):
    def __init__(self, *args, events: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = events

    def generate(self, *args, **kwargs):
        self.events.append("generate")
        return super().generate(*args, **kwargs)

    def close(self):
        self.events.append("close")


def test_assembling_a_run_builds_no_engine(tmp_path, monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("an engine was built outside the rollout source")

    monkeypatch.setattr(grpo.rollout, "build_engine", refuse)
    monkeypatch.setattr("grpo.rollout.colocated.build_engine", refuse)
    trainer = _trainer(tmp_path)
    assert trainer.parts.engine is None  # the source builds its own when training starts
    with pytest.raises(AssertionError, match="outside the rollout source"):
        trainer.train()


def test_the_source_evaluates_with_its_engine_and_closes_it_after_the_final_evaluation(tmp_path):
    trainer = _trainer(tmp_path, eval_dataset=str(tmp_path / "data.jsonl"), eval_after=True)
    events: list[str] = []
    trainer.parts.engine = ClosingEngine(trainer.parts.policy, trainer.parts.tokenizer, events=events)
    summary = trainer.train()
    assert "eval/accuracy_after" in summary
    assert events[-1] == "close" and events.count("close") == 1
    assert events[-2] == "generate"  # the final evaluation sampled before the engine closed
    assert trainer.source is None


def test_the_engine_is_closed_when_a_step_fails(tmp_path):
    trainer = _trainer(tmp_path)
    events: list[str] = []

    class Failing(ClosingEngine):
        def generate(self, *args, **kwargs):
            raise RuntimeError("sampler exploded")

    trainer.parts.engine = Failing(trainer.parts.policy, trainer.parts.tokenizer, events=events)
    with pytest.raises(RuntimeError, match="sampler exploded"):
        trainer.train()
    assert events == ["close"]


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


def test_ray_evaluation_samples_with_the_newest_weights(monkeypatch):
    """weight_sync_steps=4: at step 6 the actors hold step 4's weights; evaluating first pushes step 6's."""
    log = []
    actor = SimpleNamespace(
        load_weights=_Remote(lambda weights, version: log.append(("load", version)) or version),
        generate=_Remote(lambda prompts, n, sampling, chunk: log.append(("generate",)) or (prompts, "r", 0)),
    )
    source = RayRollout.__new__(RayRollout)
    source.actors, source.chunk_prompts, source.timeout = [actor], None, 5
    source.d = SimpleNamespace(weight_sync_steps=4)
    source.spec = SimpleNamespace(lora=None)
    source.rt = SimpleNamespace(full_named_parameters=lambda policy, only=None: policy.named_parameters())
    source.policy, source.pushed = None, -1
    source.live = False  # no agent runner: weights go between batches
    monkeypatch.setattr("ray.put", lambda x: x, raising=False)
    monkeypatch.setattr(RayRollout, "_get", lambda self, ref, what: ref)
    policy = torch.nn.Linear(2, 2)
    for step in range(7):
        source.sync_weights(step, policy)
    assert log == [("load", 0), ("load", 4)]
    assert source.sample("prompts", 1, None) == ("prompts", "r")
    assert log[-2:] == [("load", 6), ("generate",)]
