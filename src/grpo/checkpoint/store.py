"""Checkpoint directories: `checkpoint-{step}/` and `final_model/`, each a Hugging Face model directory.

Layout (loadable with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`):
config.json, model.safetensors, tokenizer files, plus `training_state.pt` (optimizer, scheduler,
RNG states, step, data position), `config.yaml` (the resolved run config, secrets redacted) and
`manifest.json` (size and sha256 of every other file, written last).

Crash safety: a checkpoint is written into a `.tmp` sibling, every file and the directory are
fsynced, and only then is it renamed into place, so a process killed at any moment leaves either
the old checkpoint or the new one under the real name, never half of one. The manifest catches
what a rename cannot (a disk that lost data, a file someone truncated): `find_resume_dir`
verifies it and falls back to the previous checkpoint, saying why.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo.config import SECTIONS, ConfigError
from grpo.config.errors import clause
from grpo.config.yaml_limits import YAMLSyntaxError, load_yaml
from grpo.files import nofollow_opener, own_dir, refuse_link, write_bytes, write_text

log = logging.getLogger("grpo")

STATE_FILE = "training_state.pt"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
PARTIAL_SUFFIXES = (".tmp", ".old")
# Test hook (the fault-injection test): "checkpoint-3:model" SIGKILLs this process right after the
# model weights of checkpoint-3 are written; the points are listed in `save_model_dir`.
KILL_ENV = "GRPO_TEST_KILL_AT"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says what is intact and what to do."""


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # Tensors and plain tuples only, so the file loads with torch.load(weights_only=True).
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_everything(seed: int) -> None:
    """A fresh start: python, numpy and torch (every device) from one seed, so user code that draws
    random numbers (a reward function, say) is reproducible and resumes exactly too."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- writing --------------------------------------------------------------------------------------
def save_model_dir(
    path: Path, model, tokenizer, config_yaml: str, training_state: dict | None, *, owned: bool = True
) -> Path:
    """Write a model directory. `owned` (checkpoint-N/, final_model/ of the run): atomically (tmp dir,
    manifest, fsync, rename); on failure the tmp dir is removed, whatever was under `path` before is left
    as it was, and a CheckpointError says why. Not owned (a directory the user named that exists): the
    model's files are written into it one by one, and nothing else there is touched (`_save_into`)."""
    path = Path(path)
    for p in (path, path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")):
        refuse_link(p)
    if not owned and path.is_dir():
        return _save_into(path, model, tokenizer, config_yaml, training_state)
    if not owned and path.exists():
        raise CheckpointError(f"Cannot save the model into {path}: it is a file; pass a directory.")
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if not path.parent.is_dir():  # not re-created: a new, nearly empty run directory would hide the loss
        raise CheckpointError(
            f"Cannot save {path.name}: the directory {path.parent} no longer exists (deleted "
            "or moved while the run was going?). Nothing was saved. Restore the directory, "
            "then resume with --resume latest."
        )
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_model_files(tmp, path, model, tokenizer, config_yaml, training_state)
        write_manifest(tmp)
        _fault_point(path, "manifest")
        _move_into_place(tmp, path, old)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        if isinstance(e, OSError) or "No space left" in str(e):  # safetensors raises its own type
            raise CheckpointError(_save_failure(path, e)) from e
        raise
    return path


def link_model_dir(source: Path, path: Path) -> Path:
    """`path` as a second name for the verified model directory `source` (final_model/ beside the last
    checkpoint-N/, which holds the same weights, optimizer state and config): every file hard-linked,
    so the weights and optimizer state are on disk once and the end of a run writes them once. Atomic
    like `save_model_dir` (tmp dir, fsync, rename). A file system without hard links gets copies.
    Nothing rewrites a checkpoint's file in place (saves write new files and rename them), so the two
    names cannot drift apart."""
    source, path = Path(source), Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    for p in (path, tmp, old):
        refuse_link(p)
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for f in sorted(p for p in source.rglob("*") if p.is_file()):
            target = tmp / f.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:  # no hard links here (some network or FUSE file systems): a copy
                shutil.copy2(f, target)
                _fsync(target)
        _fsync(tmp)
        for point in ("model", "config", "state", "manifest"):  # save_model_dir's points, all passed now
            _fault_point(path, point)
        _move_into_place(tmp, path, old)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        if isinstance(e, OSError):
            raise CheckpointError(_save_failure(path, e)) from e
        raise
    return path


def _move_into_place(tmp: Path, path: Path, old: Path) -> None:
    """The complete `tmp` becomes `path`. An existing `path` is moved aside to `old` first, not deleted, so
    a crash between the two renames still leaves a complete copy (the callers' except restores it)."""
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    _fault_point(path, "renamed")
    shutil.rmtree(old, ignore_errors=True)


def _write_model_files(
    where: Path, named: Path, model, tokenizer, config_yaml: str | None, training_state: dict | None
) -> None:
    model.save_pretrained(where, safe_serialization=True)
    _fault_point(named, "model")
    tokenizer.save_pretrained(where)
    if config_yaml is not None:
        write_text(where / CONFIG_FILE, config_yaml)
    _fault_point(named, "config")
    if training_state is not None:
        _save_state(training_state, where / STATE_FILE)
    _fault_point(named, "state")


def _save_into(path: Path, model, tokenizer, config_yaml: str, training_state: dict | None) -> Path:
    """`trainer.save_model(dir)` on a directory that exists (TRL's `save_model(args.output_dir)`, a folder of
    the user's): the model's files are staged in a private directory inside it, then each is renamed into
    place. Files of the same name (an earlier save's weights) are replaced, as asked; nothing else is
    deleted. A config.yaml already there (the run's own, or the user's) is left as it is. No manifest is
    added (it would claim to describe a directory grpo does not own); one already there is updated."""
    stage = path / f".grpo-save-{os.getpid()}.tmp"
    refuse_link(stage)
    if stage.exists():
        shutil.rmtree(stage)
    try:
        stage.mkdir()
        config = None if (path / CONFIG_FILE).exists() else config_yaml
        _write_model_files(stage, path, model, tokenizer, config, training_state)
        for f in sorted(p for p in stage.rglob("*") if p.is_file()):
            target = path / f.relative_to(stage)
            own_dir(target.parent)
            refuse_link(target)
            if target.is_dir():
                raise CheckpointError(
                    f"Cannot save the model into {path}: {target} is a directory where the model's "
                    f"file {target.name} goes. Move it, or save into another directory."
                )
            _fsync(f)
            os.replace(f, target)
        _fsync(path)
        if (path / MANIFEST_FILE).is_file():
            write_manifest(path)
    except OSError as e:
        raise CheckpointError(
            f"Could not save the model into {path}: {clause(e)}. Files of yours there were not touched."
        ) from e
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return path


class _WriteErrors:
    """A file that remembers the OSError of a failed write. torch's zip writer turns it into "unexpected pos"
    (a RuntimeError without the reason); this keeps the reason (ENOSPC: disk full) for the message."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.fh.flush()


def _save_state(state: dict, target: Path) -> None:
    with open(target, "wb", opener=nofollow_opener) as fh:
        recorder = _WriteErrors(fh)
        try:
            torch.save(state, recorder)
        except RuntimeError as e:
            if recorder.error is not None:
                raise recorder.error from e
            raise


def _save_failure(path: Path, e: BaseException) -> str:
    previous = [p.name for _, p in list_checkpoints(path.parent) if p != path]
    intact = (
        f"The previous checkpoint {previous[-1]} is intact."
        if previous
        else "No earlier checkpoint was touched."
    )
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e):
        free = shutil.disk_usage(path.parent).free / 2**20
        return (
            f"No space left on the device while saving {path.name} in {path.parent} ({free:.0f} MiB "
            f"free). {intact} Free some space (or set train.save_total_limit to keep fewer "
            "checkpoints), then resume with --resume latest."
        )
    return (
        f"Could not save {path.name} in {path.parent}: {clause(e)}. {intact} Fix the cause, then resume with "
        "--resume latest."
    )


def write_manifest(directory: Path) -> dict[str, Any]:
    """Hash every file (fsyncing it on the way), then write manifest.json and fsync the directory."""
    files = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        _fsync(f)
        files[str(f.relative_to(directory))] = {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
    manifest = {"version": MANIFEST_VERSION, "files": files}
    target = directory / MANIFEST_FILE
    write_bytes(target, json.dumps(manifest, indent=1).encode())  # names, sizes, hashes: no text to redact
    _fsync(directory)
    return manifest


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault_point(path: Path, point: str) -> None:
    if os.environ.get(KILL_ENV) == f"{path.name}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


# -- reading --------------------------------------------------------------------------------------
def verify_checkpoint(path: Path) -> str | None:
    """None when every file the manifest lists is there with its size and sha256; else what is wrong."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"it has no {MANIFEST_FILE}, so it was not written completely"
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"its {MANIFEST_FILE} is unreadable"
    if not _manifest_shape_ok(files):
        return (
            f'its {MANIFEST_FILE} is not a grpo manifest ("files" must map names inside the checkpoint '
            "to their bytes and sha256)"
        )
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{name} has {f.stat().st_size} bytes where {meta['bytes']} were written"
        if file_sha256(f) != meta["sha256"]:
            return f"{name} does not match its sha256 (the file is corrupted)"
    if CHECKPOINT_RE.match(path.name) and STATE_FILE not in files:
        return f"it has no {STATE_FILE}"
    # What the hashes cannot catch: files written wrong in the first place (or a manifest re-made over them).
    return _config_problem(path) or (state_problem(path) if STATE_FILE in files else None)


def _manifest_shape_ok(files: Any) -> bool:
    return isinstance(files, dict) and all(
        isinstance(name, str)
        and not Path(name).is_absolute()
        and ".." not in Path(name).parts
        and isinstance(meta, dict)
        and type(meta.get("bytes")) is int
        and isinstance(meta.get("sha256"), str)
        for name, meta in files.items()
    )


def _config_problem(path: Path) -> str | None:
    f = path / CONFIG_FILE
    if not f.is_file():
        return None
    try:
        saved = load_yaml(f.read_text(encoding="utf-8"), f"its {CONFIG_FILE}")
    except (UnicodeDecodeError, YAMLSyntaxError) as e:
        return f"its {CONFIG_FILE} is not valid YAML ({getattr(e, 'detail', str(e)).splitlines()[0]})"
    except ConfigError as e:  # past a limit of the YAML reader
        return str(e).splitlines()[0]
    if saved is not None and not (
        isinstance(saved, dict) and all(isinstance(saved.get(s), dict | None) for s in SECTIONS)
    ):
        return f"its {CONFIG_FILE} does not hold a mapping of sections to settings"
    return None


# What lifecycle.training_state writes and lifecycle.resume reads back.
STATE_KEYS = ("learner", "rng", "data", "nonfinite_in_a_row", "nonfinite_total")


def state_problem(path: Path) -> str | None:
    """Why `path`'s training_state.pt cannot be loaded safely, or None. Memory-mapped: cheap even when the
    optimizer state is large, since no tensor data is read."""
    try:
        state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        return (
            f"its {STATE_FILE} holds Python objects other than tensors and plain values{what}; loading them "
            "could run code, so grpo does not open it"
        )
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        return f"its {STATE_FILE} is not a readable training state ({str(e).splitlines()[0][:120]})"
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        return f"its {STATE_FILE} is not a grpo training state (no step number)"
    return None


def _missing_for_resume(state: dict) -> list[str]:
    missing = [k for k in STATE_KEYS if k not in state]
    if not missing and not isinstance(state["learner"], dict):
        return ["learner"]
    return missing or [f"learner.{k}" for k in ("optimizer", "scheduler") if k not in state["learner"]]


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Every `checkpoint-N` directory, oldest first, complete or not (`verify_checkpoint` tells)."""
    found = []
    for p in Path(output_dir).glob("checkpoint-*"):
        m = CHECKPOINT_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_resume_dir(output_dir: Path, resume: str) -> Path | None:
    """The checkpoint to resume from: 'latest' is the newest one that verifies (saying why any newer one
    was passed over); a run directory means its newest intact checkpoint; a checkpoint path must verify.
    None when 'latest' finds no checkpoint at all."""
    if resume != "latest":
        path = Path(resume)
        if "://" in resume:
            raise CheckpointError(
                f"--resume {resume}: cloud storage paths are not supported; copy the checkpoint "
                "locally and pass its directory."
            )
        if not path.is_dir():
            raise CheckpointError(
                f"--resume {resume}: no such checkpoint directory. Pass a checkpoint-N "
                "directory or 'latest' (the newest intact one in the output directory)."
            )
        if not (path / MANIFEST_FILE).exists() and _is_run_dir(path):
            found = find_resume_dir(path, "latest")
            if found is None:
                raise CheckpointError(
                    f"--resume {resume}: this run directory holds no checkpoint (none was saved "
                    "yet: see train.save_steps), so there is nothing to resume."
                )
            log.info(
                "--resume %s is a run directory: resuming from its newest intact checkpoint, %s.",
                resume,
                found.name,
            )
            return found
        if (
            not CHECKPOINT_RE.match(path.name)
            and (path / MANIFEST_FILE).is_file()
            and not (path / STATE_FILE).exists()
        ):
            newest = [p.name for _, p in list_checkpoints(path.parent)]
            instead = (
                f"--resume {path.parent} (its newest checkpoint, {newest[-1]})"
                if newest
                else "--resume latest in the run directory"
            )
            raise CheckpointError(
                f"--resume {resume}: {path.name} holds the trained weights but no {STATE_FILE} "
                "(optimizer, scheduler, data position), so training cannot continue from it "
                f"exactly. Pass {instead} to continue the run, or start a new run from these "
                f"weights with --model {resume}."
            )
        problem = verify_checkpoint(path)
        if problem:
            raise CheckpointError(
                f"--resume {resume}: cannot resume from it: {problem}. Pass an earlier "
                "checkpoint, or 'latest' to pick the newest intact one."
            )
        return path
    found = list_checkpoints(output_dir)
    rejected = []
    for _, path in reversed(found):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        rejected.append(f"{path.name} ({problem})")
        log.warning("Checkpoint %s is unusable: %s. Falling back to the previous one.", path, problem)
    if rejected:
        raise CheckpointError(
            f"No intact checkpoint in {output_dir}: {'; '.join(rejected)}. Start a new run "
            "in another --output-dir, or remove these directories to start over here."
        )
    return None


def _is_run_dir(path: Path) -> bool:
    return bool(list_checkpoints(path)) or any((path / f).exists() for f in ("metrics.jsonl", "final_model"))


def load_training_state(path: Path) -> dict[str, Any]:
    """training_state.pt (tensors and plain values only: nothing in it can run code)."""
    problem = state_problem(path)
    if problem is None:
        state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
        missing = _missing_for_resume(state)
        if not missing:
            return state
        problem = f"its {STATE_FILE} lacks {', '.join(missing)}, which a resume restores"
    raise CheckpointError(
        f"Cannot resume from {path}: {problem}. Pass an earlier checkpoint, or 'latest' to "
        "pick the newest intact one."
    )


def read_saved_config(path: Path) -> str | None:
    f = Path(path) / CONFIG_FILE
    return f.read_text(encoding="utf-8") if f.is_file() else None


# -- housekeeping ---------------------------------------------------------------------------------
def prune_checkpoints(output_dir: Path, keep: int | None, protect: tuple[Path | None, ...] = ()) -> None:
    """Keep the newest `keep` checkpoints; never delete a protected one (the newest save and the one
    this run resumed from)."""
    if not keep:
        return
    kept = {Path(p).resolve() for p in protect if p is not None}
    for _, path in list_checkpoints(output_dir)[:-keep]:
        if path.resolve() not in kept:
            shutil.rmtree(path, ignore_errors=True)


def remove_partial_saves(output_dir: Path) -> list[str]:
    """Clean up after a save that was killed: delete `checkpoint-N.tmp` directories, and put an intact
    `checkpoint-N.old` back under its name if the new one never arrived. Returns what was removed."""
    removed = []
    for p in sorted(Path(output_dir).glob("checkpoint-*")):
        real = p.with_name(p.name[:-4])
        if not (p.is_dir() and p.name.endswith(PARTIAL_SUFFIXES) and CHECKPOINT_RE.match(real.name)):
            continue
        if p.suffix == ".old" and not real.exists() and verify_checkpoint(p) is None:
            os.replace(p, real)
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed
