"""`grpo train --help` documents every config key with its default."""

import subprocess
import sys

from grpo.config import all_paths


def test_help_lists_every_key_with_default():
    text = subprocess.run(
        [sys.executable, "-m", "grpo", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "200", "PATH": ""},
    ).stdout
    for path in all_paths():
        assert f"--{path}" in text, path
    assert text.count("(default:") >= len(all_paths())
    for seed_flag in (
        "--learning-rate",
        "--num-generations",
        "--max-new-tokens",
        "--batch-size",
        "--output-dir",
        "--steps",
        "--seed",
        "--resume",
        "--save-steps",
        "--logging-steps",
        "--kl-coef",
    ):
        assert seed_flag in text, seed_flag
