"""TRL users switch in one line: TRL's shipped reward functions train unchanged through grpo.GRPOTrainer on
TRL-style datasets, and a typical TRL GRPO script runs with its import swapped. Skipped without trl."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.slow
PROBLEMS = [
    ("Maya has 6 stamps. Hugo has 2 times as many. How many does Hugo have?", "12"),
    ("Yuki has 9 pens and loses 4. How many are left?", "5"),
    ("What is 7 + 8?", "15"),
    ("Hugo has 3 bags of 4 apples. How many apples?", "12"),
]


def _trl_args(tmp_path: Path, **kwargs) -> GRPOConfig:
    # TRL's field names; `report` is ours (no HTML report in a test)
    return GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        beta=0.04,
        report=False,
        **kwargs,
    )


def _last_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def _trl_rewards():
    from trl.rewards import (
        accuracy_reward,
        get_cosine_scaled_reward,
        get_repetition_penalty_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "cosine_scaled_reward": get_cosine_scaled_reward(max_len=16),
        "repetition_penalty_reward": get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0),
        "soft_overlong_punishment_reward": get_soft_overlong_punishment(
            max_completion_len=16, soft_punish_cache=4
        ),
    }


def test_trls_six_reward_functions_train_unchanged_on_a_conversational_dataset(tmp_path):
    seen = {}

    def vandal(prompts, completions, solution, completion_ids, trainer_state, **_):
        # TRL's contract: prompts as the dataset gave them, completions as assistant messages, every column
        # under its own name, token ids, the trainer state. Then it edits its inputs: nobody else may see
        # that.
        seen.update(
            prompt=prompts[0],
            completion=completions[0],
            solution=solution[0],
            ids=completion_ids[0],
            step=trainer_state.global_step,
            epoch=trainer_state.epoch,
        )
        for completion in completions:
            completion[0]["content"] = "EDITED"
        return [0.0] * len(prompts)

    rewards = _trl_rewards()
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q}], "solution": f"${a}$"} for q, a in PROBLEMS]
    )
    trainer = GRPOTrainer(
        model="tiny-math-lm",
        reward_funcs=[vandal, *rewards.values()],
        args=_trl_args(tmp_path),
        train_dataset=dataset,
    )
    trainer.train()
    metrics = _last_metrics(tmp_path)
    # each function ran on every completion and is logged on its own; accuracy rewards may be 0, not missing
    for name in rewards:
        assert math.isfinite(metrics[f"reward/{name}"]), name
    assert seen["prompt"] in [[{"role": "user", "content": q}] for q, _ in PROBLEMS]
    assert seen["completion"][0]["role"] == "assistant" and isinstance(seen["completion"][0]["content"], str)
    assert seen["solution"].startswith("$") and seen["step"] == 1 and seen["epoch"] == 0.0
    assert seen["ids"] and all(isinstance(i, int) for i in seen["ids"])
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and not any(s["completion"] == "EDITED" for s in samples)  # what the model wrote
    assert (tmp_path / "final_model" / "training_state.pt").is_file()


def test_trls_token_id_rewards_train_on_plain_prompts(tmp_path):
    # On plain-text prompts TRL itself runs only the rewards that read completion_ids (the others index
    # completion[0]["content"]); here completions stay plain strings, as in TRL.
    rewards = _trl_rewards()
    plain = [rewards["repetition_penalty_reward"], rewards["soft_overlong_punishment_reward"]]
    seen = {}

    def text_check(completions, **_):
        seen["completion"] = completions[0]
        return [float(len(c) > 3) for c in completions]

    dataset = Dataset.from_list([{"prompt": q, "solution": a} for q, a in PROBLEMS])
    trainer = GRPOTrainer(
        model="tiny-math-lm",
        reward_funcs=[*plain, text_check],
        args=_trl_args(tmp_path),
        train_dataset=dataset,
    )
    trainer.train()
    metrics = _last_metrics(tmp_path)
    for name in ("repetition_penalty_reward", "soft_overlong_punishment_reward", "text_check"):
        assert math.isfinite(metrics[f"reward/{name}"]), name
    assert isinstance(seen["completion"], str)


TRL_SCRIPT = """
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

dataset = Dataset.from_list(
    [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i)}
     for i in range(8)]
)


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO", per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=16, max_steps=2, logging_steps=1, learning_rate=1e-5,
                           report_to="none", save_strategy="no", gradient_checkpointing=False)
trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len, args=training_args,
                      train_dataset=dataset,
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
trainer.train()
trainer.save_model("Qwen2-0.5B-GRPO/saved")
"""


def test_a_typical_trl_script_runs_by_swapping_the_import(tmp_path):
    pytest.importorskip("peft")
    script = TRL_SCRIPT.replace("from trl import", "from grpo import").replace(
        '"Qwen/Qwen2-0.5B-Instruct"', '"tiny-math-lm"'
    )  # the one model available offline
    (tmp_path / "script.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "Qwen2-0.5B-GRPO"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "reward" in json.loads(line)] == [1, 2]
    assert (run / "saved" / "config.json").is_file() and (run / "final_model" / "config.json").is_file()


def test_trainer_refuses_trl_arguments_it_cannot_honour(tmp_path):
    from grpo.config import ConfigError

    with pytest.raises(ConfigError, match="TrainerCallbacks"):
        GRPOTrainer(model="tiny-math-lm", reward_funcs=len, args=_trl_args(tmp_path), callbacks=[object()])
    with pytest.raises(ConfigError, match="both config= and args="):
        GRPOTrainer(config=_trl_args(tmp_path), args=_trl_args(tmp_path))
