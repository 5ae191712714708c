"""The fused CPU decode attention (model/cpu_decode_attention.py) against PyTorch's ops for the same step."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from grpo.model import cpu_decode_attention as fused
from grpo.model import decode
from grpo.records import SamplingParams
from grpo.rollout.native import NativeEngine

pytest.importorskip("numba")


class _Dec:
    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5


def _step(prompt_lengths, rows_of_group, heads, kv_heads, t, seed=0, cache_len=None):
    """One decode step's inputs: prompt KV per group (right-padded, -inf bias past each length), rows
    sorted by group (groups may have fewer rows: a compacted batch), the completion cache a slice of its
    buffer."""
    g = torch.Generator().manual_seed(seed)
    d, p, lp = 16, len(prompt_lengths), max(prompt_lengths)
    row_group = torch.tensor([i for i, k in enumerate(rows_of_group) for _ in range(k)])
    n = row_group.numel()
    kp, vp = (torch.randn(p, kv_heads, lp, d, generator=g) for _ in range(2))
    lengths = torch.tensor(prompt_lengths)
    bias = torch.zeros(p, 1, 1, lp).masked_fill_(
        torch.arange(lp) >= lengths[:, None, None, None], float("-inf")
    )
    buf = cache_len or t + 5
    cache_k, cache_v = (torch.randn(n + 2, kv_heads, buf, d, generator=g) for _ in range(2))
    q = torch.randn(n, heads + 2 * kv_heads, d, generator=g)[:, :heads]  # a slice, as the decode splits qkv
    layout = decode.GroupLayout(row_group, lengths, p)
    return q, cache_k[:n, :, :t], cache_v[:n, :, :t], kp, vp, bias, layout


def _both(monkeypatch, dec, args, scaled):
    q, kc, vc, kp, vp, bias, layout = args
    outs = []
    for on in ("0", "1"):
        monkeypatch.setenv("GRPO_CPU_DECODE_KERNEL", on)
        monkeypatch.setattr(fused, "_kernel", None)
        assert fused.applies(q, kc) == (on == "1")
        outs.append(
            decode._decode_attention(dec, q, kc, vc, kp, vp, bias, layout, scaled=scaled, with_lse=True)
        )
    return outs


@pytest.mark.parametrize(
    "prompt_lengths,rows_of_group,heads,kv_heads,t",
    [
        ([5, 5], [3, 3], 4, 2, 1),  # dense groups, the first step
        ([7, 3, 5], [4, 4, 4], 4, 2, 9),  # padded prompts
        ([6, 2, 4], [4, 1, 3], 4, 2, 6),  # a compacted batch: groups of different sizes
        ([4, 4], [2, 2], 4, 4, 5),  # no GQA
        ([3, 8], [2, 3], 8, 2, 12),  # four query heads per KV head
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_kernel_gives_pytorchs_attention_and_log_sum_exp(
    monkeypatch, prompt_lengths, rows_of_group, heads, kv_heads, t, threads
):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dec = _Dec(heads, kv_heads, 16)
        args = _step(prompt_lengths, rows_of_group, heads, kv_heads, t)
        for scaled in (False, True):
            (ref, ref_lse), (out, lse) = _both(monkeypatch, dec, args, scaled)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
            assert out.shape == ref.shape and lse.shape == ref_lse.shape
    finally:
        torch.set_num_threads(before)


def test_the_kernel_serves_only_float32_cpu_slices_of_the_cache_buffer(monkeypatch):
    monkeypatch.setenv("GRPO_CPU_DECODE_KERNEL", "1")
    monkeypatch.setattr(fused, "_kernel", None)
    q, kc, *_ = _step([4, 4], [2, 2], 4, 2, 3)
    assert fused.applies(q, kc)
    assert not fused.applies(q.bfloat16(), kc.bfloat16())
    assert not fused.applies(q, kc.transpose(2, 3))  # not the [rows, Hkv, T, D] buffer's layout
    buffer = torch.randn(4, 2, 8, 16)
    assert fused.applies(q, buffer[:2, :, :5]) and fused.applies(q, buffer[2:, :, :5])
    # The kernel reads each (row, head)'s columns through the buffer's strides: a slice starting at column
    # 4 is served while that region stays inside the buffer, and not for the buffer's last rows.
    assert fused.applies(q, buffer[:2, :, 4:]) and not fused.applies(q, buffer[2:, :, 4:])
    monkeypatch.setenv("GRPO_CPU_DECODE_KERNEL", "0")
    monkeypatch.setattr(fused, "_kernel", None)
    assert not fused.applies(q, kc)


def test_generate_samples_the_same_tokens_with_and_without_the_kernel(tiny_model, id_tokenizer, monkeypatch):
    """A whole rollout (rows ending at eos, so the batch is compacted and groups shrink): the same tokens
    for one seed, log-probs within float32 rounding."""
    prompts = [[2, 9, 4], [2, 3], [2, 5, 6, 7, 8]]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv("GRPO_CPU_DECODE_KERNEL", on)
        monkeypatch.setattr(fused, "_kernel", None)
        torch.manual_seed(3)
        runs.append(NativeEngine(tiny_model, id_tokenizer, compile_decode=False).generate(prompts, 4, params))
    off, on = runs
    assert torch.equal(on.completion_ids, off.completion_ids)
    torch.testing.assert_close(on.sampling_logprobs, off.sampling_logprobs, rtol=1e-5, atol=1e-5)
    assert off.completion_mask.sum(1).min() < off.completion_mask.sum(1).max()  # ragged: compaction ran


def _in_child(conn):
    q, kc, vc, kp, vp, bias, layout = _step([4, 4], [2, 2], 4, 2, 3)
    torch.set_num_threads(2)
    out, _ = fused.decode_attention(q, kc, vc, kp, vp, bias, layout.row_group, 0.25)
    conn.send(out.sum().item())


def test_a_forked_child_gets_its_own_worker_threads(monkeypatch):
    """The worker pool belongs to a process: a child forked after the parent used it builds its own (the
    parent's threads do not exist in the child) and gets the parent's numbers."""
    monkeypatch.setenv("GRPO_CPU_DECODE_KERNEL", "1")
    q, kc, vc, kp, vp, bias, layout = _step([4, 4], [2, 2], 4, 2, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fused.applies(q, kc)
        want = fused.decode_attention(q, kc, vc, kp, vp, bias, layout.row_group, 0.25)[0].sum().item()
        assert fused._pool is not None and fused._pool[0] == os.getpid()
    finally:
        torch.set_num_threads(before)
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_in_child, args=(child,))
    proc.start()
    assert parent.poll(60), "the forked child did not finish its decode attention"
    assert parent.recv() == pytest.approx(want, rel=1e-6)
    proc.join(10)
    assert proc.exitcode == 0
