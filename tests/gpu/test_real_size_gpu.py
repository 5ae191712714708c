"""Real-size architectures (random weights, published configs) at bf16 on one GPU: 2 GRPO steps each,
finite loss, weights moved. Skipped without CUDA. Each builds its model first (1-3 min on the host CPU,
2-5 GB of disk under pytest's tmp dir)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo import GRPOConfig, GRPOTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from build_real_model import ARCHITECTURES, build


def text_length(prompts, completions, **_):
    """Varies within a group even for a random model (whose ids mostly lie past the small tokenizer)."""
    return [len(c) / 10 for c in completions]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_real_size_trains_two_steps_in_bf16(tmp_path, name):
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # conftest's one thread suits tiny models, not building these
    try:
        model_dir = build(name, tmp_path / "model")
    finally:
        torch.set_num_threads(threads)
    before = load_file(str(model_dir / "model.safetensors"))
    cfg = GRPOConfig(
        model=str(model_dir),
        device="cuda",
        dtype="bfloat16",
        output_dir=str(tmp_path / "run"),
        batch_size=4,
        num_generations=4,
        max_new_tokens=64,
        steps=2,
        beta=0.04,
        learning_rate=1e-4,
        warmup_steps=0,
        logging_steps=1,
        progress_bar=False,
        seed=0,
        eval_dataset=None,
        tensorboard=False,
        save_steps=0,
        report=False,
    )
    GRPOTrainer(config=cfg, reward_funcs=[text_length]).train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2]
    assert all(
        math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) and x["grad_norm"] > 0 for x in steps
    )
    assert torch.cuda.max_memory_allocated() > 0
    after = load_file(str(tmp_path / "run" / "final_model" / "model.safetensors"))
    moved = [k for k in before if not torch.equal(before[k].float(), after[k].float())]
    assert len(moved) > len(before) // 2, f"only {len(moved)} of {len(before)} tensors changed"
