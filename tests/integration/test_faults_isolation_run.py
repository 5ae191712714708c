"""Issue 32 §1 in a real run: SIGTERM while an environment's reset is stuck in C holding the GIL ends the
call within the grace, saves the checkpoint and exits 143 (was: only kill -9 ended the run, no checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo.rewards.isolation import can_fork

ROOT = Path(__file__).resolve().parents[2]
STUCK = '''
import re
from pathlib import Path


class Stuck:
    def reset(self, **row):
        Path(__file__).with_name("started").touch()
        re.match(r"(a+)+$", "a" * 60 + "b")  # catastrophic backtracking: hours, in C, holding the GIL

    def look(self, query: str) -> str:
        """Look something up.

        Args:
            query: What to look up.
        """
        return query
'''


@pytest.mark.slow
@pytest.mark.skipif(not can_fork(), reason="worker processes need fork (Linux)")
def test_sigterm_while_an_environment_is_stuck_in_c_saves_and_exits_143(tmp_path):
    (tmp_path / "stuck_env.py").write_text(STUCK)
    args = [
        "--config", "tiny_tools", "--output-dir", str(tmp_path / "run"), "env.tools=[]",
        "env.environment=stuck_env:Stuck", "env.tool_timeout_s=600", "train.steps=3",
        "train.prompts_per_step=2", "generation.num_generations=2", "train.eval_before=false",
        "train.eval_after=false", "train.report=false", "train.num_threads=1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), str(tmp_path)])}
    process = subprocess.Popen(
        [sys.executable, "-m", "grpo", "train", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline and process.poll() is None, process.stdout.read()
            time.sleep(0.1)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, out
    assert "still ran 5 s after the stop signal, so it was killed" in out
    assert "Stopped at step 0 of 3 (signal 15); checkpoint" in out
    assert time.monotonic() - started < 90
