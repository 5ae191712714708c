"""The learner's process group: who this process is, how gradients are shared, what rank 0 does alone.

One `Runtime` per process. Launched plainly (`grpo train`) it is a single process and every method is
the identity or a no-op, so the loop in train.py reads the same either way. Under torchrun
(`torchrun --nproc_per_node N -m grpo train ...`) it joins the process group and

* shards each step's prompts across ranks, whole prompts only, so a group never straddles ranks;
* wraps the policy in DDP or FSDP2 (`fully_shard`), `distributed.strategy`;
* turns per-rank counts into global ones (loss normalisers, metrics) with all-reduces;
* gathers full (unsharded) state dicts so rank 0 alone writes Hugging Face checkpoints.

Every collective carries `distributed.timeout_s`: a rank that dies turns into an error on the others,
never a silent hang.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("grpo")


@dataclass
class Runtime:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "ddp"  # how gradients are shared when world_size > 1
    timeout_s: float = 600.0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """FSDP2: no rank holds the full weights, so rollout needs its own copy and saving a gather."""
        return self.active and self.strategy == "fsdp2"

    # -- data ------------------------------------------------------------------------------------
    def shard(self, indices: list[int], rows: list[dict]) -> tuple[list[int], list[dict]]:
        """This rank's contiguous slice of the step's prompts (each prompt = one whole group).

        Every rank must hold the same number of prompts (FSDP2 and DDP run one collective per
        micro-batch), so a step whose prompt count world_size does not divide drops the remainder.
        """
        if not self.active:
            return indices, rows
        per_rank = len(indices) // self.world_size
        if per_rank == 0:
            raise RuntimeError(
                f"This step has {len(indices)} prompt(s) for {self.world_size} processes; each "
                "process needs at least one. Raise train.prompts_per_step."
            )
        left_out = len(indices) - per_rank * self.world_size
        if left_out and self.is_main:
            log.warning(
                "%d prompt(s) of this step left out: %d prompts do not split evenly over %d processes "
                "(the last batch of an epoch can be short).",
                left_out,
                len(indices),
                self.world_size,
            )
        take = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        return indices[take], rows[take]

    # -- reductions ------------------------------------------------------------------------------
    def sum(self, value: float) -> float:
        if not self.active:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a CPU float tensor (returns it)."""
        if self.active:
            dist.all_reduce(t)
        return t

    def any(self, flag: bool) -> bool:
        return self.sum(1.0 if flag else 0.0) > 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place "sum", "max" or "min" over ranks of a CPU tensor (returns it)."""
        if self.active:
            dist.all_reduce(
                t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            )
        return t

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (tensors allowed), on every rank."""
        if not self.active:
            return [obj]
        # Tensors inside all_gather_object's pickles do not survive the trip here; torch.save's bytes do.
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        out = [None] * self.world_size
        dist.all_gather_object(out, buffer.getvalue())
        return [torch.load(io.BytesIO(b), weights_only=True) for b in out]

    # -- gradients -------------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, param_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The module the learner calls forward on: DDP around the policy, or the policy itself after
        `fully_shard` (FSDP2 shards in place: each decoder layer, then the root). FSDP2 keeps float32
        shards (masters and AdamW state), all-gathers them in `param_dtype` for compute and
        reduce-scatters gradients in float32; DDP's forward runs under the learner's autocast."""
        if not self.active:
            if self.strategy == "fsdp2":  # the config says FSDP2; say plainly that one process shards nothing
                log.info(
                    "distributed.strategy=fsdp2 in one process: nothing is sharded, the model trains whole "
                    "on one device (shard it with torchrun --nproc_per_node N)."
                )
            return model
        if self.strategy == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = (
                MixedPrecisionPolicy()
                if param_dtype == torch.float32
                else MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
            )
            layers = decoder_layers(model)
            for layer in layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            log.info(
                "FSDP2: %d decoder layers and the root (embeddings, norm, head) sharded over %d processes.",
                len(layers),
                self.world_size,
            )
            return model
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def set_grad_sync(self, model: torch.nn.Module, enabled: bool) -> None:
        """Call before a micro-batch's forward: gradients are all-reduced only when `enabled` (the last
        micro-batch of an optimizer step); earlier ones accumulate locally. This is what DDP's
        no_sync() toggles, set directly so the forward and backward need not share one `with`."""
        if not self.active:
            return
        if self.strategy == "fsdp2":
            model.set_requires_gradient_sync(enabled)
        else:
            model.require_backward_grad_sync = enabled

    @property
    def loss_scale(self) -> float:
        """DDP and FSDP2 average gradients over ranks; each rank's loss is its *additive* share of the
        global loss, so scaling by world_size turns their average into the sum we want."""
        return float(self.world_size)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor
            norm = norm.full_tensor()
        return float(norm)

    # -- full state (checkpoints, rollout weight sync) -------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Unsharded CPU state dict; under FSDP2 every rank must call it and only rank 0 gets tensors."""
        if not self.sharded:
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        # A tied weight (lm_head = embeddings) is one parameter under two names; keep the first name
        # only, as save_pretrained does for an unsharded model.
        canonical = {n for n, _ in model.named_parameters()}
        return {
            k: v
            for k, v in state.items()
            if k in canonical or k not in dict(model.named_parameters(remove_duplicate=False))
        }

    def full_named_parameters(
        self, model: torch.nn.Module, only: str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per parameter, in the same order on every rank; `only` filters names
        (LoRA syncs only adapter weights). Under FSDP2 each yields one all-gather."""
        for name, p in model.named_parameters():
            if only is not None and only not in name:
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full.detach()

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if not self.active:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        if not self.active:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
        )

    def load_full_state_dict(
        self, model: torch.nn.Module, state: dict[str, torch.Tensor], partial: bool = False
    ) -> None:
        """Every rank passes the full dict (read from disk); FSDP2 keeps only its shards. `partial`: the
        dict holds only some weights (LoRA adapters), so only unexpected keys are an error."""
        if not self.sharded:
            missing, unexpected = model.load_state_dict(state, strict=False)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            missing, unexpected = set_model_state_dict(
                model, state, options=StateDictOptions(full_state_dict=True, strict=False)
            )
        # lm_head may be tied to the embeddings and absent from the file.
        if unexpected or (not partial and [k for k in missing if "lm_head" not in k]):
            raise RuntimeError(
                f"Checkpoint does not match the model: missing {list(missing)[:5]}, "
                f"unexpected {list(unexpected)[:5]}."
            )

    # -- per-rank RNG --------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        """Same data order on every rank, different sampling noise (ranks hold different prompts)."""
        torch.manual_seed(seed + self.rank)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks, FSDP2's natural shard units (any HF decoder-only model)."""
    for name in ("layers", "h", "blocks"):
        for module in model.modules():
            layers = getattr(module, name, None)
            if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
                return list(layers)
    return []


def init_runtime(strategy: str = "ddp", backend: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """Join torchrun's process group when launched by it (WORLD_SIZE > 1); else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Runtime(strategy=strategy, timeout_s=timeout_s)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)  # so device "cuda" means this rank's GPU everywhere
    if not dist.is_initialized():
        chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        dist.init_process_group(chosen, timeout=timedelta(seconds=timeout_s))
    rt = Runtime(rank=rank, world_size=world, local_rank=local_rank, strategy=strategy, timeout_s=timeout_s)
    if rt.is_main:
        log.info(
            "Process group: %d processes (%s), gradients by %s, timeout %.0fs.",
            world,
            dist.get_backend(),
            strategy.upper(),
            timeout_s,
        )
    return rt
