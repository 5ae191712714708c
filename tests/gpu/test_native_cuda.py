"""The native decoder, engine and shared-prompt learner on CUDA in bfloat16 (skipped without a GPU)."""

import pytest
import torch

from grpo.model.decoder import GroupLayout, NativeDecoder
from grpo.model.forward import token_logprobs
from grpo.model.packed import shared_prompt_logprobs
from grpo.records import SamplingParams
from grpo.rollout.native import NativeEngine, unwritten_bias
from tests.conftest import IdTokenizer
from tests.unit.test_native import random_model, shared_prompt_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bf16_model(arch="qwen2"):
    return random_model(arch).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama3.1", "qwen2", "qwen3"])
def test_bf16_prefill_and_decode_track_transformers(arch):
    model = bf16_model(arch)
    dec = NativeDecoder(model)
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    cache, logits = dec.prefill(prompts, pad_id=0)
    rows = torch.randint(1, 64, (4, 5), device="cuda")
    layout = GroupLayout(torch.arange(4, device="cuda") // 2, cache.lengths, 2)
    shape = (4, dec.num_kv_heads, 5, dec.head_dim)
    ck = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in dec.layers]
    cv = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in dec.layers]
    weights = dec.decode_weights(fuse=False)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = model(torch.tensor([p], device="cuda")).logits[0, -1].float()
            assert (logits[i].float() - ref).abs().max() < 0.05 * ref.abs().max()
        for step in range(5):
            cos, sin = dec.rope(layout.prompt_len_per_row + step)
            caches = [(k[:, :, : step + 1], v[:, :, : step + 1]) for k, v in zip(ck, cv, strict=True)]
            out = dec.decode_step(rows[:, step], cache, layout, caches, weights, cos, sin).float()
            for r in range(4):
                full = torch.tensor(prompts[r // 2] + rows[r, : step + 1].tolist(), device="cuda")
                ref = model(full[None]).logits[0, -1].float()
                assert (out[r] - ref).abs().max() < 0.05 * ref.abs().max(), (step, r)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_engine_on_cuda_compiled_decode_tracks_eager_and_reports_logprobs(compile_decode):
    """Teacher-forced: the same tokens through the engine's decode step (compiled or not) and the eager
    one, logits within a bf16 tolerance. Greedy tokens are not compared: inductor rounds fused bf16
    intermediates differently from eager, and a near-tie between the two top logits then flips a token."""
    model = bf16_model()
    model.generation_config.eos_token_id = 1
    engine = NativeEngine(model, IdTokenizer(), compile_decode=compile_decode)
    assert not engine.exact_logprobs  # bf16: π_old comes from the learner's own forward
    dec, t = engine.decoder, 12
    prompts = [[2, 9, 4], [2, 3, 5, 7]]
    cache, _ = dec.prefill(prompts, pad_id=0)
    rows = torch.randint(2, 64, (4, t), device="cuda")
    layout = GroupLayout(torch.arange(4, device="cuda") // 2, cache.lengths, 2)
    weights = dec.decode_weights(fuse=False)
    shape = (4, dec.num_kv_heads, t, dec.head_dim)

    def caches():
        return [
            (
                torch.zeros(shape, device="cuda", dtype=dec.dtype),
                torch.zeros(shape, device="cuda", dtype=dec.dtype),
            )
            for _ in dec.layers
        ]

    ours, eager = caches(), caches()
    with torch.no_grad():
        for step in range(t):
            cos, sin = dec.rope(layout.prompt_len_per_row + step)
            static = {
                "position": torch.tensor([step], device="cuda"),
                "cache_bias": unwritten_bias(step, t, "cuda", dec.dtype),
            }
            got = engine.decode_step(rows[:, step], cache, layout, ours, weights, cos, sin, **static).float()
            ref = dec.decode_step(rows[:, step], cache, layout, eager, weights, cos, sin, **static).float()
            assert (got - ref).abs().max() <= 0.05 * ref.abs().max(), step
    torch.manual_seed(0)
    sampled = engine.generate(prompts, 8, SamplingParams(max_new_tokens=16, temperature=1.0))
    assert torch.isfinite(sampled.sampling_logprobs).all() and (sampled.sampling_logprobs <= 0).all()


def test_bf16_shared_prompt_gradients_track_unshared():
    model = bf16_model("qwen3").train()
    batch = shared_prompt_batch()
    mask, adv = batch.completion_mask.cuda(), batch.advantages.cuda()
    grads = []
    for fn in (
        lambda: token_logprobs(model, batch, 1.0),
        lambda: shared_prompt_logprobs(NativeDecoder(model), batch, 1.0),
    ):
        model.zero_grad()
        logp, _ = fn()
        (logp * adv * mask).sum().backward()
        grads.append({n: p.grad.float().clone() for n, p in model.named_parameters()})
    for name, ref in grads[0].items():
        assert (grads[1][name] - ref).norm() <= 0.05 * ref.norm() + 1e-3, name
