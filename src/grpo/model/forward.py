"""The training forward: per-token log-probs (and entropy) of a TrainBatch's completion tokens.

Two implementations compute the same [N, T] numbers:

- `token_logprobs`: the model's own transformers forward. It works for every model, wrapped or not
  (DDP/FSDP2, peft), and is the one whose entropy carries a gradient (for the entropy bonus).
- `shared_prompt_logprobs` (model/packed.py): the native decoder, each distinct prompt run once, no pad
  work, chunked LM head. Faster, for the unwrapped architectures `unsupported_reason` accepts.

`PolicyForward` picks one of them once, when it is built, and says which (`kind`).
"""

from __future__ import annotations

import torch

from grpo.model.decoder import NativeDecoder, unsupported_reason
from grpo.model.loading import autocast
from grpo.model.lora import ReferenceWithoutAdapters, has_adapters, lora_base
from grpo.model.packed import ChunkedTokenLogprobs, plain_lm_head, shared_prompt_logprobs
from grpo.records import TrainBatch

__all__ = ["PolicyForward", "token_logprobs"]


def chunkable_head(model, compute_dtype: torch.dtype | None, entropy_grad: bool):
    """The LM head `token_logprobs` runs in row chunks, or None where it takes the model's own
    full-logits forward: a differentiable entropy, or mixed precision (the head's backward would mix
    dtypes; the model's own forward handles that case)."""
    if entropy_grad or compute_dtype not in (None, torch.float32):
        return None
    return plain_lm_head(model)


def token_logprobs(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """log π(completion token | prefix) for every completion position: [N, T] (and entropy [N, T],
    differentiable when `entropy_grad`, for the entropy bonus).

    A plain Hugging Face model, with or without LoRA adapters, runs its decoder here and its LM head in
    row chunks (`ChunkedTokenLogprobs`, logits recomputed chunk by chunk in backward), so no
    [N, T, vocab] tensor exists: 0.6 GB per copy for 16 × 64 tokens of a 151,936-token vocabulary.
    Wrapped models (DDP/FSDP2), heads that rescale their logits or carry an adapter, autocast, and the
    entropy bonus's differentiable entropy take the model's own full-logits forward."""
    if isinstance(model, ReferenceWithoutAdapters):  # π_ref of a LoRA policy: the same modules, adapters off
        with model.adapters_off():
            return token_logprobs(
                model.peft_model, batch, temperature, with_entropy, entropy_grad, compute_dtype
            )
    width = batch.prompt_width
    num_completion = batch.input_ids.shape[1] - width
    device = next(model.parameters()).device
    inputs = {
        "input_ids": batch.input_ids.to(device),
        "attention_mask": batch.attention_mask.to(device),
        "position_ids": batch.position_ids.to(device),
        "use_cache": False,
    }
    targets = batch.input_ids[:, width:].to(device)  # [N, T]
    head = (
        None if torch.is_autocast_enabled(device.type) else chunkable_head(model, compute_dtype, entropy_grad)
    )
    if head is not None:
        hidden = lora_base(model).get_decoder()(**inputs).last_hidden_state[:, width - 1 : -1]  # [N, T, d]
        n, d = hidden.shape[0], hidden.shape[-1]
        logp, entropy = ChunkedTokenLogprobs.apply(
            hidden.reshape(n * num_completion, d), head.weight, targets.reshape(-1), temperature, with_entropy
        )  # [N·T]
        shape = (n, num_completion)
        return logp.view(shape), (entropy.view(shape) if with_entropy else None)
    with autocast(device, compute_dtype):
        # The LM head runs only where completion tokens are predicted.
        out = model(**inputs, logits_to_keep=num_completion + 1)
    logits = out.logits[:, :-1].float() / temperature  # [N, T, V]
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, T, V]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [N, T]
    if not (with_entropy or entropy_grad):
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, T]
    return logp, entropy


class PolicyForward:
    """`forward(batch, temperature, with_entropy=False) -> (logp [N, T], entropy [N, T] | None)` for one
    model, through the forward chosen here once:

    - native: asked for (`native`), the architecture supported, and no differentiable entropy needed;
    - transformers otherwise, in `compute_dtype` (None: the weights' dtype). `entropy_grad` (the entropy
      bonus) makes its entropy differentiable, which only this forward provides.
    """

    def __init__(
        self,
        model,
        *,
        native: bool,
        compute_dtype: torch.dtype | None = None,
        gradient_checkpointing: bool = False,
        entropy_grad: bool = False,
        compile_blocks: bool = False,
    ):
        self.model, self.compute_dtype, self.entropy_grad = model, compute_dtype, entropy_grad
        self.decoder = None
        # LoRA trains through peft's forward (x Wᵀ + s (x Aᵀ) Bᵀ): the native forward would fold each adapter
        # into a merged [out, in] weight that autograd keeps for backward, a copy of every adapted weight.
        if native and not entropy_grad and not has_adapters(model) and unsupported_reason(model) is None:
            self.decoder = NativeDecoder(model, compute_dtype)
            self.decoder.gradient_checkpointing = gradient_checkpointing
            self.decoder.compile_blocks = compile_blocks  # model/compiled.py
            self.decoder.reuse_casts = True  # one cast per optimizer step: call forget_casts() after it
        self.kind = "transformers" if self.decoder is None else "native"
        # The transformers forward makes [tokens, vocab] logits unless its LM head can run in chunks.
        self.full_logits = self.decoder is None and chunkable_head(model, compute_dtype, entropy_grad) is None

    def forget_casts(self) -> None:
        """After an optimizer step: the weights changed, their compute-dtype casts are stale."""
        if self.decoder is not None:
            self.decoder.forget_casts()

    def __call__(self, batch: TrainBatch, temperature: float, with_entropy: bool = False, replay=None):
        """replay: a model/replay.py `Replay` (the native forward only): products from the rollout."""
        if self.decoder is not None:
            return shared_prompt_logprobs(self.decoder, batch, temperature, with_entropy, replay)
        return token_logprobs(
            self.model,
            batch,
            temperature,
            with_entropy,
            entropy_grad=self.entropy_grad,
            compute_dtype=self.compute_dtype,
        )
