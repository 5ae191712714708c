"""The tiny_tools_agent preset: the tiny_tools demo with the example agent in place of `tools=`, loadable
from any directory, and `--agent-command` on it runs the command instead of the preset's agent."""

from __future__ import annotations

from grpo.config import load_config
from grpo.gateway.runner import load_agent


def test_the_preset_is_tiny_tools_with_the_example_agent_in_place_of_tools():
    agent, tools = load_config("tiny_tools_agent"), load_config("tiny_tools")
    assert agent.env.agent == "examples/tiny_tools_agent.py:run" and not agent.env.tools
    for section in ("model", "data", "generation", "algorithm", "optim", "train"):
        assert getattr(agent, section) == getattr(tools, section), section
    assert agent.env.max_tokens == tools.env.max_tokens


def test_the_example_agent_loads_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = load_agent(load_config("tiny_tools_agent").env.agent)
    assert run.__name__ == "run" and run.__module__.endswith("tiny_tools_agent")


def test_agent_command_replaces_the_presets_agent():
    cfg = load_config("tiny_tools_agent", {"env.agent_command": "python examples/tiny_tools_agent.py"})
    assert cfg.env.agent is None and cfg.env.agent_command == "python examples/tiny_tools_agent.py"
    both = load_config("tiny_tools", {"env.agent": "a.py:run", "env.agent_command": "python cmd.py"})
    assert both.env.agent == "a.py:run"  # both given: the in-process agent wins, as the runner takes it
