"""A run small enough to repeat many times: a random 1-layer Llama with the bundled tokenizer, a handful
of prompts, two completions each, a few tokens. Shared by the reliability tests and the
fault-injection driver (which imports it in a fresh process)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.model.loading import bundled_model_path

TIMING_KEYS = ("time/", "tokens_per_s")

SETTINGS = {
    "batch_size": 2,
    "num_generations": 2,
    "max_new_tokens": 6,
    "gradient_accumulation_steps": 1,
    "learning_rate": 3e-3,
    "warmup_steps": 1,
    "lr_scheduler": "linear",
    "logging_steps": 1,
    "progress_bar": False,
    "eval_dataset": None,
    "num_threads": 1,
    "beta": 0.04,
    "tensorboard": False,
    "seed": 11,
    "save_steps": 1,
    "reward_funcs": ["tests.tiny_run:letter_score", "gsm8k_format"],
    "max_prompt_length": 96,
    # The HTML report's plots cost ~2.2 CPU-s a run (matplotlib), ~15% of the suite's CPU over its ~100
    # runs; the tests that read a report ask for it (report=True).
    "report": False,
}


def letter_score(prompts, completions, **_):
    """Varies with the sampled text, so every group has spread and every step a gradient."""
    return [sum(map(ord, c)) % 13 / 13 for c in completions]


def make_model_dir(path: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=640,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(bundled_model_path()) / name, path / name)
    return path


def write_dataset(path: Path, n: int) -> Path:
    rows = [
        {
            "question": f"Sam has {i + 2} apples and buys {i + 3} more. How many now?",
            "answer": f"#### {2 * i + 5}",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def config(model_dir: Path, data: Path, output_dir: Path, **overrides) -> dict:
    return {
        **SETTINGS,
        "model": str(model_dir),
        "dataset": str(data),
        "output_dir": str(output_dir),
        **overrides,
    }


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the timing fields, which differ run to run."""
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(TIMING_KEYS)} for line in lines]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of run directory `src` at `dst` in which files hard-linked to each other in `src` (final_model/
    and the last checkpoint share theirs) are linked to each other again, not two copies: a test that resumes
    a copy sees the files as the run left them."""
    copied: dict[tuple[int, int], Path] = {}
    for path in sorted(Path(src).rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        stat = path.stat()
        key = (stat.st_dev, stat.st_ino)
        if stat.st_nlink > 1 and key in copied:
            os.link(copied[key], target)
        else:
            shutil.copy2(path, target)
            copied[key] = target
    return dst
