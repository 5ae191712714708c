"""The agent gateway end to end: `grpo train --agent file.py:run` on the bundled tiny tool model, and
`GRPOTrainer(agent=run)`, each for two steps through the real `openai` client."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from grpo.cli import main

AGENTS = Path(__file__).resolve().parents[1] / "gateway_agents.py"
SMALL = [
    "steps=2", "prompts_per_step=2", "num_generations=4", "eval_before=false", "eval_after=false",
    "save_steps=0", "logging_steps=1", "num_threads=1", "progress_bar=false", "tensorboard=false",
]  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("agent", ["calculator_agent", "streaming_agent"])
def test_grpo_train_with_an_agent_file_runs_its_episodes_through_the_gateway(tmp_path, agent):
    out = tmp_path / "run"
    rc = main(
        ["train", "--config", "tiny_tools", "--agent", f"{AGENTS}:{agent}", f"output_dir={out}", *SMALL]
    )
    assert rc == 0
    lines = [m for m in metrics_of(out) if "gateway/rows_per_episode" in m]
    assert len(lines) == 2
    for m in lines:
        assert m["gateway/rows_per_episode"] == 1.0 and m["gateway/forks"] == 0.0
        assert m["episode/ended_by/answer"] + m.get("episode/ended_by/max_tokens", 0.0) == 1.0
        assert m["gateway/batch_rows"] > 1.0  # the episodes' calls shared engine calls
    assert (out / "final_model" / "model.safetensors").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith(("grpo-gateway", "grpo-agent"))]


def test_grpo_trainer_takes_an_async_agent_function(tmp_path):
    from grpo import GRPOTrainer
    from grpo.config import load_config
    from tests import gateway_agents

    overrides = dict(a.split("=") for a in SMALL) | {"output_dir": str(tmp_path / "run")}
    cfg = load_config("tiny_tools", overrides)
    trainer = GRPOTrainer(config=cfg, agent=gateway_agents.async_agent)
    trainer.train()
    lines = [m for m in metrics_of(tmp_path / "run") if "reward" in m]
    assert lines and all(m["reward"] == 1.0 for m in lines)  # the agent's own reward, not the functions'
    assert not [t for t in threading.enumerate() if t.name.startswith("grpo-gateway")]


def test_sigterm_ends_the_agents_and_the_server_and_leaves_no_port(tmp_path):
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys
    import time

    agent = f"{AGENTS}:hanging_agent"
    argv = [sys.executable, "-m", "grpo", "train", "--config", "tiny_tools", "--agent", agent,
            "env.episode_timeout_s=300", f"output_dir={tmp_path / 'run'}", *SMALL]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        port = None
        for line in proc.stderr:
            if m := re.search(r"Agent gateway: http://127\.0\.0\.1:(\d+)/v1", line):
                port = int(m.group(1))
                break
        assert port is not None
        time.sleep(2)  # the agents have called the model and hang
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.stderr.read()
        rc = proc.wait(timeout=120)
        assert rc == 128 + signal.SIGTERM and time.monotonic() - started < 60  # not the 300 s episode limit
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
