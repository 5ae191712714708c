"""Loading policy, reference and tokenizer: one path for hub ids, local directories and the bundled model.

Everything goes through `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`,
so a hub id, a local checkpoint and the bundled tiny model behave the same. Weights load only from
safetensors, and repository code runs only with `trust_remote_code`.
"""

from __future__ import annotations

import contextlib
import logging
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import BUNDLED_MODEL, BUNDLED_MODELS, ConfigError, GRPOConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bundled_model_path(name: str = BUNDLED_MODEL) -> str:
    return str(resources.files("grpo.assets").joinpath(name))


def resolve_path(name_or_path: str) -> str:
    """A bundled model's name → its directory; anything else unchanged (a hub id or a path)."""
    if name_or_path in BUNDLED_MODELS:
        return bundled_model_path(name_or_path)
    looks_local = name_or_path.startswith((".", "/", "~")) or Path(name_or_path).exists()
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise ConfigError(
            f"Model path {name_or_path} does not exist or is not a directory. Pass a hub id "
            f"(org/name), a directory saved with save_pretrained, or '{BUNDLED_MODEL}'."
        )
    return str(Path(name_or_path).expanduser()) if looks_local else name_or_path


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={spec} but CUDA is not available here; use device=cpu or auto.")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """The compute dtype `model.dtype` names. Trainable weights (masters) stay float32 whatever it is."""
    if spec == "auto":
        # bf16 matmuls are ~100x slower than fp32 on many CPUs; on GPUs bf16 halves memory at no cost.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[spec]


def autocast(device: torch.device, compute_dtype: torch.dtype | None):
    """Mixed precision for a transformers forward: float32 parameters, matmuls in compute_dtype
    (PyTorch AMP); a no-op for float32 or None."""
    if compute_dtype in (None, torch.float32):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


def hub_kwargs(cfg: GRPOConfig) -> dict:
    return {
        "revision": cfg.model.revision,
        "token": cfg.hf_token(),
        "trust_remote_code": cfg.model.trust_remote_code,
    }


def load_tokenizer(cfg: GRPOConfig):
    path = resolve_path(cfg.model.tokenizer_path or cfg.model.name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path, **hub_kwargs(cfg))
    except (OSError, ValueError) as e:
        raise ConfigError(f"Could not load a tokenizer from '{path}': {_why(e)}") from e
    return prepare_tokenizer(tok)


def _why(e: Exception) -> str:
    if "trust_remote_code" in str(e):
        return (
            "the repository needs its own Python code to load; set model.trust_remote_code=true only if "
            "you trust that code."
        )
    return str(e)


def prepare_tokenizer(tok):
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(
                "The tokenizer has neither a pad nor an eos token; add one "
                "(tokenizer.add_special_tokens({'pad_token': ...})) and save it."
            )
        # Completion masks come from eos positions, so reusing eos as pad is safe here.
        tok.pad_token = tok.eos_token
        log.warning(
            "The tokenizer has no pad token; padding with its eos token %r (safe: completions end at "
            "the first eos, and padding is masked).",
            tok.eos_token,
        )
    tok.padding_side = "left"
    return tok


def load_causal_lm(name_or_path: str, cfg: GRPOConfig, device: torch.device, trainable: bool):
    """A trainable model loads in float32 (its master weights); a frozen one (reference, reward model)
    in the compute dtype, since it is never stepped."""
    path = resolve_path(name_or_path)
    dtype = torch.float32 if trainable else resolve_dtype(cfg.model.dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, **hub_kwargs(cfg)
        )
    except (OSError, ValueError) as e:
        raise ConfigError(f"Could not load a causal LM from '{path}': {_why(e)}") from e
    model.to(device)
    if trainable:
        model.train()
        if cfg.model.gradient_checkpointing:
            # transformers 5 renamed it (the old name warns FutureWarning on every run); older ones lack it
            new_name = getattr(model, "activation_checkpointing_enable", None)
            (new_name or model.gradient_checkpointing_enable)()
            model.config.use_cache = False
    else:
        model.eval().requires_grad_(False)
    return model


def load_policy(cfg: GRPOConfig, device: torch.device):
    return load_causal_lm(
        cfg.model.load_parameters_path or cfg.model.name_or_path, cfg, device, trainable=True
    )


def load_reference(cfg: GRPOConfig, device: torch.device):
    path = cfg.model.ref_model_path or cfg.model.load_parameters_path or cfg.model.name_or_path
    return load_causal_lm(path, cfg, device, trainable=False)


def float32_masters(model):
    """The trainable floating-point parameters in float32: AdamW on bf16/fp16 parameters rounds away any
    update below half an ulp (2^-9 relative in bf16), e.g. most updates at lr 1e-6."""
    low = [
        p
        for p in model.parameters()
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32
    ]
    if low:
        log.info(
            "Trainable parameters given in %s: upcasting them to float32 master weights (compute still "
            "runs in model.dtype).",
            low[0].dtype,
        )
        for p in low:
            p.data = p.data.float()
    return model


def precision_summary(
    compute: torch.dtype, ref_dtype: torch.dtype | None, save_dtype: str, sharded: bool = False
) -> str:
    """The start-up line naming where each precision applies (docs/algorithm.md, Precision)."""
    name = str(compute).removeprefix("torch.")
    if compute == torch.float32:
        how = "float32 throughout"
    else:
        via = "FSDP2 MixedPrecisionPolicy" if sharded else "autocast / native decoder casts"
        how = (
            f"float32 master weights and AdamW state, {name} compute ({via}, gradients reduced in float32)"
            + ("; dynamic loss scaling (GradScaler)" if compute == torch.float16 else "")
        )
    ref = "no reference" if ref_dtype is None else "reference in " + str(ref_dtype).removeprefix("torch.")
    return (
        f"Precision: {how}; rollout samples in {name}; {ref}; checkpoints float32, final_model {save_dtype}."
    )
