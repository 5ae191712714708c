"""End to end on the bundled tiny model: a failing reward stops the run with a clear message and keeps what
was saved (or is skipped and counted); dynamic sampling, overlong shaping, GSPO, the entropy bonus, best-model
keeping, samples.jsonl and the report all work together."""

import json
import math
import time

import pytest
from transformers import AutoModelForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.rewards import NonFiniteRewardError, RewardError, RewardTimeoutError

pytestmark = pytest.mark.slow

SMALL = {
    "batch_size": 2,
    "num_generations": 4,
    "max_new_tokens": 16,
    "gradient_accumulation_steps": 1,
    "learning_rate": 1e-3,
    "warmup_steps": 0,
    "logging_steps": 1,
    "progress_bar": False,
    "seed": 7,
    "eval_dataset": None,
    "num_threads": 1,
    "beta": 0.0,
    "tensorboard": False,
    "report": False,
}


def shortness(prompts, completions, **_):
    return [-len(c) / 50 for c in completions]


class FailsFromCall:
    """A reward that works for `healthy` batch calls, then raises, hangs or returns NaN on the last sample."""

    def __init__(self, how: str, healthy: int):
        self.how, self.healthy, self.calls = how, healthy, 0
        self.__name__ = f"flaky_{how}"

    def __call__(self, prompts, completions, **_):
        self.calls += 1
        if self.calls <= self.healthy:
            return [0.0] * len(completions)
        if self.how == "raise":
            raise RuntimeError("grader crashed")
        if self.how == "sleep":
            time.sleep(3600)
        return [0.0] * (len(completions) - 1) + [math.nan]


@pytest.mark.parametrize(
    ("how", "error"), [("raise", RewardError), ("sleep", RewardTimeoutError), ("nan", NonFiniteRewardError)]
)
def test_failing_reward_stops_with_a_clear_message_and_keeps_saved_checkpoints(tmp_path, how, error):
    out = tmp_path / how
    cfg = GRPOConfig(**SMALL, output_dir=str(out), steps=4, save_steps=1, reward_timeout=0.5)
    with pytest.raises(error, match=f"reward function 'flaky_{how}'.* (on|for) sample") as raised:
        GRPOTrainer(config=cfg, reward_funcs=[shortness, FailsFromCall(how, healthy=2)]).train()
    assert "prompt:" in str(raised.value) and "completion:" in str(raised.value)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")  # what was saved is still whole
    assert (out / "checkpoint-2" / "training_state.pt").is_file()


def test_skip_policy_counts_the_failures_and_finishes(tmp_path):
    out = tmp_path / "skip"
    cfg = GRPOConfig(**SMALL, output_dir=str(out), steps=3, save_steps=0, reward_on_error="skip")
    GRPOTrainer(config=cfg, reward_funcs=[shortness, FailsFromCall("raise", healthy=1)]).train()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["reward/skipped"] for x in lines] == [0.0, 8.0, 8.0]  # every sample of steps 2 and 3
    assert (out / "final_model").is_dir()


def test_dapo_gspo_entropy_best_model_samples_and_report(tmp_path):
    out = tmp_path / "all"
    cfg = GRPOConfig(
        **{**SMALL, "report": True, "eval_dataset": "tiny_math:test"},
        output_dir=str(out),
        steps=2,
        save_steps=0,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=3,
        overlong_buffer=4,
        loss_variant="gspo",
        entropy_coef=0.01,
        eval_max_samples=4,
        eval_before=True,
        eval_after=True,
        metric_for_best_model="eval/accuracy",
        log_samples=3,
    )
    GRPOTrainer(config=cfg, reward_funcs=["gsm8k_correctness", "gsm8k_format"]).train()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "reward" in x]
    assert all(1 <= x["dynamic_sampling/rounds"] <= 3 for x in steps)
    assert all(x["groups/generated"] == 2 * x["dynamic_sampling/rounds"] for x in steps)
    assert all(0.0 <= x["groups/informative_frac"] <= 1.0 for x in steps)
    best = json.loads((out / "best_model" / "best.json").read_text())
    assert best["metric"] == "eval/accuracy" and best["step"] == 0  # kept from the first evaluation on
    AutoModelForCausalLM.from_pretrained(out / "best_model")
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    assert set(samples[0]) >= {
        "prompt",
        "completion",
        "reward",
        "advantage",
        "rewards",
        "length",
        "truncated",
    }
    assert (out / "report" / "index.html").is_file() and (out / "report" / "reward.png").is_file()
