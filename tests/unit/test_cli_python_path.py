"""Smaller things from issue 33 that mislead, through the CLI as a user types it: --dry-run imports and
describes the tools, `--config X --help` shows X's defaults, a sweep with equal accuracies shows what
differs."""

from __future__ import annotations

import pytest

from grpo.cli import main
from grpo.run.console import sweep_table


def test_dry_run_imports_the_tools_and_lists_them_with_the_episode_limits(capsys):
    assert main(["train", "--config", "tiny_tools", "--dry-run"]) == 0
    plan = capsys.readouterr().out.split("\nplan:\n")[1]
    assert "- name: calculator" in plan and "expression: string" in plan
    assert "max_turns: 4" in plan and "max_new_tokens_per_turn: 48" in plan and "max_tokens: 160" in plan
    assert (
        main(["train", "--config", "tiny_tools", "--dry-run", "--tools", "grpo.agents.calculator:calc"]) == 2
    )
    assert "has no attribute 'calc'" in capsys.readouterr().err  # a typo stops here, as in --reward-funcs


def test_dry_run_of_an_agent_run_imports_the_agent_and_lists_the_gateways_limits(capsys):
    assert main(["train", "--config", "tiny_tools_agent", "--dry-run"]) == 0
    plan = capsys.readouterr().out.split("\nplan:\n")[1]
    assert "one turn" not in plan  # the agent's episodes are multi-turn: its tools come with its requests
    assert "agent: examples/tiny_tools_agent.py:run" in plan and "async: false" in plan
    assert (
        "max_new_tokens_per_turn: 48" in plan and "max_tokens: 160" in plan and "episode_timeout_s:" in plan
    )
    assert main(["train", "--config", "tiny_tools_agent", "--dry-run", "--agent-command", "python x.py"]) == 0
    assert "agent_command: python x.py" in capsys.readouterr().out.split("\nplan:\n")[1]
    assert (
        main(
            [
                "train",
                "--config",
                "tiny_tools_agent",
                "--dry-run",
                "--agent",
                "examples/tiny_tools_agent.py:nope",
            ]
        )
        == 2
    )
    assert "has no attribute 'nope'" in capsys.readouterr().err  # a typo stops before the model loads


def test_train_help_shows_the_chosen_presets_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--config", "tiny_tools", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "default: tiny_tools from the tiny_tools preset" in shown
    assert "default: tiny-tools-lm from the tiny_tools preset" in shown
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "from the tiny_tools preset" not in capsys.readouterr().out  # tiny_math's, without --config


def test_a_sweep_with_equal_accuracies_shows_reward_and_tool_call_rate():
    runs = [
        ({"lr": "1e-4"}, {"eval/accuracy_after": 0.5, "reward": 0.3, "episode/tool_call_frac": 0.25}, "a"),
        ({"lr": "1e-5"}, {"eval/accuracy_after": 0.5, "reward": 0.4, "episode/tool_call_frac": 0.5}, "b"),
    ]
    table = sweep_table(runs).splitlines()
    assert table[0].split() == [
        "lr",
        "held-out",
        "accuracy",
        "final",
        "reward",
        "tool-call",
        "rate",
        "run",
        "dir",
    ]
    assert table[1].split() == ["1e-4", "50.0%", "0.300", "25.0%", "a"]
    runs[1][1]["eval/accuracy_after"] = 0.75  # accuracies differ: they tell the runs apart
    assert "final reward" not in sweep_table(runs)
