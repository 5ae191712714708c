"""One writer per run directory (grpo/run/runlock.py): a second run is refused at once, naming the first, and
the first finishes untouched; the kernel drops the lock when its holder dies, even by SIGKILL; with several
processes every rank stops when rank 0 could not lock."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.run.runlock import LOCK_FILE, NoLock, RunLock, lock_run_dir
from tests import tiny_run

pytestmark = pytest.mark.slow


def slow_letter_score(prompts, completions, **columns):
    time.sleep(0.3)  # long enough for a second run to try meanwhile
    return tiny_run.letter_score(prompts, completions)


def _fork(child) -> int:
    """Run `child()` in a forked process (everything is imported already: no start-up cost); its exit code
    is 0 when it returned."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int, seconds: float = 240) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"process {pid} did not finish in {seconds} s")


def _wait_for_lock_of(pid: int, lock: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if json.loads(lock.read_text())["pid"] == pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert os.waitpid(pid, os.WNOHANG)[0] == 0, f"process {pid} ended before it took {lock}"
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never took {lock}")


def test_a_second_run_is_refused_naming_the_first_which_finishes_with_every_step_once(tmp_path):
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 6)
    out = tmp_path / "run"

    def first_run():
        cfg = GRPOConfig(**tiny_run.config(model, data, out, steps=3))
        GRPOTrainer(config=cfg, reward_funcs=[slow_letter_score, "gsm8k_format"]).train()

    first = _fork(first_run)
    try:
        _wait_for_lock_of(first, out / LOCK_FILE)
        for resume in (None, "latest"):  # a fresh start, and --resume latest on the live run
            cfg = GRPOConfig(**tiny_run.config(model, data, out, steps=3, resume=resume))
            with pytest.raises(ConfigError) as refused:
                GRPOTrainer(config=cfg)
            message = str(refused.value)
            assert f"{out} is in use by another grpo run (pid {first} on " in message
            assert "started " in message and f"kill {first}" in message
        assert os.waitpid(first, os.WNOHANG)[0] == 0, "the first run ended before the second was refused"
    finally:
        code = _exit_code(first)
    assert code == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (out / "final_model" / "model.safetensors").is_file()
    assert RunLock(out).acquire().held  # released when the first run ended


def test_the_lock_goes_when_its_holder_is_sigkilled(tmp_path):
    def hold():
        lock = RunLock(tmp_path).acquire()  # noqa: F841 (held until this process is killed)
        time.sleep(120)

    holder = _fork(hold)
    try:
        _wait_for_lock_of(holder, tmp_path / LOCK_FILE)
        with pytest.raises(ConfigError, match=rf"in use by another grpo run \(pid {holder} on "):
            RunLock(tmp_path).acquire()
    finally:
        os.kill(holder, signal.SIGKILL)
        assert _exit_code(holder) == -signal.SIGKILL
    lock = RunLock(tmp_path).acquire()  # nothing to clean up: the kernel let go
    assert lock.held and json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


class _Rank:
    """A stand-in for grpo.distributed.runtime.Runtime: `any` is the all-reduce over ranks."""

    def __init__(self, rank: int, others_failed: bool):
        self.rank, self.others_failed, self.asked = rank, others_failed, []

    is_main = property(lambda self: self.rank == 0)
    active = True

    def any(self, flag: bool) -> bool:
        self.asked.append(flag)
        return flag or self.others_failed


def test_every_rank_stops_when_rank_0_cannot_lock_and_only_rank_0_locks(tmp_path):
    held = RunLock(tmp_path).acquire()  # another run
    rank0 = _Rank(0, others_failed=False)
    with pytest.raises(ConfigError, match="in use by another grpo run"):
        lock_run_dir(tmp_path, rank0)
    rank1 = _Rank(1, others_failed=True)  # rank 0 failed: rank 1 learns it through the all-reduce
    with pytest.raises(ConfigError, match="rank 0 could not lock"):
        lock_run_dir(tmp_path, rank1)
    assert rank0.asked == [True] and rank1.asked == [False]
    held.release()
    assert isinstance(lock_run_dir(tmp_path, _Rank(1, others_failed=False)), NoLock)  # rank 1 holds nothing
    assert lock_run_dir(tmp_path, _Rank(0, others_failed=False)).held
