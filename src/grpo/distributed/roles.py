"""Device roles: which devices the learner (policy), the reference model and rollout use.

Three spellings reach the same plan:

* TorchRL counts and lists: `train_model.num_devices=2 ref_model.num_devices=2
  inference_model.num_devices=2`, or `train_model.devices=[0,1] inference_model.devices=[2,3]`;
* MaxText fractions: `trainer_devices_fraction=0.5 sampler_devices_fraction=0.5` (first half of the
  visible GPUs train, the second half sample; both 1.0 = one shared set), with
  `inference_replicas` rollout replicas and `ici_fsdp_parallelism` as the FSDP degree;
* ours: `distributed.rollout_mode` (colocated | sync | async) and `distributed.ref_device`.

The learner is the torchrun process group: one process per learner device. Colocated rollout samples
on the learner's devices; sync/async rollout runs in Ray actors on devices of their own. Checks that
need no hardware run with the config (grpo/config/validate.py); the device count is checked at start-up
(`plan_roles`), and both say what to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from grpo.config import ConfigError, GRPOConfig


@dataclass
class RolePlan:
    learner_processes: int
    learner_devices: list[str]  # one per learner process: "cpu" or "cuda:N"
    reference: str  # "with policy", "cpu", "offload" or "cuda:N"
    rollout: str  # "colocated" or "ray"
    rollout_replicas: int = 1
    rollout_gpus_per_replica: int = 0  # 0: the actor runs on CPU
    rollout_devices: list[list[int]] = field(default_factory=list)  # explicit GPU ids per replica, if given
    # The Ray cluster the start chose ("auto": the one `ray start --head` made here, shared by every rank)
    # when several learner processes need one and distributed.ray_address is unset; None: nothing decided.
    ray_address: str | None = None

    def decisions(self) -> dict[str, str]:
        """What the plan decided for the run's settings (config/settings.py), as dotted paths: the caller's
        config is not written to."""
        return {"distributed.ray_address": self.ray_address} if self.ray_address else {}

    def describe(self) -> str:
        where = (
            "on the learner's devices"
            if self.rollout == "colocated"
            else f"{self.rollout_replicas} Ray actor(s) × {self.rollout_gpus_per_replica or 'CPU'} "
            f"{'GPU' if self.rollout_gpus_per_replica else ''}".rstrip()
        )
        return (
            f"learner: {self.learner_processes} process(es) on {', '.join(self.learner_devices)}; "
            f"reference: {self.reference}; rollout: {where}"
        )


def plan_roles(cfg: GRPOConfig, num_gpus: int, world_size: int = 1, local_rank: int = 0) -> RolePlan:
    """Place the roles on this machine's `num_gpus` GPUs (0 = CPU only), or say why they do not fit."""
    d = cfg.distributed
    ray_rollout = d.rollout_mode != "colocated"
    if num_gpus == 0:
        return _cpu_plan(cfg, world_size)
    fractions = (d.trainer_devices_fraction, d.sampler_devices_fraction) != (1.0, 1.0)
    learner_ids = _learner_gpus(cfg, num_gpus, world_size, fractions)
    used = set(learner_ids)
    if d.ref_device_ids is not None:
        reference = f"cuda:{d.ref_device_ids[local_rank]}"
        used |= set(d.ref_device_ids)
    elif d.ref_device == "auto":
        reference = "with policy"
    else:
        reference = d.ref_device
        if reference.startswith("cuda"):
            used.add(int(reference.split(":")[1]) if ":" in reference else 0)
    rollout_devices = _rollout_gpus(cfg, num_gpus, used, fractions) if ray_rollout else []
    rollout_ids = [i for r in rollout_devices for i in r]
    bad = [i for i in sorted(used) + rollout_ids if i >= num_gpus]
    if bad:
        raise ConfigError(
            f"GPU ids {sorted(set(bad))} do not exist: {num_gpus} GPU(s) are visible (0..{num_gpus - 1})."
        )
    overlap = sorted(set(learner_ids) & set(rollout_ids))
    if overlap:
        raise ConfigError(
            f"GPUs {overlap} are given both to the learner and to rollout actors; give them "
            "disjoint devices or use rollout.mode=colocated."
        )
    return RolePlan(
        world_size,
        [f"cuda:{i}" for i in learner_ids],
        reference,
        "ray" if ray_rollout else "colocated",
        rollout_replicas=len(rollout_devices) if ray_rollout else 1,
        rollout_gpus_per_replica=1 if ray_rollout else 0,
        rollout_devices=rollout_devices,
    )


def _cpu_plan(cfg: GRPOConfig, world_size: int) -> RolePlan:
    d = cfg.distributed
    ray_rollout = d.rollout_mode != "colocated"
    if any(ids for ids in (d.train_device_ids, d.ref_device_ids, d.inference_device_ids)) or (
        d.ref_device.startswith("cuda")
    ):
        raise ConfigError(
            "Device ids were given (train_model/ref_model/inference_model.devices or "
            "ref_device=cuda:N) but no GPU is visible here."
        )
    reference = {"auto": "with policy", "offload": "cpu"}.get(d.ref_device, d.ref_device)
    return RolePlan(
        world_size,
        ["cpu"] * world_size,
        reference,
        "ray" if ray_rollout else "colocated",
        rollout_replicas=max(d.inference_replicas, d.inference_devices) if ray_rollout else 1,
    )


def _learner_gpus(cfg: GRPOConfig, num_gpus: int, world_size: int, fractions: bool) -> list[int]:
    """One GPU per learner process: the listed ids, the first trainer_devices_fraction, or the first few."""
    d = cfg.distributed
    if d.train_device_ids is not None:
        learner_ids = list(d.train_device_ids)
    elif fractions:
        learner_ids = list(range(max(1, int(num_gpus * d.trainer_devices_fraction))))
    else:
        learner_ids = list(range(min(world_size, num_gpus)))
    if len(learner_ids) < world_size:
        raise ConfigError(
            f"{world_size} learner processes but only {len(learner_ids)} learner GPU(s) "
            f"({learner_ids}) of {num_gpus} visible; launch fewer processes or give more devices."
        )
    return learner_ids[:world_size]


def _rollout_gpus(cfg: GRPOConfig, num_gpus: int, used: set[int], fractions: bool) -> list[list[int]]:
    """One GPU per Ray rollout replica: the listed ids, the last sampler_devices_fraction, or free ones."""
    d = cfg.distributed
    if d.inference_device_ids is not None:
        return [[i] for i in d.inference_device_ids]
    if fractions:
        first = num_gpus - max(1, int(num_gpus * d.sampler_devices_fraction))
        return [[i] for i in range(first, num_gpus)]
    free = [i for i in range(num_gpus) if i not in used]
    wanted = max(d.inference_replicas, d.inference_devices)
    if len(free) < wanted:
        raise ConfigError(
            f"Rollout wants {wanted} GPU(s) of its own, but of {num_gpus} visible GPUs "
            f"{sorted(used)} are taken by the learner/reference, leaving "
            f"{len(free)}. Lower inference_replicas / inference_model.num_devices, "
            "use fewer learner processes, or rollout.mode=colocated."
        )
    return [[i] for i in free[:wanted]]


class OffloadedModel:
    """A frozen model kept in host memory and moved to `device` only for each call (ref_device=offload):
    the reference costs accelerator memory only while its log-probs are computed."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model.to("cpu"), device
        self._anchor = torch.empty(0, device=device)  # what parameters() reports first: the compute device

    def __call__(self, **inputs):
        self.model.to(self.device)
        try:
            return self.model(**inputs)
        finally:
            self.model.to("cpu")

    def parameters(self):
        yield self._anchor
        yield from self.model.parameters()

    def eval(self):
        return self


def place_reference(ref, spec: str, policy_device: torch.device):
    """ref_device: auto (the policy's device), cpu, offload, or cuda:N."""
    if spec == "auto":
        return ref
    if spec == "offload":
        return OffloadedModel(ref, policy_device)
    return ref.to(torch.device(spec))


def running_ray_cluster() -> str | None:
    """The address of a Ray cluster started on this machine (`ray start --head`, or $RAY_ADDRESS), if any."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    try:
        from ray._private.utils import read_ray_address  # the file `ray start` writes (under $TMPDIR/ray)
    except ImportError:
        return None
    return read_ray_address()


def apply_role_plan(cfg: GRPOConfig, rank: int, world_size: int, local_rank: int) -> RolePlan:
    """Plan the roles on this machine and point this process's CUDA device at its learner GPU. `cfg` is only
    read: a Ray cluster chosen here is the plan's `ray_address` (its `decisions()`)."""
    num_gpus = torch.cuda.device_count() if cfg.model.device in ("auto", "cuda") else 0
    plan = plan_roles(cfg, num_gpus, world_size, local_rank)
    if num_gpus:
        torch.cuda.set_device(int(plan.learner_devices[local_rank].split(":")[1]))
    if world_size > 1 and plan.rollout == "ray" and cfg.distributed.ray_address is None:
        if running_ray_cluster() is None:
            raise ConfigError(
                "Several learner processes share one Ray cluster: start it first (`ray start "
                "--head`) on this machine, then run the same command (ray_address=auto is used); "
                "or pass ray_address=HOST:PORT."
            )
        plan = replace(plan, ray_address="auto")
    if rank == 0:
        import logging

        logging.getLogger("grpo").info("Device roles: %s", plan.describe())
    return plan
