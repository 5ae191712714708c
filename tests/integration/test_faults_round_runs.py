"""Issue 32 §5, the cases that need a run: resuming into another architecture is one line, not a traceback."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from tests import tiny_run


def test_resuming_into_another_architecture_with_allow_config_change_is_one_line(tmp_path):
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 4)
    out = tmp_path / "run"
    GRPOTrainer(config=GRPOConfig(**tiny_run.config(model, data, out, steps=1))).train()
    wider = tmp_path / "wider"
    tiny_run.make_model_dir(wider)
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(model)
    config.hidden_size, config.intermediate_size = 32, 64
    LlamaForCausalLM(config).save_pretrained(wider, safe_serialization=True)
    again = tiny_run.config(wider, data, out, steps=2, resume="latest", allow_config_change=True)
    with pytest.raises(ConfigError, match="holds the weights of a different model") as caught:
        GRPOTrainer(config=GRPOConfig(**again)).train()
    assert "\n" not in str(caught.value) and "allow_config_change" in str(caught.value)
