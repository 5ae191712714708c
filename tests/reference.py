"""The same run at a reference commit, on this host: how "unchanged" is tested.

A float or a weights' sha256 recorded on one CPU differs on another (AVX2 and AVX-512 kernels round
differently), so a test that claims "training is what it was" runs the old code here and now: the reference
commit's `src/` is taken out of git (`git archive`, no checkout touched) and the same driver runs it and the
working tree's code in fresh processes, with the same environment. Without git history (a source tarball,
a shallow clone) the comparison cannot be made and the test is skipped, saying so.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# One driver for both sides: a GRPOConfig from JSON, trained by the Python surface that every commit has.
_DRIVER = """
import json, sys
from grpo import GRPOConfig, GRPOTrainer
GRPOTrainer(config=GRPOConfig(**json.loads(sys.argv[1]))).train()
"""


@functools.cache
def source_at(commit: str) -> Path:
    """`src/` of `commit`, unpacked once per test session; skips the test when git cannot give it."""
    try:
        tar = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", commit, "src"],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"commit {commit} is not in this checkout's git history ({e}); clone with history to run")
    root = Path(tempfile.mkdtemp(prefix=f"grpo-ref-{commit}-"))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(root, filter="data")
    return root / "src"


def _environment(src: Path) -> dict[str, str]:
    # The repository root is on the path for `tests.tiny_run:...` rewards; `src` first picks the code.
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    return {
        **env,
        "PYTHONPATH": f"{src}{os.pathsep}{REPO}",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_python(settings: dict, src: Path | None = None) -> None:
    """GRPOTrainer(config=GRPOConfig(**settings)).train() in a fresh process with `src`'s grpo (default:
    this working tree's)."""
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(settings)],
        cwd=REPO,
        env=_environment(src or REPO / "src"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"the run at {src or 'HEAD'} failed:\n{done.stderr[-4000:]}"


def run_cli(argv: list[str], src: Path | None = None) -> str:
    """`grpo ARGV` in a fresh process with `src`'s grpo (default: this working tree's); its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "grpo", *argv],
        cwd=REPO,
        env=_environment(src or REPO / "src"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"grpo {' '.join(argv)} at {src or 'HEAD'} failed:\n{done.stderr[-4000:]}"
    return done.stdout


_CLI_DRIVER = """
import contextlib, io, json, sys
from grpo.cli import main
shown = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    shown.append([code, out.getvalue()])
print(json.dumps(shown))
"""


def cli_outputs(argvs: list[list[str]], src: Path | None = None) -> list[tuple[int, str]]:
    """(exit code, stdout) of `grpo ARGV` for each ARGV, one after another in one fresh process with `src`'s
    grpo (default: this working tree's): for commands that only read and print, such as --dry-run."""
    done = subprocess.run(
        [sys.executable, "-c", _CLI_DRIVER, json.dumps(argvs)],
        cwd=REPO,
        env=_environment(src or REPO / "src"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"the commands at {src or 'HEAD'} failed:\n{done.stderr[-4000:]}"
    return [tuple(x) for x in json.loads(done.stdout.splitlines()[-1])]


# Defaults changed on purpose since the reference commits, (section, setting): (before, now), each with
# its reason. generation.compile_decode: false → null (issue 34: decided at run time; a short run, as
# these tests run, decodes eagerly as before); generation.vllm_enforce_eager: true → null (issue 34: CUDA
# graphs on CUDA, eager on a CPU as before).
CHANGED_DEFAULTS = {
    ("generation", "compile_decode"): ("false", "null"),
    ("generation", "vllm_enforce_eager"): ("true", "null"),
    ("train", "replay_rollout_forward"): ("false", "null"),
}


def _in_section(text: str, section: str, old: str, new: str) -> str:
    """`text` with the line `old` of `section` (a top-level key's indented lines) replaced by `new`."""
    lines, current = text.splitlines(keepends=True), None
    for i, line in enumerate(lines):
        if line.strip() and not line.startswith(" "):
            current = line.split(":")[0]
        elif current == section and line == old:
            lines[i] = new
    return "".join(lines)


def without_new_settings(now: str, before: str) -> str:
    """`now` (a config.yaml, or a dry run's output) less the settings the reference commit did not have yet:
    a field added since is new text, not a change, and the rest must stay byte for byte. Each section's
    settings are the lines indented two spaces (a list value continues with `  - ` or deeper lines)."""

    def settings_of(text: str) -> set[tuple[str, str]]:
        found, section = set(), None
        for line in text.splitlines():
            if line and not line.startswith(" "):
                section = line.split(":")[0]
            elif line.startswith("  ") and not line.startswith(("   ", "  - ")):
                found.add((section, line.split(":")[0].strip()))
        return found

    for (section, name), (was, value) in CHANGED_DEFAULTS.items():  # a deliberate change reads as before
        if f"  {name}: {was}\n" in before:
            now = _in_section(now, section, f"  {name}: {value}\n", f"  {name}: {was}\n")
    new = settings_of(now) - settings_of(before)
    kept, section, dropping = [], None, False
    for line in now.splitlines(keepends=True):
        if line.strip() and not line.startswith(" "):
            section, dropping = line.split(":")[0], False
        elif line.startswith("  ") and not line.startswith(("   ", "  - ")):
            dropping = (section, line.split(":")[0].strip()) in new
        if not dropping or not line.strip():  # a blank line ends a section: it is never a setting's
            kept.append(line)
    return "".join(kept)


def weights_sha256(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]
