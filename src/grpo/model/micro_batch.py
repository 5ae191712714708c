"""How a step's completions are split into micro-batches: by row count when the user says so, else by a
token budget derived from the memory set aside for activations.

Why tokens: a micro-batch's activation memory is (tokens it runs) × (bytes the model saves per token for
backward), and with eos-ended completions the tokens of a fixed row count vary 4-10× between steps
(16 rows of 128-token limits: ~600 tokens when most rows stop early, ~2,200 when none do). A row count
that fits the long steps wastes GEMM size on the short ones; one that suits the short ones runs out of
memory on the long ones. So rows are added to a micro-batch until the next would pass the budget (a
longer row runs alone). The loss is normalised globally (`algorithm.loss.LossNorm`), so where the cuts
fall changes memory and speed, never the update.

The budget in tokens is `activation_memory_gb` / `activation_bytes_per_token` (an estimate from the
model's config, checked against the tensors autograd really saves in tests/unit/test_micro_batch.py).
On a CPU it is also capped at CPU_SPEED_TOKENS, where the matrix's training passes ran fastest.
"""

from __future__ import annotations

import torch

from grpo.records import TrainBatch

# CPU forward+backward time per row, 16-row units of 192-token rows on the 4.9M benchmark model (AVX2
# EPYC, 2 threads): 1,088 tokens per micro-batch 734 ms, 2,176: 667, 4,352: 650, 8,704: 703. Past ~4k
# tokens the activations leave the caches; below ~2k the GEMMs are too thin.
CPU_SPEED_TOKENS = 4096
MIN_BUDGET_TOKENS = 256  # below this, per-call overhead dominates whatever the memory says


def activation_bytes_per_token(config, element_bytes: int, native: bool, checkpointing: bool) -> int:
    """Bytes autograd keeps per token for backward, all layers: what one more token in a micro-batch costs.

    Per layer, saved for backward: the residual input, both RMSNorm outputs, the attention output and
    its projection's input (5·d); q/k/v and the rotated q/k (2·q + 3·kv), and in the native forward also
    the completion-padded q, keys and values and the attention's padded output (3·q + 2·kv more); the MLP
    keeps gate and up when the native forward recomputes silu(gate)·up (model/linear.py), and also
    silu(gate) and the product in the transformers forward (2 or 4 × ffn). After the layers: the final
    norm's input and output (2·d). With gradient checkpointing only each layer's input stays (d per
    layer) plus one layer's full set while it is recomputed. tests/unit/test_micro_batch.py checks the
    sum against what autograd saves."""
    d = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    ffn = getattr(config, "intermediate_size", 4 * d)
    cq, ckv, cffn = (5, 5, 2) if native else (2, 3, 4)
    per_layer = 5 * d + cq * q + ckv * kv + cffn * ffn
    layers = config.num_hidden_layers
    if checkpointing:
        return element_bytes * (layers * d + per_layer + 2 * d)
    return element_bytes * (layers * per_layer + 2 * d)


def default_activation_budget(device: torch.device) -> int:
    """Bytes for one micro-batch's activations when `train.activation_memory_gb` is unset.

    CUDA: a third of the memory free now (after the policy and reference are loaded; AdamW's state and
    the rollout engine's cache come later and need the rest). CPU: 512 MiB. A CPU host's memory is
    shared with everything else on it, and more tokens per micro-batch buy a CPU little speed: Qwen2.5-
    0.5B's 10.8 GiB peak (docs/performance.md, "Real sizes") was measured with 4 rows of 64 tokens per
    micro-batch, ~0.5 GiB of activations, and 512 MiB keeps it there (288 tokens at its 1.86 MB per
    token); small models reach the CPU_SPEED_TOKENS cap first (the 4.9M benchmark model: 82 KB)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 3
    return 512 << 20


def budget_tokens(budget_bytes: int, bytes_per_token: int, device: torch.device) -> int:
    tokens = max(MIN_BUDGET_TOKENS, budget_bytes // max(bytes_per_token, 1))
    return min(tokens, CPU_SPEED_TOKENS) if device.type == "cpu" else tokens


def row_costs(batch: TrainBatch, shared_prompts: bool) -> list[int]:
    """Tokens each row adds to a micro-batch, in row order. With `shared_prompts` (the native forward runs
    each distinct prompt once) a row's prompt counts only where its group starts; otherwise every row
    counts its whole real length (the transformers forward pads to the longest, which `trim` bounds)."""
    width = batch.prompt_width
    completion = batch.completion_mask.sum(-1).long().tolist()
    prompt = batch.attention_mask[:, :width].sum(-1).long().tolist()
    groups = batch.group_ids.tolist()
    costs = []
    for i, (c, p) in enumerate(zip(completion, prompt, strict=True)):
        new_group = i == 0 or groups[i] != groups[i - 1]
        costs.append(c + (p if new_group or not shared_prompts else 0))
    return costs


def cut_by_tokens(costs: list[int], max_tokens: int) -> list[slice]:
    """Contiguous slices, each as many rows as fit in max_tokens (at least one row)."""
    out, start, total = [], 0, 0
    for i, c in enumerate(costs):
        if i > start and total + c > max_tokens:
            out.append(slice(start, i))
            start, total = i, 0
        total += c
    if costs:
        out.append(slice(start, len(costs)))
    return out


def cut_into(costs: list[int], parts: int) -> list[slice]:
    """Exactly `parts` contiguous slices (fewer only when there are fewer rows) of about equal tokens.

    Several processes must run the same number of forward/backward passes (FSDP2 gathers parameters in
    each one, a collective), so every rank cuts its rows into the largest count any rank needs."""
    n = len(costs)
    parts = min(parts, n)
    if parts <= 1:
        return [slice(0, n)] if n else []
    total = sum(costs)
    out, start, acc = [], 0, 0
    for k in range(1, parts):
        target = total * k / parts
        end = start + 1
        acc += costs[start]
        # Leave at least one row for each slice still to come.
        while end < n - (parts - k) and acc + costs[end] / 2 <= target:
            acc += costs[end]
            end += 1
        out.append(slice(start, end))
        start = end
    out.append(slice(start, n))
    return out
