"""Resume and the run's checkpoints: what a checkpoint holds besides the weights, `checkpoint-{step}/`
and `final_model/` written, and a run restored from one (weights, learner, data position, RNG).

Every rank calls these (saving a sharded policy gathers it); rank 0 alone writes (checkpoint/policy.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo.checkpoint.policy import load_policy_weights, save_policy_dir
from grpo.checkpoint.store import (
    link_model_dir,
    load_training_state,
    prune_checkpoints,
    rng_state,
    seed_everything,
    set_rng_state,
)
from grpo.config import ConfigError, GRPOConfig
from grpo.distributed.runtime import Runtime

if TYPE_CHECKING:
    from grpo.data import PromptStream
    from grpo.run.assemble import RunParts

log = logging.getLogger("grpo")

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # train.save_dtype; float32: as trained


def resume(cfg: GRPOConfig, parts: RunParts, rt: Runtime, learner, stream: PromptStream) -> tuple[int, int]:
    """Load the checkpoint preflight chose (weights, learner, data position, RNG), or seed a fresh run.
    Returns (the step to continue after, non-finite steps so far)."""
    path = parts.resume_from  # verified, settings compared: preflight.plan_resume
    if path is None:
        if cfg.train.resume:
            log.info("No checkpoint in %s yet; starting from step 0.", parts.run_dir)
        seed_everything(cfg.train.seed)
        rt.seed(cfg.train.seed)  # several processes: different sampling noise per rank
        return 0, 0
    state = load_training_state(path)
    try:
        load_policy_weights(rt, path, parts.policy, state)
        learner.load_state_dict(state["learner"])
    except (RuntimeError, ValueError, KeyError) as err:  # shapes, names or optimizer groups that differ
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{path} holds the weights of a different model than {cfg.model.name_or_path} ({detail}). "
            "train.allow_config_change lets settings change, not the model's architecture: resume with the "
            "model it was trained from, or start afresh in another --output-dir."
        ) from None
    learner.nonfinite_in_a_row = state["nonfinite_in_a_row"]
    stream.load_state_dict(state["data"], strict=not cfg.train.allow_config_change)
    rngs = state["rng"]
    set_rng_state(rngs[rt.rank] if isinstance(rngs, list) else rngs)
    log.info("Resumed from %s (step %d).", path, state["step"])
    return state["step"], state["nonfinite_total"]


def training_state(rt: Runtime, step: int, learner, data_state: dict, nonfinite_total: int) -> dict:
    """What a checkpoint holds besides the weights (every rank calls it: it gathers)."""
    rngs = rt.gather_objects(rng_state())  # each rank's sampling noise, for an exact resume
    return {
        "step": step,
        "learner": learner.state_dict(),
        "rng": rngs[0] if len(rngs) == 1 else rngs,
        "data": data_state,
        "nonfinite_in_a_row": learner.nonfinite_in_a_row,
        "nonfinite_total": nonfinite_total,
    }


def save_checkpoint(cfg: GRPOConfig, parts: RunParts, rt: Runtime, step: int, state: dict) -> Path:
    path = save_policy_dir(
        rt, parts.run_dir / f"checkpoint-{step}", parts.policy, parts.tokenizer, cfg.to_yaml(), state
    )
    if rt.is_main:
        prune_checkpoints(parts.run_dir, cfg.train.save_total_limit, protect=(path, parts.resume_from))
    return path


def save_final(
    cfg: GRPOConfig, parts: RunParts, rt: Runtime, state: Callable[[], dict], same_as: Path | None = None
) -> None:
    """final_model/ is resumable like checkpoint-{step}/ (the seed's layout), except as merged LoRA weights,
    which no longer hold the adapters the optimizer state belongs to, or as a bf16/fp16 export
    (train.save_dtype), which no longer holds the float32 masters.

    `same_as`: the checkpoint just saved after the last step. Where final_model/ would hold exactly what it
    holds (not merged, not exported), it becomes a second name for its files (`store.link_model_dir`):
    the weights and optimizer state are written once at the end of a run, not twice (6 GB each on a
    0.5B model), and no rank gathers the weights again."""
    merged = cfg.lora.enabled and cfg.lora.save_merged
    export = SAVE_DTYPES.get(cfg.train.save_dtype)
    if same_as is not None and not (merged or export):
        if rt.is_main:
            link_model_dir(same_as, parts.run_dir / "final_model")
        rt.barrier()
        return
    save_policy_dir(
        rt,
        parts.run_dir / "final_model",
        parts.policy,
        parts.tokenizer,
        cfg.to_yaml(),
        None if merged or export else state(),
        merge_lora=cfg.lora.save_merged,
        dtype=export,
    )
