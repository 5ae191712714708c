"""Checkpoints: `checkpoint-{step}/` and `final_model/`, each a Hugging Face model directory.

Layout (loadable with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`):
config.json, model.safetensors, tokenizer files, plus `training_state.pt` (optimizer, scheduler,
RNG states, step, data position) and `config.yaml` (the resolved run config, secrets redacted).
A checkpoint is written to a `.tmp` sibling and renamed into place, so a crash mid-save never
leaves a half-written directory under the real name.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "training_state.pt"
CONFIG_FILE = "config.yaml"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # Tensors and plain tuples only, so the file loads with torch.load(weights_only=True).
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_model_dir(path: Path, model, tokenizer, config_yaml: str, training_state: dict | None) -> Path:
    """Write a model directory atomically (tmp dir + fsync + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
    if training_state is not None:
        torch.save(training_state, tmp / STATE_FILE)
    _fsync_dir(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def _fsync_dir(directory: Path) -> None:
    for f in directory.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with a training state), oldest first."""
    found = []
    for p in Path(output_dir).glob("checkpoint-*"):
        m = CHECKPOINT_RE.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_resume_dir(output_dir: Path, resume: str) -> Path | None:
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"--resume {resume}: no {STATE_FILE} there; pass a checkpoint-N directory "
                                "or 'latest'.")
    return path


def load_training_state(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)


def prune_checkpoints(output_dir: Path, keep: int | None, protect: Path | None = None) -> None:
    if not keep:
        return
    found = list_checkpoints(output_dir)
    for _, path in found[:-keep]:
        if protect is None or path.resolve() != Path(protect).resolve():
            shutil.rmtree(path, ignore_errors=True)
