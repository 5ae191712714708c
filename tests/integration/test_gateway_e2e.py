"""The agent gateway end to end: `grpo train --agent file.py:run` on the bundled tiny tool model, and
`GRPOTrainer(agent=run)`, each for two steps through the real `openai` client."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

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
        # the agents' worker processes (env.agent_workers), forked when the first step's episodes start:
        # on a loaded machine that can take longer than any fixed sleep, so wait for them
        deadline, workers = time.monotonic() + 90, []
        while not workers and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            workers = _children(proc.pid)
        time.sleep(2)  # the agents have called the model and hang
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.stderr.read()
        rc = proc.wait(timeout=120)
        assert rc == 128 + signal.SIGTERM and time.monotonic() - started < 60  # not the 300 s episode limit
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        assert workers
        time.sleep(0.5)
        assert not [pid for pid in workers if _alive(pid)]  # no agent outlives the run
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True], ids=["chat", "chat-streamed"])
def test_agent_episodes_on_the_transformers_engine_are_token_exact(streamed):
    """The gateway over `model.generate` (generation.engine=transformers): each episode's ids are the chat
    template's rendering of the conversation the agent had, and each sampled token's recorded log-prob is
    the policy's at that very position of its row (the ids trained on are the ids sampled). Streamed, the
    turn's text arrives when the engine call ends (generate reports no decode step)."""
    pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.model.loading import resolve_path
    from grpo.rollout.transformers import TransformersEngine
    from tests.integration import test_agent_clients as clients

    path = resolve_path("tiny-tools-lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    agent = clients.chat_streaming_agent if streamed else clients.example.run
    prompts, rollouts = clients.drive((tokenizer, TransformersEngine(model, tokenizer)), agent)
    clients.check_episodes(tokenizer, prompts, rollouts, clients.example.TOOLS)
    for k in range(len(rollouts.episodes)):
        n = int(rollouts.completion_mask[k].sum())
        prompt = prompts.prompt_token_ids[int(rollouts.group_ids[k])]
        ids = torch.tensor([prompt + rollouts.completion_ids[k, :n].tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [n, V]: the logits each completion id had
        policy = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]  # [n]
        sampled = rollouts.loss_mask[k, :n].bool()
        torch.testing.assert_close(
            rollouts.sampling_logprobs[k, :n][sampled], policy[sampled], atol=1e-4, rtol=0
        )


def test_grpo_train_through_the_agent_on_the_transformers_engine(tmp_path):
    """`grpo train --config tiny_tools_agent generation.engine=transformers`, two short steps."""
    out = tmp_path / "run"
    small = [*SMALL, "generation.engine=transformers", f"output_dir={out}"]
    assert main(["train", "--config", "tiny_tools_agent", *small]) == 0
    lines = [m for m in metrics_of(out) if "gateway/rows_per_episode" in m]
    assert len(lines) == 2
    for m in lines:
        assert m["gateway/rows_per_episode"] == 1.0 and m["gateway/forks"] == 0.0
        assert m["gateway/batch_rows"] > 1.0  # the episodes' calls shared engine calls
        assert m["mismatch/logp_abs_mean"] < 1e-3  # the learner scores the very ids generate sampled
    assert (out / "final_model" / "model.safetensors").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith(("grpo-gateway", "grpo-agent"))]


def test_a_checkpoint_after_a_pre_started_step_resumes_with_its_prompts(tmp_path):
    """Step 2's agents start while step 1 updates; checkpoint-1 still holds the stream after step 1 only, so
    a run resumed from it samples step 2's prompts as the straight run did (the pre-started episodes were
    discarded with the run that started them, never counted)."""
    from grpo.checkpoint.store import load_training_state

    # env.agent_start_ahead=true: whatever this host's cores
    base = [a for a in SMALL if not a.startswith(("steps=", "save_steps="))] + ["env.agent_start_ahead=true"]
    agent = ["--agent", f"{AGENTS}:calculator_agent"]
    straight, first = tmp_path / "straight", tmp_path / "first"
    for out, steps in ((straight, 3), (first, 2)):
        argv = ["train", "--config", "tiny_tools", *agent, f"output_dir={out}", f"steps={steps}", *base]
        assert main([*argv, "save_steps=1"]) == 0
    lines = metrics_of(straight)
    assert [m.get("gateway/started_ahead") for m in lines if "time/step" in m] == [0.0, 1.0, 1.0]
    state = load_training_state(first / "checkpoint-1")
    assert state["data"] == load_training_state(straight / "checkpoint-1")["data"]
    assert state["data"]["position"] == 2  # step 1's prompts only, though step 2's had been drawn
    resumed = tmp_path / "resumed"
    argv = ["train", "--config", "tiny_tools", *agent, f"output_dir={resumed}", "steps=3", *base]
    assert main([*argv, "save_steps=1", f"resume={first / 'checkpoint-1'}"]) == 0
    assert (
        load_training_state(resumed / "checkpoint-3")["data"]
        == load_training_state(straight / "checkpoint-3")["data"]
    )
    assert not [t for t in threading.enumerate() if t.name.startswith(("grpo-gateway", "grpo-agent"))]
