"""Mixed precision end to end on the CPU: `grpo train model.dtype=bfloat16` at lr 1e-6 trains (issue 12),
float16 runs with a loss scaler, save_dtype exports, and NaN weights end the run with an error."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.cli import main
from grpo.learner import NonFiniteWeightsError
from grpo.model.loading import bundled_model_path
from tests import tiny_run
from tests.tiny_run import letter_score

pytestmark = pytest.mark.slow

SMALL = [
    "train.prompts_per_step=4",
    "generation.num_generations=4",
    "generation.max_new_tokens=16",
    "train.eval_before=false",
    "train.eval_after=false",
    "train.report=false",
    "train.progress_bar=false",
    "train.num_threads=1",
    "train.logging_steps=1",
    "train.save_steps=0",
]


def changed_fraction(before: dict, after: dict) -> float:
    return sum((before[k] != after[k].to(before[k].dtype)).sum().item() for k in before) / sum(
        v.numel() for v in before.values()
    )


def test_cli_bf16_at_lr_1e_6_moves_the_saved_weights_and_tracks_float32(tmp_path):
    initial = load_file(str(Path(bundled_model_path()) / "model.safetensors"))
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert (
            main(
                [
                    "train",
                    f"model.dtype={dtype}",
                    "optim.learning_rate=1e-6",
                    "--steps",
                    "3",
                    "--output-dir",
                    str(out),
                    *SMALL,
                ]
            )
            == 0
        )
        saved = load_file(str(out / "final_model" / "model.safetensors"))
        assert {v.dtype for v in saved.values()} == {torch.float32}  # the masters
        runs[dtype] = {
            "moved": changed_fraction(initial, saved),
            "metrics": [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()],
        }
    assert runs["bfloat16"]["moved"] >= 0.9  # measured 0.9966 (float32: 0.9967); bf16 parameters: 0.010
    assert (
        "Precision: float32 master weights and AdamW state, bfloat16 compute"
        in (tmp_path / "bfloat16" / "train.log").read_text()
    )
    # The runs sample different tokens once bf16 logits differ from float32's, so the rewards part ways by
    # sampling noise, not drift (measured on an AVX2 EPYC: per-step |Δ reward| 0.006, 0.06, 0.19; of the
    # 3-step mean 0.04). Which tokens differ depends on the CPU's bf16 rounding, so the bound is the noise's,
    # not one host's draw: 16 completions a step give each step's mean reward a std of up to 0.125, the
    # difference of two 3-step means up to ~0.1, and 0.3 is three of those. What it catches: bf16 training
    # that collapses (rewards to 0) or diverges.
    rewards = {d: [m["reward"] for m in r["metrics"]] for d, r in runs.items()}
    assert abs(sum(rewards["float32"]) - sum(rewards["bfloat16"])) / 3 < 0.3, rewards
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in runs["bfloat16"]["metrics"])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {
        "model": tiny_run.make_model_dir(root / "model"),
        "data": tiny_run.write_dataset(root / "d.jsonl", 6),
    }


def train(assets, out, **overrides):
    cfg = GRPOConfig(**tiny_run.config(assets["model"], assets["data"], out, **overrides))
    return GRPOTrainer(config=cfg, reward_funcs=[letter_score, "gsm8k_format"]).train()


def test_save_dtype_exports_bfloat16_final_model_and_keeps_float32_checkpoints(assets, tmp_path):
    train(assets, tmp_path, steps=2, save_dtype="bfloat16", dtype="bfloat16")
    final, ckpt = tmp_path / "final_model", tmp_path / "checkpoint-2"
    masters = load_file(str(ckpt / "model.safetensors"))
    exported = load_file(str(final / "model.safetensors"))
    assert {v.dtype for v in masters.values()} == {torch.float32}
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    assert all(torch.equal(exported[k], masters[k].to(torch.bfloat16)) for k in masters)
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(final).dtype == torch.bfloat16


def test_float16_run_uses_a_loss_scaler_and_keeps_weights_finite(assets, tmp_path):
    summary = train(assets, tmp_path, steps=3, dtype="float16")
    assert summary["amp/loss_scale"] > 0 and "amp/overflow" in summary
    saved = load_file(str(tmp_path / "final_model" / "model.safetensors"))
    assert all(v.isfinite().all() for v in saved.values())
    state = torch.load(tmp_path / "checkpoint-3" / "training_state.pt", weights_only=True)
    assert "grad_scaler" in state["learner"]  # resumes with the scale it had


def test_nan_weights_stop_the_run_with_an_error_and_keep_earlier_checkpoints(assets, tmp_path, monkeypatch):
    step = torch.optim.AdamW.step
    calls = []

    def corrupting_step(self, *args, **kwargs):  # injected: the second update writes NaN into a weight
        out = step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            self.param_groups[0]["params"][0].data.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", corrupting_step)
    with pytest.raises(NonFiniteWeightsError, match="stopped before saving"):
        train(assets, tmp_path, steps=4)
    assert (tmp_path / "checkpoint-1").is_dir()
    assert not (tmp_path / "checkpoint-2").exists() and not (tmp_path / "final_model").exists()
    kept = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    assert all(v.isfinite().all() for v in kept.values())


def test_lora_in_bf16_keeps_float32_adapters_over_a_bf16_base(assets, tmp_path):
    cfg = GRPOConfig(
        **tiny_run.config(
            assets["model"],
            assets["data"],
            tmp_path,
            steps=2,
            dtype="bfloat16",
            **{"lora.enabled": True, "lora.r": 4},
        )
    )
    trainer = GRPOTrainer(config=cfg, reward_funcs=[letter_score, "gsm8k_format"])
    params = dict(trainer.parts.policy.named_parameters())
    assert {p.dtype for n, p in params.items() if p.requires_grad} == {torch.float32}  # the adapters
    assert {p.dtype for n, p in params.items() if not p.requires_grad} == {torch.bfloat16}  # the frozen base
    before = {n: p.detach().clone() for n, p in params.items() if "lora_B" in n}
    summary = trainer.train()
    assert torch.isfinite(torch.tensor([summary["loss"], summary["kl"]])).all()
    assert any(not torch.equal(before[n], params[n]) for n in before)  # the adapters trained
    merged = load_file(str(tmp_path / "final_model" / "model.safetensors"))
    assert {v.dtype for v in merged.values()} == {torch.float32}


# test_fsdp2_mixed_precision_policy_on_two_cpu_processes lives in test_distributed.py: it shares that module's
# torchrun job (one two-process start-up for every two-process run).
