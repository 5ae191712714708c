"""Saving and loading the policy when it may be sharded (FSDP2) or carry LoRA adapters.

Every rank calls these (gathering a sharded model is a collective); rank 0 alone writes, through
`checkpoint.save_model_dir`, so the directory layout and its atomic rename stay in one place.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from grpo.checkpoint.store import save_model_dir
from grpo.distributed.runtime import Runtime
from grpo.files import write_text
from grpo.model.lora import adapter_state, is_lora, merged_state

ADAPTER_SUBDIR = "adapter"
ADAPTER_STATE_KEY = "adapter_weights"


class _PrepareWeights:
    """What `save_model_dir` calls `save_pretrained` on: the live model with a gathered state dict, or
    the merged LoRA model; optionally the adapters beside it."""

    def __init__(
        self,
        model,
        state: dict[str, torch.Tensor],
        adapters: _PrepareWeights | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.model, self.state, self.adapters, self.dtype = model, state, adapters, dtype
        if dtype is not None:  # an export (train.save_dtype): the masters stay float32 in memory
            self.state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    def save_pretrained(self, directory, safe_serialization: bool = True) -> None:
        self.model.save_pretrained(directory, state_dict=self.state, safe_serialization=safe_serialization)
        if self.dtype is not None:  # save_pretrained wrote the live (float32) model's dtype
            config = Path(directory) / "config.json"
            data = json.loads(config.read_text(encoding="utf-8"))
            data["dtype"] = str(self.dtype).removeprefix("torch.")
            data.pop("torch_dtype", None)
            write_text(config, json.dumps(data, indent=2, sort_keys=True) + "\n")
        if self.adapters is not None:
            self.adapters.save_pretrained(
                Path(directory) / ADAPTER_SUBDIR, safe_serialization=safe_serialization
            )


def save_policy_dir(
    rt: Runtime,
    path: Path,
    policy,
    tokenizer,
    config_yaml: str,
    training_state: dict | None,
    merge_lora: bool = False,
    dtype: torch.dtype | None = None,
    owned: bool = True,
) -> Path:
    """checkpoint-N/ or final_model/. LoRA: adapters only (plus their model-key copy in the training state
    for resume), or with `merge_lora` the merged plain model and the adapters in adapter/. `dtype` casts
    the written weights (an export; None: as they are, float32 masters). `owned=False`: a directory the
    user named, written into without deleting anything (checkpoint.save_model_dir)."""
    full = rt.full_state_dict(policy)
    if rt.is_main:
        if is_lora(policy) and merge_lora:
            target = _PrepareWeights(
                policy.get_base_model(),  # writes config.json; the weights are the merged state's
                merged_state(policy, full),
                adapters=_PrepareWeights(policy, full),
                dtype=dtype,
            )
        else:
            target = _PrepareWeights(policy, full, dtype=dtype)
        if training_state is not None and is_lora(policy):
            training_state = {**training_state, ADAPTER_STATE_KEY: adapter_state(full)}
        save_model_dir(path, target, tokenizer, config_yaml, training_state, owned=owned)
    rt.barrier()
    return Path(path)


def load_policy_weights(rt: Runtime, path: Path, policy, training_state: dict) -> None:
    """Weights of checkpoint `path` into the (possibly sharded, possibly LoRA) policy, on every rank."""
    if is_lora(policy):
        rt.load_full_state_dict(policy, training_state[ADAPTER_STATE_KEY], partial=True)
    else:
        rt.load_full_state_dict(policy, load_file(str(Path(path) / "model.safetensors")))
        if hasattr(policy, "tie_weights"):
            policy.tie_weights()
