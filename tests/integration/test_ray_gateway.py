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
