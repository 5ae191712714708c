"""A training process (24 steps) SIGKILLed 13 times — 7 times inside a checkpoint save, at every point of
it, and 6 times at random moments — and resumed each time finishes bitwise equal to a run never interrupted,
with identical metrics, and never resumes from a checkpoint that differs from the reference run's
(two of them are deliberately damaged on disk along the way). The driver is fault_driver.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.fault_driver import SAVE_POINTS
from tests.tiny_run import metrics, same_weights

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_sigkill_at_random_points_and_mid_save_then_resume_is_exact(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.fault_driver", str(tmp_path), "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    events = report["events"]

    assert report["kills"] >= 10
    kills = [e for e in events if e["kind"] != "final"]
    assert all(e["status"] == -9 for e in kills), "every planned kill must land before the run finishes"
    assert {e["point"] for e in kills if e["kind"] == "save"} == set(SAVE_POINTS)  # every point of a save
    assert sum(e["kind"] == "random" for e in kills) >= 5
    for e in events:  # only checkpoints identical to the reference run's were ever resumed from
        assert set(e["resumed_from"]) <= set(e["intact_before"]), e
    damaged = [e["damaged"] for e in events if e.get("damaged")]
    assert damaged and report["fallback_warnings"] >= len(damaged)
    assert events[-1]["status"] == 0
    assert same_weights(tmp_path / "reference" / "final_model", tmp_path / "run" / "final_model")  # bitwise
    assert metrics(tmp_path / "run") == metrics(tmp_path / "reference")  # nothing lost, nothing twice
