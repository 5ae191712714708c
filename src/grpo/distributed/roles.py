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
need no hardware run with the config (`validate_roles`); the device count is checked at start-up
(`plan_roles`), and both say what to change.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

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


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_roles(cfg: GRPOConfig) -> None:
    """Everything about roles that can be checked without looking at the hardware."""
    d, lora = cfg.distributed, cfg.lora
    world = _world_size()
    if not (0 < d.trainer_devices_fraction <= 1 and 0 < d.sampler_devices_fraction <= 1):
        raise ConfigError("trainer_devices_fraction and sampler_devices_fraction must be in (0, 1].")
    shared = d.trainer_devices_fraction == 1.0 and d.sampler_devices_fraction == 1.0
    if not shared and d.trainer_devices_fraction + d.sampler_devices_fraction > 1.0 + 1e-9:
        raise ConfigError(
            f"trainer_devices_fraction ({d.trainer_devices_fraction}) + sampler_devices_fraction "
            f"({d.sampler_devices_fraction}) > 1: the two sets would overlap. Use 1.0 and 1.0 to "
            "share every device, or fractions that add up to at most 1."
        )
    separate = {
        k: v
        for k, v in {
            "inference_replicas": d.inference_replicas,
            "inference_model.num_devices": d.inference_devices,
            "inference_model.devices": d.inference_device_ids,
            "sampler_devices_fraction": None if shared else d.sampler_devices_fraction,
        }.items()
        if v not in (None, 1)
    }
    learners = len(d.train_device_ids) if d.train_device_ids is not None else d.train_devices
    if separate and d.rollout_mode == "colocated":
        settings = ", ".join(f"{k}={v}" for k, v in separate.items())
        launch = (
            f" With {learners} learner devices, launch one process per device: `torchrun --nproc_per_node "
            f"{learners} -m grpo train rollout.mode=async ...` (docs/scaling.md)."
            if learners != world
            else ""
        )
        raise ConfigError(
            f"{settings}: rollout on devices of its own runs in Ray actors; add rollout.mode=sync "
            f"(on-policy) or rollout.mode=async (overlapped with training).{launch}"
        )
    if d.inference_devices_per_replica != 1 or d.ici_tensor_parallelism not in (-1, 1):
        raise ConfigError(
            "inference_devices_per_replica / ici_tensor_parallelism > 1 ask for tensor-parallel "
            "rollout replicas; the transformers rollout engine runs one device per replica. Use "
            "more replicas instead (inference_replicas=N, or rollout.replicas=N)."
        )
    if d.train_device_ids is not None:
        if len(set(d.train_device_ids)) != len(d.train_device_ids):
            raise ConfigError(f"train_model.devices {d.train_device_ids} lists a device twice.")
        if d.train_devices != 1 and d.train_devices != len(d.train_device_ids):
            raise ConfigError(
                f"train_model.num_devices={d.train_devices} but train_model.devices lists "
                f"{len(d.train_device_ids)}; give one of the two."
            )
    if learners != 1 and learners != world:
        raise ConfigError(
            f"The learner is asked for {learners} devices but runs as {world} process(es): one "
            f"process per learner device. Launch with `torchrun --nproc_per_node {learners} -m grpo "
            "train ...` (or leave train_model.num_devices at 1)."
        )
    fsdp_degree = d.ici_fsdp_parallelism
    if fsdp_degree not in (-1, 1) and (d.strategy != "fsdp2" or fsdp_degree != world):
        raise ConfigError(
            f"ici_fsdp_parallelism={fsdp_degree} means FSDP over that many learner processes: "
            f"set distributed.strategy=fsdp2 and launch `torchrun --nproc_per_node {fsdp_degree} "
            f"-m grpo train ...` (now {world} process(es), strategy {d.strategy})."
        )
    if d.ref_devices not in (1, learners):
        raise ConfigError(
            f"ref_model.num_devices={d.ref_devices}: each learner process keeps one reference "
            f"replica, so use 1 or the learner's device count ({learners})."
        )
    if d.ref_device_ids is not None and len(d.ref_device_ids) != learners:
        raise ConfigError(
            f"ref_model.devices {d.ref_device_ids}: give one device per learner process ({learners})."
        )
    if not (d.ref_device in ("auto", "cpu", "offload") or d.ref_device.startswith("cuda")):
        raise ConfigError(f"distributed.ref_device={d.ref_device!r}: use auto, cpu, offload or cuda:N.")
    if d.max_staleness < 0 or d.importance_cap < 1 or d.timeout_s <= 0 or d.max_actor_restarts < 0:
        raise ConfigError(
            "max_staleness and max_actor_restarts must be >= 0, importance_cap >= 1 and timeout_s > 0."
        )
    if d.rollout_mode != "colocated":
        # Weights reach the actors every weight_sync_steps steps, so a batch requested just before a push
        # is sampled with weights up to weight_sync_steps old (async adds one step in flight).
        worst = d.weight_sync_steps - (1 if d.rollout_mode == "sync" else 0)
        if d.max_staleness < worst:
            raise ConfigError(
                f"rollout.mode={d.rollout_mode} with weight_sync_steps={d.weight_sync_steps} samples "
                f"with weights up to {worst} step(s) old, but max_staleness={d.max_staleness}: every "
                f"such batch would be dropped. Raise max_staleness to {worst} or lower "
                "weight_sync_steps."
            )
        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                f"rollout.mode={d.rollout_mode} runs rollout workers on Ray, which is not installed: "
                "pip install 'grpo[ray]'."
            )
    if lora.enabled:
        if lora.r < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
            raise ConfigError(
                f"LoRA needs r >= 1, alpha > 0 and 0 <= dropout < 1; got r={lora.r}, "
                f"alpha={lora.alpha}, dropout={lora.dropout}."
            )
        if importlib.util.find_spec("peft") is None:
            raise ConfigError("lora.enabled needs peft: pip install 'grpo[lora]'.")


def plan_roles(cfg: GRPOConfig, num_gpus: int, world_size: int = 1, local_rank: int = 0) -> RolePlan:
    """Place the roles on this machine's `num_gpus` GPUs (0 = CPU only), or say why they do not fit."""
    d = cfg.distributed
    ray_rollout = d.rollout_mode != "colocated"
    if num_gpus == 0:
        if any(
            ids for ids in (d.train_device_ids, d.ref_device_ids, d.inference_device_ids)
        ) or d.ref_device.startswith("cuda"):
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

    all_ids = list(range(num_gpus))
    fractions = (d.trainer_devices_fraction, d.sampler_devices_fraction) != (1.0, 1.0)
    if d.train_device_ids is not None:
        learner_ids = list(d.train_device_ids)
    elif fractions:
        learner_ids = all_ids[: max(1, int(num_gpus * d.trainer_devices_fraction))]
    else:
        learner_ids = all_ids[:world_size]
    if len(learner_ids) < world_size:
        raise ConfigError(
            f"{world_size} learner processes but only {len(learner_ids)} learner GPU(s) "
            f"({learner_ids}) of {num_gpus} visible; launch fewer processes or give more devices."
        )
    learner_ids = learner_ids[:world_size]

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

    rollout_devices: list[list[int]] = []
    replicas, per_replica = 1, 0
    if ray_rollout:
        if d.inference_device_ids is not None:
            rollout_devices = [[i] for i in d.inference_device_ids]
        elif fractions:
            first = num_gpus - max(1, int(num_gpus * d.sampler_devices_fraction))
            rollout_devices = [[i] for i in all_ids[first:]]
        else:
            free = [i for i in all_ids if i not in used]
            wanted = max(d.inference_replicas, d.inference_devices)
            rollout_devices = [[i] for i in free[:wanted]]
            if len(rollout_devices) < wanted:
                raise ConfigError(
                    f"Rollout wants {wanted} GPU(s) of its own, but of {num_gpus} visible GPUs "
                    f"{sorted(used)} are taken by the learner/reference, leaving "
                    f"{len(free)}. Lower inference_replicas / inference_model.num_devices, "
                    "use fewer learner processes, or rollout.mode=colocated."
                )
        replicas, per_replica = len(rollout_devices), 1
    taken = sorted(used)
    bad = [i for i in taken + [i for r in rollout_devices for i in r] if i >= num_gpus]
    if bad:
        raise ConfigError(
            f"GPU ids {sorted(set(bad))} do not exist: {num_gpus} GPU(s) are visible (0..{num_gpus - 1})."
        )
    overlap = sorted(set(learner_ids) & {i for r in rollout_devices for i in r})
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
        rollout_replicas=replicas,
        rollout_gpus_per_replica=per_replica,
        rollout_devices=rollout_devices,
    )


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
    """Plan the roles on this machine and point this process's CUDA device at its learner GPU."""
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
        cfg.distributed.ray_address = "auto"  # the cluster `ray start --head` made here, shared by every rank
    if rank == 0:
        import logging

        logging.getLogger("grpo").info("Device roles: %s", plan.describe())
    return plan
