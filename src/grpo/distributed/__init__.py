"""Scaling out (docs/scaling.md): torchrun learner processes (DDP or FSDP2), device roles, LoRA,
and Ray rollout workers (sync or async). A plain `grpo train` uses none of it beyond a one-process
`Runtime`, whose methods are then the identity."""

from grpo.distributed.runtime import Runtime, init_runtime

__all__ = ["Runtime", "init_runtime"]
