"""Device roles from TorchRL counts/lists and MaxText fractions; clear errors when they do not fit."""

from __future__ import annotations

import pytest

from grpo.config import ConfigError, GRPOConfig
from grpo.distributed.roles import apply_role_plan, plan_roles
from grpo.distributed.runtime import Runtime


def cfg(**overrides) -> GRPOConfig:
    return GRPOConfig(**overrides).validate()


def test_separate_rollout_devices_need_ray_mode():
    with pytest.raises(ConfigError, match=r"inference_model.num_devices=2.*rollout.mode=sync"):
        cfg(**{"inference_model.num_devices": 2})


def test_learner_devices_need_torchrun_processes(monkeypatch):
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node 2"):
        cfg(**{"train_model.num_devices": 2})
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg(**{"train_model.num_devices": 2})  # launched right: fine


def test_fsdp_degree_means_fsdp2_over_that_many_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="strategy=fsdp2"):
        cfg(ici_fsdp_parallelism=4)
    cfg(ici_fsdp_parallelism=4, strategy="fsdp2")


def test_staleness_bound_must_admit_the_weight_sync_period():
    with pytest.raises(ConfigError, match=r"weights up to 3 step\(s\) old.*max_staleness=1"):
        cfg(**{"rollout.mode": "async", "inference_rollouts": 3})
    cfg(**{"rollout.mode": "async", "inference_rollouts": 3, "rollout.max_staleness": 3})
    cfg(mode="sync")  # TorchRL's spelling


def test_torchrl_counts_place_roles_on_disjoint_gpus(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = cfg(
        **{
            "train_model.num_devices": 2,
            "ref_model.num_devices": 2,
            "inference_model.num_devices": 2,
            "rollout.mode": "async",
        }
    )
    plan = plan_roles(c, num_gpus=4, world_size=2)
    assert plan.learner_devices == ["cuda:0", "cuda:1"] and plan.rollout_devices == [[2], [3]]
    assert plan.reference == "with policy"
    with pytest.raises(ConfigError, match=r"Rollout wants 2 GPU\(s\).*leaving 0"):
        plan_roles(c, num_gpus=2, world_size=2)


def test_maxtext_fractions_split_the_devices(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    c = cfg(trainer_devices_fraction=0.5, sampler_devices_fraction=0.5, **{"rollout.mode": "async"})
    plan = plan_roles(c, num_gpus=8, world_size=4)
    assert plan.learner_devices == [f"cuda:{i}" for i in range(4)]
    assert plan.rollout_devices == [[4], [5], [6], [7]] and plan.rollout_replicas == 4
    with pytest.raises(ConfigError, match="would overlap"):
        cfg(trainer_devices_fraction=0.75, sampler_devices_fraction=0.5, **{"rollout.mode": "async"})


def test_device_lists_are_checked_against_the_machine():
    c = cfg(**{"train_model.devices": [0], "inference_model.devices": [0], "rollout.mode": "sync"})
    with pytest.raises(ConfigError, match=r"GPUs \[0\] are given both"):
        plan_roles(c, num_gpus=2)
    c = cfg(**{"inference_model.devices": [5], "rollout.mode": "sync"})
    with pytest.raises(ConfigError, match=r"GPU ids \[5\] do not exist"):
        plan_roles(c, num_gpus=2)
    with pytest.raises(ConfigError, match="no GPU is visible"):
        plan_roles(c, num_gpus=0)


def test_cpu_plan_and_reference_placement():
    plan = plan_roles(cfg(ref_device="offload"), num_gpus=0)
    assert plan.learner_devices == ["cpu"] and plan.reference == "cpu" and plan.rollout == "colocated"
    with pytest.raises(ConfigError, match="ref_device"):
        cfg(ref_device="tpu")
    with pytest.raises(ConfigError, match="tensor-parallel"):
        cfg(ici_tensor_parallelism=4)


def test_prompt_sharding_keeps_groups_whole_and_equal():
    indices, rows = list(range(10)), [{"prompt": str(i)} for i in range(10)]
    shards = [Runtime(rank=r, world_size=3).shard(indices, rows) for r in range(3)]
    assert [s[0] for s in shards] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # prompt 9 dropped: 10 = 3·3 + 1
    assert Runtime().shard(indices, rows) == (indices, rows)
    with pytest.raises(RuntimeError, match="at least one"):
        Runtime(rank=0, world_size=4).shard(indices[:3], rows[:3])


def test_lora_aliases_reach_the_lora_section():
    c = cfg(
        **{
            "train_model.lora.enabled": "true",
            "train_model.lora.r": 4,
            "train_model.lora.alpha": 8,
            "train_model.lora.dropout": 0.1,
        }
    )
    assert (c.lora.enabled, c.lora.r, c.lora.alpha, c.lora.dropout) == (True, 4, 8.0, 0.1)
    with pytest.raises(ConfigError, match="LoRA needs"):
        cfg(**{"lora.enabled": True, "lora.r": 0})


def test_the_shared_ray_cluster_is_a_decision_of_the_plan_not_a_write_to_the_config(monkeypatch):
    """Several learner processes with Ray rollout and no ray_address join the cluster `ray start --head` made
    here: the plan says so (its decisions go into the run's settings); the caller's config is only read."""
    import grpo.distributed.roles as roles

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(roles, "running_ray_cluster", lambda: "127.0.0.1:6379")
    c = cfg(**{"rollout.mode": "sync", "model.device": "cpu"})
    before = c.to_yaml()
    plan = apply_role_plan(c, rank=1, world_size=2, local_rank=1)
    assert plan.ray_address == "auto" and plan.decisions() == {"distributed.ray_address": "auto"}
    assert c.to_yaml() == before and c.distributed.ray_address is None
    given = cfg(**{"rollout.mode": "sync", "model.device": "cpu", "distributed.ray_address": "10.0.0.1:6379"})
    assert apply_role_plan(given, rank=1, world_size=2, local_rank=1).decisions() == {}
    assert apply_role_plan(cfg(**{"model.device": "cpu"}), 0, 1, 0).decisions() == {}  # colocated
