"""The transformers-generate engine samples exactly the stated distribution and reports it."""

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo.records import SamplingParams
from grpo.rollout.sampling import filter_logits
from grpo.rollout.transformers import TransformersEngine


def test_filter_logits_worked_example():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), temperature=1.0, top_k=0, top_p=0.75).isfinite()
    # mass before each token: 0, .5, .8, .95 -> tokens whose preceding mass reaches .75 are dropped
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(probs.log(), temperature=1.0, top_k=3, top_p=1.0).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    assert filter_logits(probs.log(), 1.0, 0, 1.0).isfinite().all()  # both filters off


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.6), (0.9, 8, 0.9)]
)
def test_filter_logits_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = filter_logits(logits, temperature, top_k, top_p)
    assert torch.equal(ours.isfinite(), ref.isfinite())
    assert torch.allclose(ours.softmax(-1), ref.softmax(-1), atol=1e-6)


def _next_token_distribution(model, prompt, temperature, top_k, top_p):
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    return filter_logits(logits[None], temperature, top_k, top_p).softmax(-1)[0]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 6, 1.0), (1.2, 0, 0.7)])
def test_engine_samples_the_stated_distribution(tiny_model, id_tokenizer, temperature, top_k, top_p):
    engine = TransformersEngine(tiny_model, id_tokenizer)
    prompt = [2, 7, 11, 5]
    expected = _next_token_distribution(tiny_model, prompt, temperature, top_k, top_p)  # [V]
    n = 6000
    torch.manual_seed(1)
    out = engine.generate(
        [prompt], n, SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    )
    first = out.completion_ids[:, 0]
    counts = torch.bincount(first, minlength=expected.numel()).float()
    assert counts[expected == 0].sum() == 0, "sampled a token the filters remove"
    # Pearson chi-square over tokens with enough expected mass; df < V, so 3x the df is far out in the tail.
    e = expected * n
    keep = e >= 5
    chi2 = ((counts[keep] - e[keep]) ** 2 / e[keep]).sum().item()
    assert chi2 < 3 * keep.sum().item(), chi2
    # The reported log-prob is the sampling distribution's log-prob of the chosen token.
    assert torch.allclose(out.sampling_logprobs[:, 0], expected.log()[first], atol=1e-5)


def test_logprobs_eos_and_truncation(tiny_model, id_tokenizer):
    engine = TransformersEngine(tiny_model, id_tokenizer)
    torch.manual_seed(3)
    prompts = [[2, 9, 4], [2, 3]]
    out = engine.generate(prompts, 5, SamplingParams(max_new_tokens=12, temperature=1.0))
    assert out.completion_ids.shape[0] == 10
    assert out.group_ids.tolist() == [0] * 5 + [1] * 5
    for row in range(10):
        ids = out.completion_ids[row]
        length = int(out.completion_mask[row].sum())
        has_eos = bool((ids[:length] == 1).any())
        assert out.truncated[row].item() == (not has_eos and length == 12)
        if has_eos:
            assert ids[length - 1] == 1 and (ids[: length - 1] != 1).all()
        assert (out.sampling_logprobs[row, length:] == 0).all()
        # Recompute the policy's log-probs of the sampled tokens (temperature 1, no filters): equal.
        full = torch.tensor(prompts[out.group_ids[row]] + ids[:length].tolist())
        with torch.no_grad():
            logp = tiny_model(full[None]).logits[0].log_softmax(-1)
        start = len(prompts[out.group_ids[row]])
        expected = logp[start - 1 : -1].gather(-1, full[start:, None]).squeeze(-1)
        assert torch.allclose(out.sampling_logprobs[row, :length], expected, atol=1e-5)


def test_greedy_is_deterministic_and_chunking_changes_nothing(tiny_model, id_tokenizer):
    engine = TransformersEngine(tiny_model, id_tokenizer)
    prompts = [[2, 9, 4], [2, 3], [2, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, greedy=True)
    a = engine.generate(prompts, 1, params)
    b = engine.generate(prompts, 1, params, chunk_prompts=1)
    width = min(a.completion_ids.shape[1], b.completion_ids.shape[1])
    assert torch.equal(a.completion_ids[:, :width], b.completion_ids[:, :width])
    assert torch.equal(a.group_ids, b.group_ids)
