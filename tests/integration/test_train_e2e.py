"""Short end-to-end runs on the bundled tiny model: it trains, saves, reloads and resumes."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo import GRPOConfig, GRPOTrainer, SimplePromptDataset
from grpo.cli import main as cli
from grpo.model.loading import bundled_model_path
from tests import tiny_run

pytestmark = pytest.mark.slow

SMALL = {
    "batch_size": 2,
    "num_generations": 4,
    "max_new_tokens": 24,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-3,
    "warmup_steps": 0,
    "logging_steps": 1,
    "progress_bar": False,
    "seed": 7,
    "eval_dataset": None,
    "num_threads": 1,
    "beta": 0.04,
    "tensorboard": True,
}


def shortness(prompts, completions, **_):
    """A reward that always has spread within a group, so every step has a gradient."""
    return [-len(c) / 50 for c in completions]


def run(output_dir, **overrides):
    cfg = GRPOConfig(**{**SMALL, "output_dir": str(output_dir), **overrides})
    return GRPOTrainer(config=cfg, reward_funcs=["gsm8k_correctness", "gsm8k_format", shortness]).train()


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """One 4-step run (saves at 2 and 4), read by the tests below and never written to: the same run
    that each of them would otherwise train for itself."""
    out = tmp_path_factory.mktemp("four") / "run"
    run(out, steps=4, save_steps=2)
    return out


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A 2-step run (its end saved as checkpoint-2 and final_model), the first half of both resume tests
    below; each resumes its own copy (tiny_run.copy_run keeps final_model's files linked to checkpoint-2's,
    as the run wrote them)."""
    out = tmp_path_factory.mktemp("two") / "run"
    run(out, steps=2, save_steps=2)
    return out


def test_short_run_trains_saves_and_reloads(four_steps):
    out = four_steps
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    for key in (
        "reward",
        "reward_std",
        "reward/gsm8k_correctness",
        "reward/shortness",
        "reward/gsm8k_format",
        "frac_zero_std_groups",
        "kl",
        "loss",
        "clip/low_frac",
        "clip/high_frac",
        "entropy",
        "completion_len/mean",
        "truncated_frac",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "time/rollout",
        "time/reward",
        "time/reference",
        "time/update",
        "advantage/std",
    ):
        assert key in lines[-1], key
    assert all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in lines)
    assert lines[-1]["kl"] > 0  # the policy moved away from the reference
    assert (out / "checkpoint-2" / "training_state.pt").is_file() and (out / "checkpoint-4").is_dir()
    assert any((out / "tensorboard").iterdir())
    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    AutoTokenizer.from_pretrained(out / "final_model")
    before = load_file(f"{bundled_model_path()}/model.safetensors")
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "training left most weights untouched"
    assert "hf_token: null" in (out / "config.yaml").read_text()
    for name in ("model.safetensors", "training_state.pt"):  # written once at the end, under two names
        assert os.path.samefile(out / "final_model" / name, out / "checkpoint-4" / name)


def test_resume_continues_exactly(four_steps, two_steps, tmp_path):
    straight = four_steps
    split = tiny_run.copy_run(two_steps, tmp_path / "split")
    run(split, steps=4, save_steps=2, resume="latest")
    lines = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]  # appended, not overwritten
    a = load_file(str(straight / "final_model" / "model.safetensors"))
    b = load_file(str(split / "final_model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    straight_lines = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert straight_lines[3]["reward"] == lines[3]["reward"] and straight_lines[3]["loss"] == lines[3]["loss"]


def test_resume_from_a_linked_final_model_continues_exactly(four_steps, two_steps, tmp_path):
    """final_model/ shares the last checkpoint's files (written once); resuming from it is resuming from
    that checkpoint, and the new run's saves leave the old files as they were. The straight side is the
    module's 4-step run (its own 3-step run cost more than the split side's fourth step)."""
    straight = four_steps
    split = tiny_run.copy_run(two_steps, tmp_path / "split")
    assert os.path.samefile(
        split / "final_model" / "model.safetensors", split / "checkpoint-2" / "model.safetensors"
    )
    before = (split / "checkpoint-2" / "model.safetensors").read_bytes()
    run(split, steps=4, save_steps=2, resume=str(split / "final_model"))
    steps = [json.loads(x)["step"] for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    a = load_file(str(straight / "final_model" / "model.safetensors"))
    b = load_file(str(split / "final_model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (split / "checkpoint-2" / "model.safetensors").read_bytes() == before


def test_seed_quick_start_runs_as_written(tmp_path):
    # The plain-PyTorch seed's quick start, with the bundled model's path in place of the hub name.
    model_name = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(model_name)
    ref_model = AutoModelForCausalLM.from_pretrained(model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    prompts = ["Your prompt 1", "Your prompt 2", "..."]
    dataset = SimplePromptDataset(prompts)
    config = GRPOConfig(
        batch_size=4,
        num_epochs=3,
        learning_rate=1e-6,
        num_generations_per_prompt=4,
        output_dir=str(tmp_path / "grpo_output"),
    )
    trainer = GRPOTrainer(
        model=model,
        ref_model=ref_model,
        reward_model=model,
        tokenizer=tokenizer,
        config=config,
        train_dataset=dataset,
    )
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "grpo_output" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 3 and "reward/reward_model_likelihood" in lines[-1]
    assert lines[-1]["reward"] < 0  # a mean log-likelihood
    AutoModelForCausalLM.from_pretrained(tmp_path / "grpo_output" / "final_model")
    assert (tmp_path / "grpo_output" / "final_model" / "training_state.pt").is_file()  # the seed's layout


def test_final_model_is_resumable_like_a_checkpoint(tmp_path):
    run(tmp_path / "a", steps=2, save_steps=0)
    run(tmp_path / "a", steps=3, save_steps=0, resume=str(tmp_path / "a" / "final_model"))
    assert [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]


def test_cli_train_eval_and_errors(tmp_path, capsys):
    out = tmp_path / "cli"
    code = cli(
        [
            "train",
            "--output-dir",
            str(out),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--num-generations",
            "4",
            "--max-new-tokens",
            "16",
            "--learning-rate",
            "1e-4",
            "--save-steps",
            "1",
            "--logging-steps",
            "1",
            "--seed",
            "3",
            "eval_before=false",
            "eval_after=false",
            "progress_bar=false",
            "train.gradient_accumulation_steps=1",
            "--hf_access_token",
            "hf_SECRETXYZ",
        ]
    )
    assert code == 0 and (out / "final_model" / "model.safetensors").is_file()
    leaked = [p for p in out.rglob("*") if p.is_file() and b"hf_SECRETXYZ" in p.read_bytes()]
    assert not leaked, f"the token reached {leaked}"
    assert (out / "checkpoint-1").is_dir()
    code = cli(
        [
            "train",
            "--output-dir",
            str(out),
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--num-generations",
            "4",
            "--max-new-tokens",
            "16",
            "--save-steps",
            "1",
            "--resume",
            "latest",
            "eval_before=false",
            "eval_after=false",
            "progress_bar=false",
            "train.gradient_accumulation_steps=1",
            "--seed",
            "3",
        ]
    )
    assert code == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    capsys.readouterr()
    assert cli(["eval", "--model", str(out / "final_model"), "--limit", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= result["accuracy"] <= 1.0 and result["n"] == 16
    assert cli(["train", "lerning_rate=1e-3"]) == 2
    assert "Did you mean 'learning_rate'" in capsys.readouterr().err
