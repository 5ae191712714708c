"""The packed shared-prompt attention (model/packed_attention.py) computes the grid route's numbers."""

import pytest
import torch
import torch.nn.functional as F

from grpo.model import shared_prompt
from grpo.model.decoder import NativeDecoder
from grpo.model.packed import shared_prompt_logprobs
from grpo.model.packed_attention import Run, packed_attention
from grpo.model.shared_prompt import pack_shared_prompts
from tests.unit.test_native import random_model, shared_prompt_batch


def dense_reference(q, k, v, prompts, row_group, completions, scale):
    """The same attention from an explicit [S, S] mask over the packed tokens (float64, autograd)."""
    group, row = [], []  # per packed token: its group; its row (−1 for prompt tokens)
    for g, x in enumerate(prompts):
        group += [g] * len(x)
        row += [-1] * len(x)
    for i in sorted(range(len(completions)), key=lambda i: row_group[i]):
        inputs = max(len(completions[i]) - 1, 0)
        group += [row_group[i]] * inputs
        row += [i] * inputs
    group, row = torch.tensor(group), torch.tensor(row)
    pos = torch.arange(len(group))
    allowed = (
        (group[:, None] == group[None, :])
        & (pos[None, :] <= pos[:, None])
        & ((row[None, :] < 0) | (row[None, :] == row[:, None]))
    )  # [S, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )  # [H, S, D]
    return out.transpose(0, 1).flatten(1)


@pytest.mark.parametrize(
    "prompts, row_group, completions, pieces",
    [
        # every row at the limit, equal prompts: one batched call per piece
        ([[1, 2, 3], [4, 5, 6]], [0, 0, 1, 1], [[7] * 5] * 4, (1, 1, 1)),
        # ragged rows, prompts of different lengths, a one-token completion (no input), rows out of
        # group order
        ([[1, 2, 3, 4], [5, 6]], [1, 0, 0, 1, 1], [[7] * 6, [8] * 3, [9], [3] * 4, [2] * 6], (2, 2, 4)),
    ],
)
def test_packed_attention_matches_a_dense_mask_forward_and_backward(prompts, row_group, completions, pieces):
    pack = pack_shared_prompts(prompts, row_group, completions, 6, torch.device("cpu"))
    layout = pack.layout
    assert (len(layout.prompt), len(layout.cross), len(layout.own)) == pieces
    s = pack.token_ids.shape[0]
    torch.manual_seed(0)
    q = torch.randn(s, 4, 8, dtype=torch.float64, requires_grad=True)  # 4 query heads over 2 KV heads
    k = torch.randn(s, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, 2, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(s, 32, dtype=torch.float64)
    results = []
    for fn in (
        lambda: packed_attention(q, k, v, layout, 0.3),
        lambda: dense_reference(q, k, v, prompts, row_group, completions, 0.3),
    ):
        out = fn()
        q.grad = k.grad = v.grad = None
        (out * upstream).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for ours, ref in zip(*results, strict=True):
        assert torch.allclose(ours, ref, atol=1e-10)


def test_runs_batch_adjacent_segments_of_one_length():
    from grpo.model.packed_attention import runs

    assert runs([0, 3, 6, 6, 8], [3, 3, 0, 2, 2]) == [Run(0, 2, 3), Run(6, 2, 2)]
    assert runs([0, 4], [3, 3]) == [Run(0, 1, 3), Run(4, 1, 3)]  # a gap: not one view


@pytest.mark.parametrize("arch", ["qwen3", "llama3.1"])  # q/k norms; llama3 RoPE scaling
def test_packed_route_gives_the_grid_routes_logprobs_and_gradients(arch, monkeypatch):
    """Ragged micro-batches of two groups with prompts of different lengths, grouped-query heads: the
    packed route (the CPU default) and the grid route agree on log-probs and every gradient (float32)."""
    model = random_model(arch).train()

    def run(route, batch, grad=True):
        monkeypatch.setattr(shared_prompt, "attention_route", lambda _device: route)
        model.zero_grad()
        with torch.set_grad_enabled(grad):
            logp, entropy = shared_prompt_logprobs(NativeDecoder(model), batch, 0.9, with_entropy=True)
        if grad:
            (logp * batch.advantages).sum().backward()
        return logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters() if grad}

    for seed in (0, 3):
        batch = shared_prompt_batch(seed=seed)
        mask = batch.completion_mask
        grid, packed = run("gqa", batch), run("packed", batch)
        assert torch.allclose(packed[0] * mask, grid[0] * mask, atol=1e-5)
        assert torch.allclose(packed[1] * mask, grid[1] * mask, atol=1e-5)
        for name, g in grid[2].items():
            assert (packed[2][name] - g).abs().max() <= 1e-5 * g.abs().max(), name
    no_grad = run("packed", batch, grad=False)  # the reference pass
    assert torch.allclose(no_grad[0] * mask, grid[0] * mask, atol=1e-5)


def test_packed_route_in_bfloat16_stays_as_close_to_float32_as_the_grid_route():
    model = random_model("qwen3").train()
    batch = shared_prompt_batch(seed=2)
    mask = batch.completion_mask

    def logp(route, dtype):
        shared_prompt_route = shared_prompt.attention_route
        shared_prompt.attention_route = lambda _device: route
        try:
            with torch.no_grad():
                return shared_prompt_logprobs(NativeDecoder(model, dtype), batch, 0.9)[0] * mask
        finally:
            shared_prompt.attention_route = shared_prompt_route

    exact = logp("gqa", None)
    grid_error = (logp("gqa", torch.bfloat16) - exact).abs().max()
    packed_error = (logp("packed", torch.bfloat16) - exact).abs().max()
    assert packed_error <= 2 * grid_error + 1e-3
