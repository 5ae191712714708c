"""Per-token log-probs for training on the native decoder: shared prompts, packed tokens, chunked head.

`shared_prompt_logprobs(decoder, batch, temperature)` is a drop-in for `model.forward.token_logprobs`:
same TrainBatch in, same [N, T] log-probs out, but

- each distinct prompt of the micro-batch runs once and its completions attend to it,
- only real tokens pass through the linear layers (no pad work),
- the LM head and log-softmax run in row chunks inside one autograd function that recomputes each
  chunk's logits in backward, so a [tokens, vocab] logits tensor never exists whole, forward or back.
"""

from __future__ import annotations

import torch

from grpo.model.decoder import NativeDecoder, SharedPromptPack, pack_shared_prompts
from grpo.model.linear import linear
from grpo.model.lora import lora_base
from grpo.model.replay import replayed_hidden
from grpo.records import TrainBatch

CHUNK_ELEMENTS = 1 << 22  # logits elements per chunk on a CPU (16 MB in float32: fits its caches)
# On a GPU a chunk is one launch that re-reads the whole [V, d] head (memory-bound) and, in backward, a
# fresh [V, d] product added into the float32 gradient: at the CPU size a 151,936-token vocabulary gives
# 27-row chunks, ~320 per pass. 2^28 elements (1 GiB in float32, ~1,770 rows there) makes them few.
CUDA_CHUNK_ELEMENTS = 1 << 28


def chunk_rows(vocab_size: int, device: torch.device) -> int:
    """Rows of the LM head's logits computed at once on `device`."""
    elements = CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS
    return max(1, elements // vocab_size)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(h Wᵀ / τ)[target] per row, chunked; optional entropy (no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool):
        # hidden [M, d], weight [V, d], targets [M] → logp [M], entropy [M] (empty unless asked)
        m, v = hidden.shape[0], weight.shape[0]
        chunk = chunk_rows(v, hidden.device)
        logp = hidden.new_empty(m, dtype=torch.float32)
        lse = hidden.new_empty(m, dtype=torch.float32)
        entropy = hidden.new_empty(m if with_entropy else 0, dtype=torch.float32)
        for s in range(0, m, chunk):
            e = min(s + chunk, m)
            logits = linear(hidden[s:e], weight).float() / temperature  # [c, V]
            lse[s:e] = torch.logsumexp(logits, -1)
            logp[s:e] = logits.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
            if with_entropy:
                probs = (logits - lse[s:e, None]).exp()
                entropy[s:e] = lse[s:e] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, hidden.shape[0])
            logits = linear(hidden[s:e], weight).float() / ctx.temperature  # [c, V] recomputed
            # d logp / d logits = onehot(target) − softmax, times the upstream gradient, over τ.
            g = (logits - lse[s:e, None]).exp_().mul_(-grad_logp[s:e, None])  # [c, V]
            g.scatter_add_(-1, targets[s:e, None], grad_logp[s:e, None].float())
            g = g.div_(ctx.temperature).to(hidden.dtype)
            if grad_h is not None:
                grad_h[s:e] = linear(g, weight.t())
            if grad_w is None:
                continue
            if hidden.dtype == grad_w.dtype:  # in place: `gᵀh` first would be a second [V, d] (0.5 GiB here)
                grad_w.addmm_(g.T, hidden[s:e])
            else:  # bf16/fp16 compute: each chunk's product in that dtype, summed in float32
                grad_w.add_(g.T @ hidden[s:e])
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def pack_batch(batch: TrainBatch, device: torch.device) -> SharedPromptPack:
    """TrainBatch rows → SharedPromptPack; rows with identical prompts share one prompt pass."""
    width = batch.prompt_width
    prompt_rows, completions, row_group = {}, [], []
    keep = batch.attention_mask.bool()
    for ids, real in zip(batch.input_ids.tolist(), keep.tolist(), strict=True):
        prompt = tuple(t for t, r in zip(ids[:width], real[:width], strict=True) if r)
        row_group.append(prompt_rows.setdefault(prompt, len(prompt_rows)))
        completions.append([t for t, r in zip(ids[width:], real[width:], strict=True) if r])
    return pack_shared_prompts(
        [list(p) for p in prompt_rows], row_group, completions, batch.input_ids.shape[1] - width, device
    )


def shared_prompt_logprobs(
    decoder: NativeDecoder, batch: TrainBatch, temperature: float, with_entropy: bool = False, replay=None
):
    """log π(completion token | prefix) [N, T] (and entropy [N, T]); zeros on padding, and on tokens the
    policy did not sample (loss_mask 0: tool results, environment messages), whose LM head is skipped.
    replay: a model/replay.py `Replay` whose recording holds this micro-batch's products (μ = 1)."""
    packed = pack_batch(batch, decoder.device)
    index = None if replay is None else replay.index(packed, batch.group_ids)
    if index is not None:
        hidden = replayed_hidden(decoder, packed, replay.recording, index)  # [M, d]
    else:
        hidden = decoder.shared_prompt_hidden(packed)  # [M, d]
    targets, slots = packed.targets, packed.target_slot  # [M], [M]
    if batch.loss_mask is not batch.completion_mask:  # multi-turn: the head runs on sampled tokens only
        sampled = batch.loss_mask.flatten().to(slots.device)[slots] > 0  # [M]
        if not sampled.all():
            keep = sampled.nonzero().squeeze(-1)  # [M']
            hidden, targets, slots = hidden[keep], targets[keep], slots[keep]
    logp, entropy = ChunkedTokenLogprobs.apply(
        hidden, decoder.lm_head_weight, targets, temperature, with_entropy
    )  # [M'], [M']
    shape = (packed.num_rows, packed.completion_width)
    grid = logp.new_zeros(shape[0] * shape[1]).index_copy(0, slots, logp).view(shape)  # [N, T]
    if not with_entropy:
        return grid, None
    return grid, entropy.new_zeros(shape[0] * shape[1]).index_copy(0, slots, entropy).view(shape)


# Config fields under which a model's forward changes its logits after the LM head's product.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
    "mup_width_multiplier",
)


def plain_lm_head(model):
    """The LM head when `model` is an unwrapped transformers causal LM (or one under LoRA adapters whose
    head is not adapted) whose logits are exactly decoder_output @ head.weightᵀ (no bias, no rescaling),
    else None."""
    from transformers import PreTrainedModel

    model = lora_base(model)
    if not isinstance(model, PreTrainedModel) or model.get_decoder() is model:
        return None
    # fully_shard (FSDP2) keeps the class a PreTrainedModel, but its root hooks must run: use its forward.
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return None
    head, cfg = model.get_output_embeddings(), model.config
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in _LOGIT_TRANSFORMS):
        return None
    return head
