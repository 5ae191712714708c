"""Mixed precision on CUDA: float32 masters with bf16 compute on one GPU, FSDP2's MixedPrecisionPolicy under
torchrun, and the bundled demo trained in bf16 must learn. Skipped without CUDA (tests/unit/test_precision.py
and tests/integration/test_mixed_precision.py cover the same code on the CPU)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import load_config
from grpo.learner import Learner
from grpo.model.forward import PolicyForward, token_logprobs
from grpo.model.loading import bundled_model_path
from tests.unit.test_precision import bundled_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HERE = Path(__file__).parent


def changed_fraction(before: dict, after: dict) -> float:
    return sum(
        (before[k] != after[k].to(before[k].device, before[k].dtype)).sum().item() for k in before
    ) / sum(v.numel() for v in before.values())


@pytest.mark.parametrize("engine", ["native", "transformers"])
def test_bf16_learner_on_cuda_steps_float32_masters_at_lr_1e_6(engine):
    model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).cuda().train()
    cfg = GRPOConfig(
        batch_size=2,
        num_generations=2,
        max_new_tokens=12,
        learning_rate=1e-6,
        warmup_steps=0,
        engine=engine,
        dtype="auto",
        device="cuda",
    ).validate()
    learner = Learner(model, None, cfg, total_optimizer_steps=4)
    assert learner.compute_dtype == torch.bfloat16 and learner.scaler is None  # auto on CUDA = bf16
    before = copy.deepcopy(model.state_dict())
    batch = bundled_batch()
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * batch.completion_mask
    learner.train_step(batch)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert changed_fraction(before, model.state_dict()) >= 0.9


def test_bf16_forward_on_cuda_matches_transformers_own_bf16_forward():
    batch = bundled_batch()
    own = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.bfloat16).cuda().eval()
    masters = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        expected, _ = token_logprobs(own, batch, 1.0)
        native, _ = PolicyForward(masters, native=True, compute_dtype=torch.bfloat16)(batch, 1.0)
        autocast, _ = PolicyForward(masters, native=False, compute_dtype=torch.bfloat16)(batch, 1.0)
    # CPU tolerances (tests/unit/test_precision.py); CUDA's bf16 kernels round in the same places.
    assert (native - expected).abs().max() < 0.1 and (native - expected).abs().mean() < 0.01
    assert (autocast - expected).abs().max() < 0.1 and (autocast - expected).abs().mean() < 0.03


@pytest.mark.parametrize("procs", [1, 2])
def test_fsdp2_mixed_precision_policy_trains_float32_masters(tmp_path, procs):
    if torch.cuda.device_count() < procs:
        pytest.skip(f"needs {procs} GPUs")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(HERE.parents[1] / "src"), str(HERE.parents[1]), str(HERE.parent / "integration")]
        ),
    }
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(procs),
        str(HERE.parent / "integration" / "dist_worker.py"),
        str(run),
        "steps=3",
        "strategy=fsdp2",
        "model.dtype=bfloat16",
        "optim.learning_rate=1e-6",
        "save_steps=1",
    ]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "bfloat16 compute (FSDP2 MixedPrecisionPolicy" in (run / "train.log").read_text()
    initial = load_file(str(Path(bundled_model_path()) / "model.safetensors"))
    saved = load_file(str(run / "final_model" / "model.safetensors"))
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert changed_fraction(initial, saved) >= 0.9


def test_bundled_demo_in_bf16_on_cuda_learns(tmp_path):
    """The `grpo train` demo (80 steps, tiny_math) in bf16 compute: held-out accuracy up ≥ 15 points."""
    cfg = load_config(
        "tiny_math",
        {
            "output_dir": str(tmp_path),
            "model.dtype": "bfloat16",
            "model.device": "cuda",
            "eval_steps": 0,
            "report": False,
            "progress_bar": False,
        },
    )
    summary = GRPOTrainer(config=cfg).train()
    before, after = summary["eval/accuracy_before"], summary["eval/accuracy_after"]
    assert after - before >= 0.15, (before, after)
    saved = load_file(str(tmp_path / "final_model" / "model.safetensors"))
    assert {v.dtype for v in saved.values()} == {torch.float32}
