"""The multi-turn seam left single-turn training bitwise as it was: the same 3-step run gives the same final
weights, byte for byte, as at commit 091d311 (before the seam), measured on this machine type (x86-64 AVX2,
torch 2.13.0+cpu, one thread). Regenerate only for a deliberate numerics change: run this file's `run` at the
old and the new commit and compare."""

from __future__ import annotations

import hashlib

from grpo import GRPOConfig, GRPOTrainer
from tests import tiny_run

# Recorded at 091d311 with this same code (git worktree of that commit, PYTHONPATH=src).
WEIGHTS_SHA256_AT_091D311 = "6bc62dda96fc89f6288238cfa71aa15f546b885007e3048a96477b5d5f75d8f0"
LOSSES_AT_091D311 = [0.0, 5.185604e-06, 2.4020672e-05]


def run(root):
    model = tiny_run.make_model_dir(root / "model")
    data = tiny_run.write_dataset(root / "data.jsonl", 6)
    cfg = GRPOConfig(**tiny_run.config(model, data, root / "run", steps=3, save_steps=0, report=False))
    GRPOTrainer(config=cfg).train()
    digest = hashlib.sha256((root / "run/final_model/model.safetensors").read_bytes()).hexdigest()
    return digest, [round(m["loss"], 12) for m in tiny_run.metrics(root / "run")]


def test_single_turn_training_is_bitwise_what_it_was(tmp_path):
    digest, losses = run(tmp_path)
    assert losses == LOSSES_AT_091D311
    assert digest == WEIGHTS_SHA256_AT_091D311
