"""Issue 32 §5: what still failed from the last hostile round, one test per case."""

from __future__ import annotations

import json
import logging

import pytest

from grpo.config import ConfigError, GRPOConfig, read_config_file
from grpo.config.tree import apply_user_precedence
from grpo.config.yaml_limits import load_yaml
from grpo.run.metrics import keep_until_step
from grpo.run.report import write_report


def lines(path):
    return path.read_text().splitlines()


def test_a_fresh_start_keeps_the_logs_of_a_run_killed_before_its_first_checkpoint(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2, 3)))
    with caplog.at_level(logging.WARNING, logger="grpo"):
        keep_until_step(metrics, 0)
    kept = tmp_path / "metrics.before-1.jsonl"
    assert len(lines(kept)) == 3 and not metrics.exists()
    assert "metrics.before-1.jsonl" in caplog.text
    metrics.write_text(json.dumps({"step": 1}) + "\n")  # and again: a second name, nothing overwritten
    keep_until_step(metrics, 0)
    assert len(lines(tmp_path / "metrics.before-2.jsonl")) == 1 and len(lines(kept)) == 3


def test_a_resume_still_drops_only_the_lines_past_its_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    keep_until_step(metrics, 2)
    assert [json.loads(x)["step"] for x in lines(metrics)] == [1, 2]
    assert not list(tmp_path.glob("*.before-*"))


def test_a_key_written_twice_in_a_yaml_file_is_refused_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: 1.0e-4\ntrain:\n  steps: 3\noptim:\n  learning_rate: 1.0\n")
    with pytest.raises(ConfigError, match=r"the key 'optim' is written twice \(lines 1 and 5\)"):
        read_config_file(str(path))
    path.write_text("train:\n  steps: 3\n  seed: 1\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"'steps' is written twice \(lines 2 and 4\)"):
        read_config_file(str(path))


def test_yaml_merge_keys_still_load():
    merged = load_yaml("base: &b {seed: 1, steps: 2}\ntrain:\n  <<: *b\n  steps: 3\n", "c.yaml")
    assert merged["train"] == {"seed": 1, "steps": 3}


def test_report_draws_a_metric_named_with_mathtext(tmp_path):
    rows = [{"step": s, "loss": 0.5, "reward": 0.1 * s, "reward/$\\frac$": 0.2 * s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(tmp_path)
    assert page.is_file() and (tmp_path / "report" / "reward.png").is_file()


def test_reward_funcs_with_their_own_weights_are_not_called_rivals():
    cfg = GRPOConfig().update(
        {
            "algorithm.reward_funcs": ["gsm8k_correctness", "gsm8k_format"],
            "algorithm.reward_weights": [1.0, 0.5],
        }
    )
    notes = apply_user_precedence(cfg)
    assert not any("reward_weights" in n for n in notes)
    assert cfg.algorithm.reward_weights == [1.0, 0.5]
    cfg = GRPOConfig().update({"train.num_epochs": 2, "train.steps": 5})  # a real rivalry is still named
    assert any("train.steps wins" in n for n in apply_user_precedence(cfg))
