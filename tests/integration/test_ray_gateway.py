"""The agent gateway on Ray rollout actors: each actor serves its own gateway and runs the agents; episodes
come back as the rows one process makes; under rollout.mode=async a weight update lands mid-episode and the
staleness bound reads each row's oldest token; SIGTERM ends the agents and servers and leaves nothing."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from grpo.cli import main

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "steps=2", "prompts_per_step=2", "num_generations=4", "eval_before=false", "eval_after=false",
    "save_steps=0", "logging_steps=1", "num_threads=1", "progress_bar=false", "tensorboard=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's default 15 starves actors on a busy machine
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_grpo_train_with_an_agent_file_on_ray_rollout_actors(local_ray, offline, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--config", "tiny_tools_agent", "--agent", "examples/tiny_tools_agent.py:run",
            "rollout.mode=sync", f"output_dir={out}", *SMALL]  # fmt: skip
    assert main(argv) == 0
    lines = [m for m in metrics_of(out) if "loss" in m]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:  # the rows one process makes, and the actor's gateway metrics with them
        assert m["gateway/rows_per_episode"] == 1.0 and m["gateway/forks"] == 0.0
        assert m["gateway/batch_rows"] > 1.0  # the episodes' calls shared engine calls on the actor
        assert sum(v for k, v in m.items() if k.startswith("episode/ended_by/")) == pytest.approx(1.0)
        assert m["rollout/staleness"] == 0 and m["episode/turns"] >= 1
    assert (out / "final_model" / "model.safetensors").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith(("grpo-gateway", "grpo-agent"))]


def test_async_a_weight_update_mid_episode_gives_rows_two_versions_and_the_oldest_counts(
    local_ray, offline, tmp_path, monkeypatch
):
    from grpo import GRPOTrainer
    from grpo.config import load_config
    from grpo.rollout import ray as ray_rollout
    from tests.integration.ray_agents import WaitsInItsSecondStep

    folder = tmp_path / "signals"
    folder.mkdir()
    per_step = 2 * 4  # prompts_per_step × num_generations
    push = ray_rollout.RayRollout.sync_weights

    def after_the_second_steps_first_calls(self, step, policy):
        if step == 1:  # the weights of step 1 land while step 2's episodes wait between their calls
            deadline = time.monotonic() + 120
            while not list(folder.glob("called-*")) and time.monotonic() < deadline:
                time.sleep(0.05)
        push(self, step, policy)
        if step == 1:
            (folder / "go").touch()

    monkeypatch.setattr(ray_rollout.RayRollout, "sync_weights", after_the_second_steps_first_calls)
    overrides = dict(a.split("=") for a in SMALL)
    overrides |= {"output_dir": str(tmp_path / "run"), "rollout.mode": "async", "max_staleness": "1"}
    # The agent numbers its episodes in its process: one agent worker per actor keeps one count.
    overrides |= {"env.agent_workers": "1"}
    trainer = GRPOTrainer(
        config=load_config("tiny_tools", overrides), agent=WaitsInItsSecondStep(folder, per_step)
    )
    trainer.train()
    lines = [m for m in metrics_of(tmp_path / "run") if "loss" in m]
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[0]["rollout/mixed_version_rows"] == 0 and lines[0]["rollout/staleness"] == 0
    assert lines[1]["rollout/mixed_version_rows"] >= 1  # tokens of weights 0, then of weights 1, in one row
    assert lines[1]["rollout/staleness"] == 1  # the row's oldest token (weights 0) at learner version 1
    assert lines[1]["rollout/dropped_stale_rows"] == 0  # within max_staleness


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def test_sigterm_ends_the_agents_and_servers_on_the_actors_and_leaves_nothing_behind(offline, tmp_path):
    import re
    import signal
    import socket
    import subprocess
    import sys

    folder = tmp_path / "agents"
    folder.mkdir()
    command = f"python {ROOT / 'tests' / 'integration' / 'ray_agents.py'} {folder}"
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "grpo", "train", "--config", "tiny_tools", "--agent-command", command,
            "rollout.mode=sync", "env.episode_timeout_s=300", f"output_dir={out}", *SMALL]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RAY_worker_niceness": "0"}
    log = tmp_path / "stderr.txt"  # a file, not a pipe: a Ray process that inherited it cannot block the test
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    family: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while len(list(folder.glob("agent-*"))) < 8 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()[-3000:]
        agents = {int(p.name.split("-")[1]): p.read_text() for p in folder.glob("agent-*")}
        assert len(agents) == 8  # every episode's command runs, spawned on the actor's node
        port = int(re.search(r":(\d+)/v1", next(iter(agents.values()))).group(1))
        time.sleep(2)  # the agents have called the model and hang
        family = _descendants(proc.pid) | set(agents)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=180)
        assert rc == 128 + signal.SIGTERM and time.monotonic() - started < 120  # not the 300 s episode limit
        deadline = time.monotonic() + 30
        while [p for p in family if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p for p in family if _alive(p)]  # no agent, actor or Ray process is left
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in family | _descendants(proc.pid):  # only what this test started, if the test failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
