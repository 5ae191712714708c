"""The gateway's two switches as config keys: env.agent_keep_alive (the server leaves an agent's connection
open between its calls) and env.agent_start_ahead (the next step's agents start while the learner updates;
unset: where the update leaves a core idle), each read by build_agent_runner and acting on the runner."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from grpo.config import ConfigError, load_config
from grpo.gateway.runner import build_agent_runner
from grpo.gateway.sessions import Session
from tests.unit.test_episodes import ScriptedEngine, calls_then_answers
from tests.unit.test_gateway import SAMPLING, qwen  # noqa: F401 - qwen is a fixture

GOOD = {"model": "m", "messages": [{"role": "user", "content": "What is 12 * 34?"}]}


def built(tokenizer, **overrides):
    cfg = load_config("tiny_tools_agent", overrides)
    return build_agent_runner(cfg, SimpleNamespace(tokenizer=tokenizer))


def _closes_after_a_reply(run, tokenizer) -> bool:
    gateway = run._serve(ScriptedEngine(tokenizer, calls_then_answers), SAMPLING)
    s = gateway.sessions.add(Session(0, 0, {}))
    reply = httpx.post(f"{run.server.base_url}/chat/completions", json=GOOD,
                       headers={"Authorization": f"Bearer {s.key}"}, timeout=30)  # fmt: skip
    assert reply.status_code == 200
    return reply.headers.get("connection", "").lower() == "close"


def test_keep_alive_is_a_config_key_that_the_runners_server_follows(qwen):  # noqa: F811
    for overrides, closes in (({}, False), ({"env.agent_keep_alive": "false"}, True)):
        run = built(qwen, **overrides)
        try:
            assert _closes_after_a_reply(run, qwen) is closes
        finally:
            run.close()


def test_start_ahead_is_a_config_key_over_the_cores_default(qwen, monkeypatch):  # noqa: F811
    monkeypatch.setattr("grpo.gateway.agent_pool.default_size", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # no core left idle by the update
    assert not built(qwen)._ahead_pays()
    assert built(qwen, **{"env.agent_start_ahead": "true"})._ahead_pays()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # a core left idle
    assert built(qwen)._ahead_pays()
    assert not built(qwen, **{"env.agent_start_ahead": "false"})._ahead_pays()


@pytest.mark.parametrize("key", ["env.agent_keep_alive", "env.agent_start_ahead"])
def test_a_bad_value_is_one_line_naming_the_key(key):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_tools_agent", {key: "sometimes"})
    assert key in str(err.value) and "\n" not in str(err.value)


def test_the_switches_are_in_the_help(capsys):
    from grpo.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out
    assert "--env.agent_keep_alive" in shown and "--env.agent_start_ahead" in shown
