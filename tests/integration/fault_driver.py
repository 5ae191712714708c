"""Fault-injection driver: `python -m tests.integration.fault_driver WORKDIR SEED` (run by
test_fault_injection.py in a fresh interpreter).

It imports torch/transformers/grpo once, then forks each training process, so a kill costs no
start-up time. One uninterrupted run is the reference. The interrupted run is SIGKILLed again and
again and resumed with --resume latest each time: half the kills land at a named point inside a
checkpoint save (the saver kills itself there: `GRPO_TEST_KILL_AT`), half at a random moment chosen
by this driver. Twice the newest checkpoint is also damaged on disk before resuming (as a disk that
lost data would), which the resume must detect and skip. Before each resume the driver records
which checkpoints hold exactly the reference run's bytes; afterwards it reads which one the process
resumed from. Writes a JSON report to WORKDIR/report.json.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.checkpoint.store import list_checkpoints
from tests import tiny_run

STEPS = 24
ROWS = 7  # 4 steps per epoch, the last one short: resumes land mid-epoch and on boundaries
SAVE_POINTS = ("model", "config", "state", "manifest", "renamed")
CHILD_TIMEOUT_S = 120


def train_in_child(model: Path, data: Path, out: Path, env: dict[str, str]) -> int:
    """Fork a training process; return its pid. It resumes from the newest intact checkpoint."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.update(env)
            cfg = GRPOConfig(**tiny_run.config(model, data, out, steps=STEPS, resume="latest"))
            GRPOTrainer(config=cfg).train()
            code = 0
        finally:
            os._exit(code)
    return pid


def wait(pid: int) -> int:
    """The exit status: >= 0 an exit code, < 0 the signal that killed it."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise TimeoutError(f"training process {pid} hung")


def kill_at_random(pid: int, run: Path, rng: random.Random) -> None:
    """SIGKILL at a random moment: during start-up or the first step, or a random time into a step 1-2
    steps further on (wherever that lands: generating, updating, saving), so the run still advances."""
    newest = max((s for s, _ in list_checkpoints(run)), default=0)
    ahead = min(rng.randint(0, 2), STEPS - 1 - newest)  # never wait for a step past the end of the run
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while ahead and max((s for s, _ in list_checkpoints(run)), default=0) < newest + ahead:
        if time.monotonic() > deadline or os.waitpid(pid, os.WNOHANG)[0]:
            raise RuntimeError("the training process ended before it could be killed")
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.08) if ahead else rng.uniform(0.02, 0.3))
    os.kill(pid, signal.SIGKILL)


def resumed_from(log: Path, seen: int) -> tuple[list[str], int]:
    lines = log.read_text().splitlines() if log.exists() else []
    found = [line.split("Resumed from ")[1].split(" ")[0] for line in lines[seen:] if "Resumed from " in line]
    return [Path(p).name for p in found], len(lines)


def matches_reference(run: Path, reference: Path) -> set[str]:
    """Checkpoints whose weights are byte-identical, and training state (optimizer, RNGs, data position,
    counters) equal, to the reference run's. (torch.save's bytes differ run to run: a random id.)"""
    good = set()
    for _, path in list_checkpoints(run):
        ref = reference / path.name
        try:
            same = (path / "model.safetensors").read_bytes() == (
                ref / "model.safetensors"
            ).read_bytes() and _equal(*(_training_state(d / "training_state.pt") for d in (path, ref)))
        except Exception:  # noqa: BLE001 (a damaged file: simply not a match)
            same = False
        if same:
            good.add(path.name)
    return good


def _training_state(path: Path) -> dict:
    """What training resumes from; `elapsed_s` (the run's wall clock, for the result line) is not state."""
    state = torch.load(path, weights_only=True)
    state.pop("elapsed_s", None)
    return state


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def damage_newest(run: Path) -> str | None:
    found = list_checkpoints(run)
    if len(found) < 2:  # keep one to fall back to
        return None
    target = found[-1][1] / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern off: only the hash can tell
    target.write_bytes(bytes(data))
    return found[-1][1].name


def main(workdir: Path, seed: int) -> None:
    rng = random.Random(seed)
    model = tiny_run.make_model_dir(workdir / "model")
    data = tiny_run.write_dataset(workdir / "data.jsonl", ROWS)
    reference, run = workdir / "reference", workdir / "run"
    start = time.monotonic()
    assert wait(train_in_child(model, data, reference, {})) == 0
    reference_s = time.monotonic() - start

    kills, events, seen_lines, step_at = [], [], 0, 0
    plan = (
        [("save", p) for p in SAVE_POINTS] + [("random", None)] * 6 + [("save", rng.choice(SAVE_POINTS))] * 2
    )
    rng.shuffle(plan)
    damage_after = {3, 8}  # kill numbers after which the newest checkpoint is damaged
    for number, (kind, point) in enumerate(plan):
        good_before = matches_reference(run, reference)
        env = {}
        if kind == "save":
            step_at = min(STEPS - 1, step_at + rng.randint(1, 2))
            env = {"GRPO_TEST_KILL_AT": f"checkpoint-{step_at}:{point}"}
        pid = train_in_child(model, data, run, env)
        if kind == "random":
            kill_at_random(pid, run, rng)
        status = wait(pid)
        loaded, seen_lines = resumed_from(run / "train.log", seen_lines)
        newest = max((s for s, _ in list_checkpoints(run)), default=0)
        step_at = max(step_at, newest)
        events.append(
            {
                "kill": number,
                "kind": kind,
                "point": point,
                "status": status,
                "resumed_from": loaded,
                "intact_before": sorted(good_before),
                "newest_after": newest,
            }
        )
        if status == -signal.SIGKILL:
            kills.append(number)
        if number in damage_after:
            events[-1]["damaged"] = damage_newest(run)
    good_before = matches_reference(run, reference)
    final_status = wait(train_in_child(model, data, run, {}))
    loaded, _ = resumed_from(run / "train.log", seen_lines)
    events.append(
        {
            "kill": None,
            "kind": "final",
            "status": final_status,
            "resumed_from": loaded,
            "intact_before": sorted(good_before),
        }
    )
    report = {
        "kills": len(kills),
        "events": events,
        "seconds": time.monotonic() - start,
        "reference_seconds": reference_s,
        "fallback_warnings": (run / "train.log").read_text().count("is unusable:"),
    }
    (workdir / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
