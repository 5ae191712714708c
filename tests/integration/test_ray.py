"""Ray rollout workers: sync mode reproduces the single-process loop; async mode stays within
max_staleness, corrects for it, and survives a rollout actor being killed mid-run."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from grpo import GRPOConfig, GRPOTrainer

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SMALL = {
    "batch_size": 2,
    "num_generations": 4,
    "max_new_tokens": 16,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-3,
    "warmup_steps": 0,
    "logging_steps": 1,
    "progress_bar": False,
    "seed": 11,
    "eval_dataset": None,
    "num_threads": 1,
    "beta": 0.04,
    "tensorboard": False,
    "save_steps": 0,
    "report": False,  # its plots cost ~2 CPU-s a run (measured); no test here reads them
}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's default 15 starves actors on a busy machine
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()


def shortness(prompts, completions, **_):
    return [-len(c) / 50 for c in completions]


def train(out, reward_funcs=(shortness,), **overrides) -> list[dict]:
    cfg = GRPOConfig(**{**SMALL, "output_dir": str(out), **overrides})
    torch.manual_seed(0)
    GRPOTrainer(config=cfg, reward_funcs=list(reward_funcs)).train()
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_sync_mode_matches_the_single_process_loop(tmp_path):
    # Ray's rollout actors record nothing for replay (the engine is not in the learner's process), so the
    # single-process loop it is compared with recomputes its update's forward too (same kernels, same bits).
    local = train(tmp_path / "local", steps=3, **{"train.replay_rollout_forward": False})
    remote = train(tmp_path / "sync", steps=3, **{"rollout.mode": "sync"})
    for a, b in zip(local, remote, strict=True):
        assert b["rollout/staleness"] == 0 and "is/weight_mean" not in b  # on-policy: nothing to correct
        assert abs(b["is/ess"] - 1) < 1e-3  # logged in every mode: the sampler's log-probs are the learner's
        for key in ("reward", "loss", "kl", "grad_norm", "completion_len/mean"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    wa = load_file(str(tmp_path / "local" / "final_model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "sync" / "final_model" / "model.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_async_mode_bounds_staleness_and_survives_a_killed_actor(tmp_path):
    calls = {"n": 0}

    def kill_an_actor_once(prompts, completions, **_):
        calls["n"] += 1
        if calls["n"] == 2:  # mid-run, while the actor samples the next batch
            from grpo.rollout.ray import ACTOR_PREFIX

            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(ACTOR_PREFIX)
            ]
            ray.kill(ray.get_actor(names[0]))
        return [0.0] * len(completions)

    lines = train(
        tmp_path / "async",
        reward_funcs=(shortness, kill_an_actor_once),
        steps=5,
        **{"rollout.mode": "async", "max_staleness": 2},
    )
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    assert all(x["rollout/staleness"] <= 2 for x in lines)
    assert max(x["rollout/staleness"] for x in lines) == 2  # rollout really ran ahead of the learner
    assert lines[-1]["rollout/actor_restarts"] == 1 and lines[-1]["rollout/dropped_stale"] == 0
    stale = [x for x in lines if x["rollout/staleness"] > 0]
    assert stale and all(0 < x["is/ess"] <= 1 for x in stale)  # importance-corrected
    assert (tmp_path / "async" / "final_model" / "model.safetensors").is_file()


def test_batches_older_than_max_staleness_are_dropped_and_counted(tmp_path, monkeypatch):
    # Validated configs never sample further ahead than max_staleness allows, so the safety net that
    # drops over-stale batches is reached by letting the rollout run three batches ahead (as a slow
    # weight push or a replaced actor could) while max_staleness stays 1.
    from grpo.rollout import ray as ray_rollout

    original = ray_rollout.RayRollout.__init__

    def run_far_ahead(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.ahead = 3

    monkeypatch.setattr(ray_rollout.RayRollout, "__init__", run_far_ahead)
    lines = train(tmp_path / "ahead", steps=4, **{"rollout.mode": "async", "max_staleness": 1})
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert all(x["rollout/staleness"] <= 1 for x in lines)  # nothing older was trained on
    dropped = [x["rollout/dropped_stale"] for x in lines]
    assert dropped == sorted(dropped) and dropped[-1] > 0  # counted, in prompts
    assert dropped[-1] % SMALL["batch_size"] == 0


def test_multi_turn_episodes_run_on_ray_actors_in_async_mode(tmp_path):
    """The episode runner travels to the actors (EngineSpec.episodes): each actor runs every turn of its
    share of the episodes; the learner trains on them off-policy, and evaluation samples on an actor."""
    from tests.integration.test_agents_e2e import Echo, dataset, length_reward, model_and_tokenizer

    model, tokenizer = model_and_tokenizer()
    settings = {"rollout.mode": "async", "steps": 2, "max_new_tokens": 8, "gradient_accumulation_steps": 1}
    settings.update({"env.max_tokens": 200, "max_prompt_length": 768, "output_dir": str(tmp_path / "run")})
    cfg = GRPOConfig(**{**SMALL, **settings})
    trainer = GRPOTrainer(
        model=model, tokenizer=tokenizer, config=cfg, train_dataset=dataset(), eval_dataset=None,
        environment_factory=Echo, reward_funcs=[length_reward],
    )  # fmt: skip
    summary = trainer.train()
    assert summary["episode/turns"] >= 1 and "episode/injected_tokens" in summary
    assert summary["rollout/policy_version"] == 2.0 and torch.isfinite(torch.tensor(summary["loss"]))


def _agent_trainer(tmp_path, environment, reward_funcs):
    from tests.integration.test_agents_e2e import dataset, model_and_tokenizer

    model, tokenizer = model_and_tokenizer()
    settings = {"rollout.mode": "sync", "steps": 1, "max_new_tokens": 8, "gradient_accumulation_steps": 1}
    settings.update({"env.max_tokens": 200, "max_prompt_length": 768, "output_dir": str(tmp_path / "run")})
    cfg = GRPOConfig(**{**SMALL, **settings})
    return GRPOTrainer(
        model=model, tokenizer=tokenizer, config=cfg, train_dataset=dataset(), eval_dataset=None,
        environment_factory=environment, reward_funcs=reward_funcs,
    )  # fmt: skip


def test_reward_functions_receive_environments_from_ray_actors_as_in_one_process(tmp_path):
    from tests.integration.test_agents_e2e import Notebook

    seen = []

    def env_reward(completions, environments, target, **_):
        seen.append(environments)
        return [float(env.target == t) for env, t in zip(environments, target, strict=True)]

    summary = _agent_trainer(tmp_path, Notebook, [env_reward]).train()
    assert summary["reward/env_reward"] == 1.0  # each environment was reset with its own row, on an actor
    assert all(isinstance(e, Notebook) for batch in seen for e in batch) and len(seen[0]) == 8


def test_an_environment_contract_error_on_an_actor_arrives_as_one_line(tmp_path):
    from grpo.agents.environments import EnvironmentContractError
    from tests.integration.test_agents_e2e import length_reward
    from tests.unit.test_environment_contracts import Raises

    with pytest.raises(EnvironmentContractError, match=r"^Raises\.reset\(\*\*row\) raised KeyError") as e:
        _agent_trainer(tmp_path, Raises, [length_reward]).train()
    assert "\n" not in str(e.value)
