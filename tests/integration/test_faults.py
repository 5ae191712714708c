"""A learner failure stops the run with a clear message and leaves a checkpoint that resumes."""

from __future__ import annotations

import json

import pytest

from grpo import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.slow

SMALL = {
    "batch_size": 2,
    "num_generations": 4,
    "max_new_tokens": 12,
    "gradient_accumulation_steps": 1,
    "learning_rate": 1e-4,
    "warmup_steps": 0,
    "logging_steps": 1,
    "progress_bar": False,
    "seed": 3,
    "eval_dataset": None,
    "num_threads": 1,
    "beta": 0.0,
    "tensorboard": False,
    "save_steps": 2,
}


def test_learner_failure_names_the_checkpoint_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    calls = {"n": 0}

    def breaks_at_step_3(prompts, completions, **_):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("reward server unreachable.")  # a sentence of its own
        return [-len(c) / 50 for c in completions]

    cfg = GRPOConfig(**{**SMALL, "output_dir": str(out), "steps": 4})
    with pytest.raises(Exception, match="unreachable"):
        GRPOTrainer(config=cfg, reward_funcs=[breaks_at_step_3]).train()
    message = (out / "train.log").read_text()
    assert "Training stopped at step 3" in message and "reward server unreachable" in message
    # The error's own final period does not double where the sentence goes on.
    assert "unreachable.." not in message and "unreachable. on" not in message
    assert f"the latest checkpoint is {out / 'checkpoint-2'}" in message and (
        "trainer.train(resume_from_checkpoint=True)" in message  # a Python run is resumed from Python
    )
    cfg = GRPOConfig(**{**SMALL, "output_dir": str(out), "steps": 4, "resume": "latest"})
    GRPOTrainer(config=cfg, reward_funcs=[breaks_at_step_3]).train()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and (out / "final_model" / "model.safetensors").is_file()
