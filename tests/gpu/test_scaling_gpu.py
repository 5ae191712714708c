"""Scale-out on CUDA: bf16 + LoRA on one GPU, NCCL DDP/FSDP2 and a Ray rollout GPU with two or more.
Skipped without CUDA (the CPU suite covers the same code paths with gloo and CPU actors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HERE = Path(__file__).parent
SMALL = {
    "batch_size": 4,
    "num_generations": 4,
    "max_new_tokens": 24,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-4,
    "warmup_steps": 0,
    "logging_steps": 1,
    "progress_bar": False,
    "seed": 7,
    "eval_dataset": None,
    "beta": 0.04,
    "tensorboard": False,
    "save_steps": 1,
}


def shortness(prompts, completions, **_):
    return [-len(c) / 50 for c in completions]


def test_lora_bf16_on_one_gpu(tmp_path):
    cfg = GRPOConfig(
        **{**SMALL, "output_dir": str(tmp_path), "steps": 2, "lora.enabled": True, "ref_device": "auto"}
    )
    trainer = GRPOTrainer(config=cfg, reward_funcs=[shortness])
    assert next(trainer.parts.policy.parameters()).dtype == torch.bfloat16
    trainer.train()
    assert (tmp_path / "final_model" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_nccl_two_processes(tmp_path, strategy):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parent / "integration")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE.parent / "integration" / "dist_worker.py"),
        str(tmp_path / "run"),
        "steps=2",
        f"strategy={strategy}",
        "save_steps=1",
        "model.dtype=float32",
    ]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "run" / "checkpoint-1" / "training_state.pt").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a learner GPU and a rollout GPU")
def test_ray_async_on_its_own_gpu(tmp_path):
    pytest.importorskip("ray")
    cfg = GRPOConfig(
        **{
            **SMALL,
            "output_dir": str(tmp_path),
            "steps": 3,
            "rollout.mode": "async",
            "trainer_devices_fraction": 0.5,
            "sampler_devices_fraction": 0.5,
        }
    )
    GRPOTrainer(config=cfg, reward_funcs=[shortness]).train()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(x["rollout/staleness"] <= 1 for x in lines)
