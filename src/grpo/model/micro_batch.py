"""How a step's completions are split into micro-batches: always by a token budget derived from the memory
set aside for activations, and also by row count when the user's row knobs (`micro_batch_size`,
`gradient_accumulation_steps`) ask for smaller ones. A row count alone does not bound memory: 64 rows of
4k-token completions are 256k tokens, an out-of-memory error on a GPU, while 64 rows of 30 tokens fit
anywhere.

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

# CPU: the base matrix cell's update (64 rows, 64-token prompts, completions of 1-128 tokens, mean 30) and
# its eos-off twin (every row 128 tokens), learner.train_step, 4.9M benchmark model, AVX2 EPYC, 2 threads,
# medians of 7: 2,048 padded tokens per micro-batch 0.98 / 2.66 s, 3,072: 0.99 / 3.16 s, 16 rows:
# 0.95 / 2.99 s; one micro-batch of all 64 ragged rows 1.29 s. Past ~2k tokens the activations leave the
# caches; much below it the GEMMs get thin.
CPU_SPEED_TOKENS = 2048
MIN_BUDGET_TOKENS = 256  # below this, per-call overhead dominates whatever the memory says
# For a model whose config gives no layer sizes to estimate from: the CPU cap, modest on a GPU too.
FALLBACK_TOKENS = CPU_SPEED_TOKENS


def activation_bytes_per_token(
    config, element_bytes: int, native: bool, checkpointing: bool, fused_norms: bool = False
) -> int:
    """Bytes autograd keeps per token for backward, all layers: what one more token in a micro-batch costs.

    Per layer, saved for backward: the residual input, both RMSNorm outputs, the attention output and
    its projection's input (5·d); q/k/v and the rotated q/k (2·q + 3·kv), and in the native forward also
    the completion-padded q, keys and values and the attention's padded output (3·q + 2·kv more); the MLP
    keeps gate and up when the native forward recomputes silu(gate)·up (model/linear.py), and also
    silu(gate) and the product in the transformers forward (2 or 4 × ffn). After the layers: the final
    norm's input and output (2·d). With gradient checkpointing only each layer's input stays (d per
    layer) plus one layer's full set while it is recomputed. fused_norms: the native forward's RMSNorms
    are grpo's CPU op (grpo/kernels), which keeps its input and one float a row, not the normalised copy
    too (3·d a layer instead of 5·d, d after the layers instead of 2·d). tests/unit/test_micro_batch.py
    checks the sum against what autograd saves."""
    d = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    ffn = getattr(config, "intermediate_size", 4 * d)
    cq, ckv, cffn = (5, 5, 2) if native else (2, 3, 4)
    norms = native and fused_norms
    per_layer = (3 if norms else 5) * d + cq * q + ckv * kv + cffn * ffn
    after = (1 if norms else 2) * d
    layers = config.num_hidden_layers
    if checkpointing:
        return element_bytes * (layers * d + per_layer + after)
    return element_bytes * (layers * per_layer + after)


def default_activation_budget(device: torch.device, gradient_bytes: int = 0) -> int:
    """Bytes for one micro-batch's activations when `train.activation_memory_gb` is unset.

    CUDA: a third of the memory free now (after the policy and reference are loaded; AdamW's state and
    the rollout engine's cache come later and need the rest). CPU: 512 MiB, or twice the trainable
    parameters' gradient if that is more. A CPU host's memory is shared with everything else on it. The
    floor: once a step runs in several micro-batches, the accumulated gradient is resident through every
    later one, so the peak is gradient + one micro-batch; in one micro-batch it is the larger of the
    step's activations and the gradient (backward frees the first as it fills the second). Splitting
    activations under about twice the gradient lowers no peak and slows the update. Measured on
    Qwen2.5-0.5B (2 GB of gradient; 4 × 4 completions of 64 tokens, 2 steps): micro-batches of 288
    tokens peaked at 11.25 GiB with 78 s updates, one micro-batch at 10.77 GiB with 55-59 s. Full
    fine-tuning of small models reaches the CPU_SPEED_TOKENS cap first; LoRA (a tiny gradient) keeps
    512 MiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 3
    return max(512 << 20, 2 * gradient_bytes)


def budget_tokens(budget_bytes: int, bytes_per_token: int, device: torch.device) -> int:
    tokens = max(MIN_BUDGET_TOKENS, budget_bytes // max(bytes_per_token, 1))
    return min(tokens, CPU_SPEED_TOKENS) if device.type == "cpu" else tokens


class PaddedCost:
    """Tokens a forward over a micro-batch of a TrainBatch's rows really processes, padding included.

    The native forward (`shared_prompts`) runs each distinct prompt once and lays the completions out
    as a [rows, longest completion] grid for attention, so one long row makes every row of its
    micro-batch cost the long row's length there (measured: the base cell's 64 ragged rows, lengths
    1-128, mean 30, took 1.29 s as one micro-batch and 0.85 s as four of 16). The transformers forward
    pads every row to prompt width + the longest completion."""

    def __init__(self, batch: TrainBatch, shared_prompts: bool):
        self.width = batch.prompt_width
        self.completion = batch.completion_mask.sum(-1).long().tolist()
        self.prompt = batch.attention_mask[:, : self.width].sum(-1).long().tolist()
        self.groups = batch.group_ids.tolist()
        self.shared = shared_prompts

    def __len__(self) -> int:
        return len(self.completion)

    def of(self, rows: range) -> int:
        longest = max(self.completion[i] for i in rows)
        if not self.shared:
            return len(rows) * (self.width + longest)
        prompts = {self.groups[i]: self.prompt[i] for i in rows}
        return sum(prompts.values()) + len(rows) * longest

    def rows(self) -> list[int]:
        """Each row's own tokens (its prompt where its group starts): the weights `cut_into` balances."""
        return [
            c + (p if i == 0 or g != self.groups[i - 1] or not self.shared else 0)
            for i, (c, p, g) in enumerate(zip(self.completion, self.prompt, self.groups, strict=True))
        ]


def plan_micro_batches(cost: PaddedCost, max_tokens: int, max_rows: int | None = None) -> list[slice]:
    """The row slices that run as one forward/backward each: chunks of at most `max_rows` rows (the user's
    row knobs; None: no row limit), each cut further to at most `max_tokens` by `cost`. Only a single row
    longer than the budget can pass it, alone."""
    n = len(cost)
    step = max_rows or max(n, 1)
    return [
        piece
        for start in range(0, n, step)
        for piece in cut_by_tokens(cost, max_tokens, range(start, min(start + step, n)))
    ]


def split_to(slices: list[slice], cost: PaddedCost, parts: int) -> list[slice]:
    """`slices` split further until there are `parts` of them (fewer only once every slice is one row).

    Several processes must run the same number of forward/backward passes (FSDP2 gathers parameters in
    each one, a collective), so every rank cuts into the largest count any rank needs. Each split halves
    the costliest slice by tokens, so no slice passes a row or token limit the input slices kept."""
    out = list(slices)
    weights = cost.rows()
    while len(out) < parts:
        splittable = [i for i, s in enumerate(out) if s.stop - s.start > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: cost.of(range(out[i].start, out[i].stop)))
        s = out[i]
        first, _ = cut_into(weights[s], 2)
        out[i : i + 1] = [slice(s.start, s.start + first.stop), slice(s.start + first.stop, s.stop)]
    return out


def cut_by_tokens(cost: PaddedCost, max_tokens: int, within: range | None = None) -> list[slice]:
    """Contiguous slices of the rows `within` (default: all), at most max_tokens each by `cost`, cut
    between groups where possible.

    A group split over two micro-batches runs its shared prompt twice, so whole groups are added while
    they fit; a group that does not fit alone is cut by rows (a row longer than the budget runs alone)."""
    within = range(len(cost)) if within is None else within
    groups, start = [], within.start
    for i in range(within.start + 1, within.stop + 1):
        if i == within.stop or cost.groups[i] != cost.groups[i - 1]:
            groups.append(range(start, i))
            start = i
    out: list[slice] = []
    current: range | None = None
    for group in groups:
        if current is not None and cost.of(range(current.start, group.stop)) <= max_tokens:
            current = range(current.start, group.stop)
            continue
        if current is not None:
            out.append(slice(current.start, current.stop))
        current = group
        if cost.of(group) > max_tokens:  # too big alone: cut inside it, row by row
            first = group.start
            for i in range(group.start + 1, group.stop):
                if cost.of(range(first, i + 1)) > max_tokens:
                    out.append(slice(first, i))
                    first = i
            current = range(first, group.stop)
    if current is not None:
        out.append(slice(current.start, current.stop))
    return out


def cut_into(costs: list[int], parts: int) -> list[slice]:
    """Exactly `parts` contiguous slices (fewer only when there are fewer rows) of about equal tokens."""
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
