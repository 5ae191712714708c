"""Micro-batches cut by a token budget: the cuts, the per-token activation estimate, the budget."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo import kernels
from grpo.config import GRPOConfig
from grpo.learner import Learner
from grpo.model.forward import PolicyForward
from grpo.model.micro_batch import (
    CPU_SPEED_TOKENS,
    MIN_BUDGET_TOKENS,
    PaddedCost,
    activation_bytes_per_token,
    budget_tokens,
    cut_by_tokens,
    cut_into,
    default_activation_budget,
    plan_micro_batches,
    split_to,
)
from grpo.records import TrainBatch
from tests.conftest import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from build_real_model import ARCHITECTURES, PARAMS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cut_into_gives_exactly_that_many_balanced_slices():
    costs = [5, 4, 3, 9, 2, 2, 2]
    for parts in range(1, 8):
        slices = cut_into(costs, parts)
        assert len(slices) == parts
        assert [i for s in slices for i in range(s.start, s.stop)] == list(range(7))  # contiguous cover
    assert cut_into(costs, 2) == [slice(0, 3), slice(3, 7)]  # 12 | 15 tokens
    assert cut_into([1, 1, 1, 1], 4) == [slice(i, i + 1) for i in range(4)]
    assert len(cut_into([1, 2], 5)) == 2  # never an empty slice


def _batch(prompt_lengths, completion_lengths, groups, width=6, t=5) -> TrainBatch:
    n = len(groups)
    attn = torch.zeros(n, width + t, dtype=torch.long)
    mask = torch.zeros(n, t)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        attn[i, width - p : width + c] = 1
        mask[i, :c] = 1
    return TrainBatch(
        input_ids=torch.ones(n, width + t, dtype=torch.long),
        attention_mask=attn,
        prompt_width=width,
        completion_mask=mask,
        advantages=mask.clone(),
        group_ids=torch.tensor(groups),
    )


def test_padded_cost_counts_shared_prompts_once_and_pads_to_the_longest():
    batch = _batch([4, 4, 6, 6], [1, 5, 2, 3], [0, 0, 1, 1])
    native, padded = PaddedCost(batch, shared_prompts=True), PaddedCost(batch, shared_prompts=False)
    assert native.of(range(0, 2)) == 4 + 2 * 5 and native.of(range(0, 4)) == 4 + 6 + 4 * 5
    assert padded.of(range(0, 2)) == 2 * (6 + 5)  # prompt width 6 + the longest completion, per row
    assert native.rows() == [5, 5, 8, 3] and padded.rows() == [5, 9, 8, 9]


def test_cut_by_tokens_keeps_groups_whole_where_they_fit():
    # groups of 2 rows, 4-token prompts; padded cost: group 0 = 14, group 1 = 8, group 2 = 14
    cost = PaddedCost(_batch([4] * 6, [5, 1, 2, 2, 5, 5], [0, 0, 1, 1, 2, 2]), shared_prompts=True)
    assert cut_by_tokens(cost, 100) == [slice(0, 6)]
    assert cut_by_tokens(cost, 28) == [slice(0, 4), slice(4, 6)]  # groups 0+1 pad to 5: 8 + 4 × 5
    assert cut_by_tokens(cost, 20) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    # a group over the budget is cut by rows; a row over it (4 + 5 = 9 > 8) runs alone
    assert cut_by_tokens(cost, 8) == [slice(0, 1), slice(1, 2), slice(2, 4), slice(4, 5), slice(5, 6)]


def _saved_bytes_per_token(forward: PolicyForward, model, lengths: tuple[int, int]) -> float:
    """Bytes autograd saves for backward per extra token, weights excluded, from two batch sizes."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = []
    for completion in lengths:
        batch = _batch([6] * 4, [completion] * 4, [0, 1, 2, 3], t=completion)
        storages = {}

        def pack(x, storages=storages):
            s = x.untyped_storage()
            if s.data_ptr() not in weights:
                storages[s.data_ptr()] = s.nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            forward(batch, 1.0)
        sizes.append((sum(storages.values()), 4 * (6 + completion)))
    (b0, t0), (b1, t1) = sizes
    return (b1 - b0) / (t1 - t0)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("cpu_ops", ["1", "0"])  # grpo's CPU RMSNorm (grpo/kernels) keeps less
def test_activation_estimate_matches_what_autograd_saves(native, cpu_ops, monkeypatch):
    monkeypatch.setenv("GRPO_CPU_KERNELS", cpu_ops)
    fused = kernels.cpu_ops() is not None
    # A model whose MLP and attention widths are not all equal, so a wrong coefficient shows.
    model = tiny_llama(vocab_size=64)
    model.config.intermediate_size = 64
    forward = PolicyForward(model, native=native)
    measured = _saved_bytes_per_token(forward, model, (8, 24))
    estimate = activation_bytes_per_token(
        model.config, 4, native=native, checkpointing=False, fused_norms=fused
    )
    if forward.full_logits:
        estimate += 3 * 4 * model.config.vocab_size
    print(f"native={native}: measured {measured:.0f} B/token, estimate {estimate}")
    assert 0.8 * measured <= estimate <= 1.25 * measured, (measured, estimate)


def test_budget_in_tokens():
    assert budget_tokens(1 << 30, 1 << 20, CUDA) == 1024
    assert budget_tokens(1 << 40, 1 << 10, CPU) == CPU_SPEED_TOKENS  # large budgets hit the CPU speed cap
    assert budget_tokens(1 << 20, 1 << 20, CUDA) == MIN_BUDGET_TOKENS


def _learner(**kw) -> Learner:
    cfg = GRPOConfig(batch_size=2, num_generations=4, max_new_tokens=7)
    cfg.update(kw)
    return Learner(tiny_llama(), None, cfg.validate(), total_optimizer_steps=1)


def test_learner_defaults_to_token_budget_and_honours_fixed_sizes():
    learner = _learner

    default = learner()
    assert default.micro_batch_size is None and MIN_BUDGET_TOKENS <= default.micro_batch_tokens <= 4096
    batch = _batch([6] * 8, [5] * 8, [0] * 4 + [1] * 4)
    assert default.micro_slices(batch) == [slice(0, 8)]  # 8 × ~8 tokens fit one micro-batch
    # rows cost 11 (a group's first: prompt 6 + completion 5), then 5 each
    assert learner(**{"train.micro_batch_tokens": 20}).micro_slices(batch) == [
        slice(i, i + 2) for i in range(0, 8, 2)
    ]
    assert learner(**{"train.micro_batch_tokens": 26}).micro_slices(batch) == [slice(0, 4), slice(4, 8)]
    assert learner(**{"train.gradient_accumulation_steps": 4}).micro_slices(batch) == [
        slice(i, i + 2) for i in range(0, 8, 2)
    ]
    assert learner(**{"train.micro_batch_size": 3}).micro_slices(batch) == [
        slice(0, 3),
        slice(3, 6),
        slice(6, 8),
    ]
    # 1 GB for a 2-layer, 32-wide model: the budget is far beyond the CPU speed cap
    assert learner(**{"train.activation_memory_gb": 1.0}).micro_batch_tokens == CPU_SPEED_TOKENS
    assert learner(**{"train.activation_memory_gb": 1e-4}).micro_batch_tokens < CPU_SPEED_TOKENS


def test_cpu_budget_is_at_least_twice_the_gradient():
    """Micro-batches under ~2× the gradient lower no peak (the gradient stays resident through later
    micro-batches) and slow the update: a CPU's default budget does not go below that."""
    assert default_activation_budget(CPU) == 512 << 20  # LoRA-sized gradients: the 512 MiB floor
    assert default_activation_budget(CPU, 1 << 20) == 512 << 20
    qwen_05b = PARAMS["qwen2.5-0.5b"] * 4  # float32 gradient of Qwen2.5-0.5B, 1.98 GB
    assert default_activation_budget(CPU, qwen_05b) == 2 * qwen_05b
    # Qwen2.5-0.5B's 1.86 MB of activations per token (native forward): one micro-batch of up to the
    # CPU speed cap instead of 288-token ones
    config = SimpleNamespace(**ARCHITECTURES["qwen2.5-0.5b"])  # its published config.json numbers
    per_token = activation_bytes_per_token(config, 4, native=True, checkpointing=False)
    assert budget_tokens(default_activation_budget(CPU), per_token, CPU) == 288
    assert budget_tokens(default_activation_budget(CPU, qwen_05b), per_token, CPU) == CPU_SPEED_TOKENS


def _covers(slices: list[slice], n: int) -> bool:
    return [i for s in slices for i in range(s.start, s.stop)] == list(range(n))


@pytest.mark.parametrize(
    "knobs",
    [
        {"train.gradient_accumulation_steps": 1},  # the seed API's setting: all 8 rows in one chunk
        {"train.gradient_accumulation_steps": 2},
        {"train.micro_batch_size": 8},
        {"train.micro_batch_size": 3},
        {},
    ],
)
def test_row_knobs_never_lift_the_token_budget(knobs):
    """Whatever the row knobs say, no micro-batch that runs passes train.micro_batch_tokens (issue 26:
    gradient_accumulation_steps=1 used to run every row at once, past any budget)."""
    # rows cost 11 (a group's first: prompt 6 + completion 5), then 5 each; all 8 rows: 6 + 6 + 8 × 5 = 52
    batch = _batch([6] * 8, [5] * 8, [0] * 4 + [1] * 4)
    cost = PaddedCost(batch, shared_prompts=True)
    learner = _learner(**knobs, **{"train.micro_batch_tokens": 20})
    slices = learner.micro_slices(batch)
    assert _covers(slices, 8)
    assert max(cost.of(range(s.start, s.stop)) for s in slices) <= 20, slices
    rows = learner.micro_batch_size or 8
    assert max(s.stop - s.start for s in slices) <= rows
    sizes = learner.describe_micro_batches()
    assert "at most 20 tokens" in sizes and "averages over all 8 completions" in sizes
    assert (f"at most {rows} completions" in sizes) == bool(knobs), sizes


def test_rows_and_tokens_both_cut():
    batch = _batch([6] * 8, [5] * 8, [0] * 4 + [1] * 4)
    cost = PaddedCost(batch, shared_prompts=True)
    # row chunks 0-2, 3-5, 6-7; the first (21 tokens) and second (6 + 6 + 3 × 5 = 27) pass 20 and are cut
    assert plan_micro_batches(cost, 20, 3) == [
        slice(0, 2),
        slice(2, 3),
        slice(3, 4),
        slice(4, 6),
        slice(6, 8),
    ]
    assert plan_micro_batches(cost, 1000, 3) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert plan_micro_batches(cost, 1000) == [slice(0, 8)]


def test_long_completions_with_one_accumulation_step_stay_in_a_gpu_budget():
    """64 rows of 4k-token completions with gradient_accumulation_steps=1: one 64-row micro-batch would
    run 262k tokens; the budget (here 16k tokens) cuts it into pieces of at most 16k."""
    lengths = [4096 - 37 * i for i in range(64)]
    batch = _batch([64] * 64, lengths, [i // 8 for i in range(64)], width=64, t=4096)
    cost = PaddedCost(batch, shared_prompts=True)
    slices = plan_micro_batches(cost, 16384, max_rows=64)
    assert _covers(slices, 64) and len(slices) >= 16
    assert max(cost.of(range(s.start, s.stop)) for s in slices) <= 16384


def test_split_to_reaches_the_count_without_passing_any_limit():
    batch = _batch([6] * 8, [5, 5, 1, 1, 5, 2, 2, 2], [0] * 4 + [1] * 4)
    cost = PaddedCost(batch, shared_prompts=True)
    slices = plan_micro_batches(cost, 20, 4)
    for parts in range(len(slices), 10):
        split = split_to(slices, cost, parts)
        assert _covers(split, 8) and len(split) == min(parts, 8)
        assert max(cost.of(range(s.start, s.stop)) for s in split) <= 20
        assert max(s.stop - s.start for s in split) <= 4
