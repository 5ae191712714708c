"""algorithm.advantage_estimator=turn in a real (tiny) agent run: the per-turn rewards an agent posts train
the policy even where every episode's own reward is the same (issue 31)."""

from __future__ import annotations

import itertools
import math

import httpx
import pytest

from tests import gateway_agents
from tests.integration.test_gateway_e2e import SMALL, metrics_of, offline  # noqa: F401 - offline: a fixture

pytestmark = pytest.mark.slow
_count = itertools.count()


def turn_rewarding_agent(client, row):
    """The calculator loop; then a reward for its first turn that differs per episode, and the same episode
    reward (0.5) for every episode: GRPO's advantages are all 0, the turn estimator's are not."""
    gateway_agents.calculator_agent(client, row)
    url = str(client.base_url).rstrip("/") + "/reward"
    headers = {"Authorization": f"Bearer {client.api_key}"}
    httpx.post(url, json={"reward": float(next(_count) % 3), "turn": 1}, headers=headers).raise_for_status()
    return 0.5


@pytest.mark.parametrize("estimator", ["group", "turn"])
def test_the_turn_estimator_trains_on_per_turn_rewards(tmp_path, estimator):
    from grpo import GRPOTrainer
    from grpo.config import load_config

    overrides = dict(a.split("=") for a in SMALL) | {
        "output_dir": str(tmp_path / "run"),
        "steps": "1",
        "algorithm.advantage_estimator": estimator,
    }
    trainer = GRPOTrainer(config=load_config("tiny_tools", overrides), agent=turn_rewarding_agent)
    trainer.train()
    (line,) = [m for m in metrics_of(tmp_path / "run") if "reward" in m]
    assert line["reward"] == 0.5 and math.isfinite(line["loss"])
    if estimator == "group":
        assert line["advantage/abs_max"] == 0.0
    else:
        assert line["advantage/abs_max"] > 0.1
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"advantage_estimator: {estimator}" in saved
