"""Checkpoint files: manifest verification, fallback to the previous checkpoint, disk-full saves,
interrupted saves, pruning that spares the resumed-from checkpoint, and RNG round trips."""

import errno
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo.checkpoint.store as ckpt
from grpo.checkpoint.store import (
    CheckpointError,
    find_resume_dir,
    load_training_state,
    prune_checkpoints,
    remove_partial_saves,
    rng_state,
    save_model_dir,
    set_rng_state,
    verify_checkpoint,
)
from tests.conftest import tiny_llama


class FileTokenizer:
    def save_pretrained(self, directory):
        (Path(directory) / "tokenizer.json").write_text('{"tokens": []}')


def save(run: Path, step: int, model=None) -> Path:
    return save_model_dir(
        run / f"checkpoint-{step}",
        model or tiny_llama(),
        FileTokenizer(),
        "seed: 1\n",
        {
            "step": step,
            "rng": rng_state(),
            "learner": {"optimizer": {}, "scheduler": {}},
            "data": {},
            "nonfinite_in_a_row": 0,
            "nonfinite_total": 0,
        },
    )


@pytest.fixture
def run(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    return tmp_path


def test_a_saved_checkpoint_verifies_and_lists_every_file(run):
    assert verify_checkpoint(run / "checkpoint-3") is None
    manifest = (run / "checkpoint-3" / "manifest.json").read_text()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "config.yaml", "training_state.pt"):
        assert f'"{name}"' in manifest
    assert not list(run.glob("*.tmp"))


@pytest.mark.parametrize(
    "damage,reason",
    [
        (
            lambda d: (d / "manifest.json").unlink(),
            "it has no manifest.json, so it was not written completely",
        ),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda d: os.truncate(d / "model.safetensors", 100), "model.safetensors has 100 bytes where"),
        (lambda d: _flip_last_byte(d / "training_state.pt"), "training_state.pt does not match its sha256"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "its manifest.json is unreadable"),
    ],
)
def test_latest_skips_a_damaged_checkpoint_and_says_why(run, damage, reason, caplog):
    damage(run / "checkpoint-3")
    assert reason in verify_checkpoint(run / "checkpoint-3")
    logger = logging.getLogger("grpo")
    logger.addHandler(caplog.handler)
    try:
        assert find_resume_dir(run, "latest") == run / "checkpoint-2"
    finally:
        logger.removeHandler(caplog.handler)
    assert "checkpoint-3 is unusable: " in caplog.text and reason in caplog.text
    assert "Falling back to the previous one" in caplog.text
    with pytest.raises(CheckpointError, match=f"cannot resume from it: {reason}"):
        find_resume_dir(run, str(run / "checkpoint-3"))  # named explicitly: no silent substitute


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_no_intact_checkpoint_is_an_error_and_no_checkpoint_is_a_fresh_start(run, tmp_path):
    for step in (1, 2, 3):
        (run / f"checkpoint-{step}" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"No intact checkpoint in .*checkpoint-3 .*checkpoint-1"):
        find_resume_dir(run, "latest")
    assert find_resume_dir(tmp_path / "empty", "latest") is None
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        find_resume_dir(run, str(run / "checkpoint-9"))


def test_disk_full_while_saving_leaves_the_previous_checkpoint_intact(run, monkeypatch):
    before = {p.name: p.read_bytes() for p in (run / "checkpoint-3").iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(
        CheckpointError,
        match=r"No space left on the device while saving checkpoint-4 in .*"
        r"MiB free\)\. The previous checkpoint checkpoint-3 is intact\..*--resume latest",
    ):
        save(run, 4)
    with pytest.raises(CheckpointError, match="checkpoint-2 is intact"):
        save(run, 3)  # re-saving an existing step: the old copy must survive too
    assert {p.name: p.read_bytes() for p in (run / "checkpoint-3").iterdir()} == before
    assert verify_checkpoint(run / "checkpoint-3") is None
    assert not (run / "checkpoint-4").exists() and not list(run.glob("*.tmp")) and not list(run.glob("*.old"))


def test_interrupted_saves_are_cleaned_up_or_restored(run):
    (run / "checkpoint-4.tmp").mkdir()  # killed while writing checkpoint-4
    os.replace(run / "checkpoint-3", run / "checkpoint-3.old")  # killed between moving aside and renaming
    assert remove_partial_saves(run) == ["checkpoint-4.tmp"]
    assert verify_checkpoint(run / "checkpoint-3") is None and not (run / "checkpoint-3.old").exists()


def test_prune_keeps_the_newest_and_the_resumed_from_checkpoint(run):
    for step in (4, 5):
        save(run, step)
    prune_checkpoints(run, keep=2, protect=(run / "checkpoint-5", run / "checkpoint-2"))
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]


def test_every_rng_round_trips_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save({"rng": rng_state()}, tmp_path / "s.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_training_state_loads_with_weights_only(run, monkeypatch):
    calls = []
    real = torch.load
    monkeypatch.setattr(ckpt.torch, "load", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert load_training_state(run / "checkpoint-2")["step"] == 2
    assert calls[0]["weights_only"] is True


def test_final_model_linked_to_the_last_checkpoint_shares_its_files_and_verifies(run):
    final = ckpt.link_model_dir(run / "checkpoint-3", run / "final_model")
    names = sorted(p.name for p in (run / "checkpoint-3").iterdir())
    assert sorted(p.name for p in final.iterdir()) == names
    for name in names:  # one copy on disk: the end of a run writes its weights and optimizer state once
        assert os.path.samefile(final / name, run / "checkpoint-3" / name)
    assert verify_checkpoint(final) is None
    assert load_training_state(final)["step"] == 3  # resumable as the checkpoint is
    shutil.rmtree(run / "checkpoint-3")  # pruned later: final_model keeps its files
    assert verify_checkpoint(final) is None and not list(run.glob("*.tmp"))


def test_final_model_is_copied_where_hard_links_fail(run, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(ckpt.os, "link", no_links)
    final = ckpt.link_model_dir(run / "checkpoint-3", run / "final_model")
    assert not os.path.samefile(final / "model.safetensors", run / "checkpoint-3" / "model.safetensors")
    assert verify_checkpoint(final) is None
