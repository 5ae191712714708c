"""tests/conftest.py: its LONGEST_FIRST orders a one-process run (it only holds if the names in the list are
still the suite's files), and it makes the suite's processes let idle OpenMP threads sleep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_in_the_longest_first_list_exists_once():
    # A renamed or deleted file would silently fall back to collection order.
    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_the_suite_and_the_processes_it_starts_let_idle_openmp_threads_sleep():
    # tests/conftest.py says why (spinning threads of 2-thread subprocesses took CPU from the other worker);
    # a value set outside the suite is kept, so only its presence is the suite's doing.
    assert os.environ.get("OMP_WAIT_POLICY")
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == os.environ["OMP_WAIT_POLICY"]


def test_a_test_that_changes_torchs_threads_leaves_them_changed_only_for_itself_part_1():
    torch.set_num_threads(2)  # as a run in this process with train.num_threads=2 (a preset) does


def test_a_test_that_changes_torchs_threads_leaves_them_changed_only_for_itself_part_2():
    assert torch.get_num_threads() == 1


def test_a_copied_run_keeps_its_hard_links_and_leaves_the_original_alone(tmp_path):
    # tests/integration/test_train_e2e.py resumes copies of one shared run: final_model/ must stay linked to
    # the checkpoint's files in the copy (as the run wrote them), and writes to the copy must not reach the
    # original through a link.
    from tests.tiny_run import copy_run

    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "final_model").mkdir()
    (run / "checkpoint-2" / "model.safetensors").write_bytes(b"weights")
    os.link(run / "checkpoint-2" / "model.safetensors", run / "final_model" / "model.safetensors")
    (run / "metrics.jsonl").write_text("{}\n")
    copy = copy_run(run, tmp_path / "copy")
    assert copy == tmp_path / "copy"
    assert os.path.samefile(
        copy / "final_model" / "model.safetensors", copy / "checkpoint-2" / "model.safetensors"
    )
    assert not os.path.samefile(
        copy / "final_model" / "model.safetensors", run / "final_model" / "model.safetensors"
    )
    assert (copy / "metrics.jsonl").read_text() == "{}\n"
    (copy / "checkpoint-2" / "model.safetensors").write_bytes(b"changed")
    assert (run / "final_model" / "model.safetensors").read_bytes() == b"weights"


def test_each_test_phase_s_cpu_seconds_are_logged_when_asked(tmp_path):
    # GRPO_TEST_CPU (tests/conftest.py): what a test costs in CPU, beside --durations' wall time.
    log = tmp_path / "cpu.tsv"
    node = (
        "tests/unit/test_suite_order.py::"
        + test_a_test_that_changes_torchs_threads_leaves_them_changed_only_for_itself_part_1.__name__
    )
    # the child is no xdist worker (its worker id is "main"), even when this test runs in one
    outside_xdist = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    subprocess.run(
        # without the plugins this run has no use for (hypothesis' costs ~2 CPU-s to load)
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", node],
        cwd=ROOT,
        env={**outside_xdist, "GRPO_TEST_CPU": str(log)},
        capture_output=True,
        check=True,
    )
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    assert [(r[0], r[1]) for r in rows] == [(node, "setup"), (node, "call"), (node, "teardown")]
    assert all(float(r[2]) >= 0 and float(r[3]) >= 0 for r in rows)
    # worker and start time: the schedule of a run (no xdist here: "main"; phases in order)
    assert all(r[4] == "main" for r in rows)
    starts = [float(r[5]) for r in rows]
    assert starts == sorted(starts) and starts[0] > 1.7e9
