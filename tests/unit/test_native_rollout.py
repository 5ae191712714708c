"""The native engine samples exactly the stated distribution, reports it, and stops where it should."""

import pytest
import torch

from grpo.records import SamplingParams
from grpo.rollout import build_engine
from grpo.rollout.native import NativeEngine
from grpo.rollout.sampling import filter_logits, sample_tokens
from grpo.rollout.transformers import TransformersEngine


def _distribution(model, ids, temperature, top_k, top_p):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return filter_logits(logits[None], temperature, top_k, top_p).softmax(-1)[0]  # [V]


def _chi2_ok(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=expected.numel()).float()
    assert counts[expected == 0].sum() == 0, "sampled a token the filters remove"
    e = expected * n
    keep = e >= 5
    chi2 = ((counts[keep] - e[keep]) ** 2 / e[keep]).sum().item()
    assert chi2 < 3 * keep.sum().item(), chi2  # df < #kept bins: 3x is far in the tail


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 6, 1.0), (1.2, 0, 0.7)])
def test_native_engine_samples_the_stated_distribution(tiny_model, id_tokenizer, temperature, top_k, top_p):
    engine = NativeEngine(tiny_model, id_tokenizer)
    prompt = [2, 7, 11, 5]
    params = SamplingParams(max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.manual_seed(1)
    out = engine.generate([prompt], 6000, params)
    first = out.completion_ids[:, 0]
    expected = _distribution(tiny_model, prompt, temperature, top_k, top_p)
    _chi2_ok(first, expected)  # the shared prefill
    assert torch.allclose(out.sampling_logprobs[:, 0], expected.log()[first], atol=1e-5)
    # The decode step: second tokens after the most common first token (not eos, so it continued).
    common = int(torch.bincount(first[first != 1]).argmax())
    rows = first == common
    second_expected = _distribution(tiny_model, [*prompt, common], temperature, top_k, top_p)
    _chi2_ok(out.completion_ids[rows, 1], second_expected)
    assert torch.allclose(
        out.sampling_logprobs[rows, 1], second_expected.log()[out.completion_ids[rows, 1]], atol=1e-5
    )


def test_sampler_never_picks_a_removed_token():
    torch.manual_seed(0)
    logits = torch.randn(4000, 30)
    tokens, logp = sample_tokens(logits, SamplingParams(max_new_tokens=1, top_k=3))
    allowed = logits.topk(3, dim=-1).indices
    assert (allowed == tokens[:, None]).any(-1).all()
    assert (logp <= 0).all()


def test_a_draw_that_rounds_up_to_the_total_takes_the_last_token_with_mass(monkeypatch):
    """u = rand · total can round up to the total (p ≈ 1e-7); u = total exactly stands in for it. Tokens
    after the last with mass are filtered (−inf): none of them, and no index past the vocabulary, comes
    out."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.1, 0.2, 3.0, 0.3, 0.4]])  # [2, 5]
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape))
    tokens, logp = sample_tokens(logits, SamplingParams(max_new_tokens=1, top_k=3))
    kept = filter_logits(logits, 1.0, 3, 1.0).isfinite()  # [2, 5]
    last = [max(i for i in range(5) if kept[r, i]) for r in range(2)]
    assert tokens.tolist() == last and torch.isfinite(logp).all()


def test_eos_truncation_logprobs_and_dropped_rows(tiny_model, id_tokenizer):
    # Eleven eos ids end a quarter of the rows each step, so finished rows get dropped many times.
    tiny_model.generation_config.eos_token_id = list(range(1, 12))
    engine = NativeEngine(tiny_model, id_tokenizer)
    torch.manual_seed(3)
    prompts = [[2, 9, 4], [2, 3], [2, 5, 6, 7, 8, 9]]
    out = engine.generate(prompts, 6, SamplingParams(max_new_tokens=10, temperature=1.0))
    assert out.group_ids.tolist() == [0] * 6 + [1] * 6 + [2] * 6
    lengths = out.completion_mask.sum(-1).long()
    assert len(set(lengths.tolist())) > 1, "expected rows to finish at different steps"
    for row in range(18):
        ids, length = out.completion_ids[row], int(lengths[row])
        ends = int(ids[length - 1]) in range(1, 12)
        assert out.truncated[row].item() == (not ends)
        assert ((ids[: length - 1] < 1) | (ids[: length - 1] >= 12)).all(), "generated past an eos"
        assert (ids[length:] == 0).all() and (out.sampling_logprobs[row, length:] == 0).all()
        prompt = prompts[out.group_ids[row]]
        full = torch.tensor(prompt + ids[:length].tolist())
        with torch.no_grad():
            logp = tiny_model(full[None]).logits[0].log_softmax(-1)
        expected = logp[len(prompt) - 1 : -1].gather(-1, full[len(prompt) :, None]).squeeze(-1)
        assert torch.allclose(out.sampling_logprobs[row, :length], expected, atol=1e-5)


class _CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26): enough to place stop strings."""

    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, ids, skip_special_tokens=True):
        return [
            "".join(chr(97 + int(i) % 26) for i in row if not (skip_special_tokens and int(i) in (0, 1)))
            for row in ids
        ]


def test_stop_strings_end_a_completion(tiny_model):
    tok = _CharTokenizer()
    engine = NativeEngine(tiny_model, tok)
    torch.manual_seed(0)
    stops = ["c", "e"]  # common single letters: most rows stop early
    out = engine.generate([[2, 9, 4]], 40, SamplingParams(max_new_tokens=12, stop_strings=stops))
    lengths = out.completion_mask.sum(-1).long()
    texts = tok.batch_decode(out.completion_ids)
    for row, text in enumerate(texts):
        length = int(lengths[row])
        hit = [i for i, ch in enumerate(text) if ch in "ce"]
        ended_by_eos = int(out.completion_ids[row, length - 1]) == 1
        if hit and not ended_by_eos:
            assert hit[0] == len(text) - 1, "a stop string must be the last thing generated"
            assert not out.truncated[row]
    assert (lengths < 12).sum() > 20


def test_greedy_matches_transformers_generate(tiny_model, id_tokenizer):
    prompts = [[2, 9, 4], [2, 3], [2, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, greedy=True)
    ours = NativeEngine(tiny_model, id_tokenizer).generate(prompts, 1, params)
    ref = TransformersEngine(tiny_model, id_tokenizer).generate(prompts, 1, params)
    width = ref.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids[:, :width], ref.completion_ids)
    assert torch.equal(ours.completion_mask[:, :width], ref.completion_mask)
    assert torch.equal(ours.truncated, ref.truncated)


def test_lora_policy_rolls_out_natively_and_matches_transformers_generate(tiny_model, id_tokenizer):
    """A LoRA policy gets the native engine (adapters folded into each call's weights), which samples what
    peft's own forward under transformers generate does, log-probs included."""
    from grpo.config import LoraSettings
    from grpo.model.lora import apply_lora

    policy = apply_lora(tiny_model, LoraSettings(r=4, alpha=8, target_modules=["all-linear"]))
    g = torch.Generator().manual_seed(0)  # fixed adapters: greedy ties cannot flip between runs
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    engine = build_engine("native", policy, id_tokenizer)
    assert isinstance(engine, NativeEngine)
    prompts = [[2, 9, 4], [2, 3], [2, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, greedy=True)
    ours = engine.generate(prompts, 1, params)
    ref = TransformersEngine(policy, id_tokenizer).generate(prompts, 1, params)
    with torch.no_grad(), policy.disable_adapter():
        base = TransformersEngine(policy, id_tokenizer).generate(prompts, 1, params)
    assert not torch.equal(base.completion_ids, ref.completion_ids)  # the adapters change what is sampled
    width = ref.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids[:, :width], ref.completion_ids)
    assert torch.equal(ours.completion_mask[:, :width], ref.completion_mask)
    torch.testing.assert_close(
        ours.sampling_logprobs[:, :width] * ref.completion_mask,
        ref.sampling_logprobs * ref.completion_mask,
        rtol=1e-4,
        atol=1e-4,
    )


def test_low_memory_host_decodes_on_the_live_weights(tiny_model, id_tokenizer, monkeypatch, caplog):
    """Where a per-call weight copy would take over half the available memory, decode uses the live
    weights (no copy) and samples the same tokens."""
    prompts = [[2, 9, 4], [2, 3], [2, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, greedy=True)
    copied = NativeEngine(tiny_model, id_tokenizer).generate(prompts, 2, params)
    size = sum(p.numel() * p.element_size() for p in tiny_model.parameters())
    monkeypatch.setattr("grpo.rollout.native.available_bytes", lambda: 2 * size - 1)
    engine = NativeEngine(tiny_model, id_tokenizer)
    with caplog.at_level("INFO", logger="grpo"):
        live = engine.generate(prompts, 2, params)
    assert "decodes on the live weights" in caplog.text
    assert torch.equal(live.completion_ids, copied.completion_ids)
    torch.testing.assert_close(live.sampling_logprobs, copied.sampling_logprobs, rtol=1e-5, atol=1e-5)
    weights = engine.decoder.decode_weights(fuse=True, copy=False)
    layer, first = weights.layers[0], tiny_model.model.layers[0]
    assert layer.down.weight_t is None and not layer.down.onednn
    assert layer.down.weight.data_ptr() == first.mlp.down_proj.weight.data_ptr()  # no copy
    assert [q.weight.data_ptr() for q in layer.qkv] == [
        getattr(first.self_attn, f"{m}_proj").weight.data_ptr() for m in "qkv"
    ]  # q|k|v not fused (a concatenation is a copy)
    monkeypatch.setattr("grpo.rollout.native.available_bytes", lambda: 2 * size)
    assert NativeEngine(tiny_model, id_tokenizer)._copy_fits()


def test_gate_and_up_decode_as_one_product(tiny_model, id_tokenizer, monkeypatch):
    """On MKL's path (copied weights, no oneDNN epilogues) gate and up run as one GEMM of [W_g; W_u]: the
    same tokens, log-probs and recorded products as the two projections (recording on and off)."""
    import dataclasses

    from grpo.model import decode
    from grpo.model import linear as native_linear
    from grpo.model.replay import ReplayTape

    monkeypatch.setattr(native_linear, "ONEDNN", False)
    prompts = [[2, 9, 4], [2, 3], [2, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    fused_weights = decode.decode_weights

    def two_products(*args, **kwargs):
        w = fused_weights(*args, **kwargs)
        assert all(layer.gate_up is not None for layer in w.layers)
        assert all(x.gate.weight_t is None and x.up.weight_t is None for x in w.layers)  # no second copy
        return dataclasses.replace(w, layers=[dataclasses.replace(x, gate_up=None) for x in w.layers])

    runs = []
    for weights in (fused_weights, two_products):
        monkeypatch.setattr(decode, "decode_weights", weights)
        for record in (False, True):
            engine = NativeEngine(tiny_model, id_tokenizer)
            engine.tape = ReplayTape(budget_bytes=2**30) if record else None
            if record:
                engine.tape.arm()
            torch.manual_seed(5)
            out = engine.generate(prompts, 3, params)
            rec = engine.tape.take() if record else None
            runs.append((out, rec))
    base = runs[0][0]
    for out, _ in runs[1:]:
        assert torch.equal(out.completion_ids, base.completion_ids)
        torch.testing.assert_close(out.sampling_logprobs, base.sampling_logprobs, rtol=1e-6, atol=1e-6)
    (_, fused), (_, two) = runs[1], runs[3]
    recorded = fused.ids >= 0  # the slots a token was recorded at
    assert torch.equal(two.ids, fused.ids) and recorded.sum() > 3 * 8
    for a, b in zip(fused.buffers, two.buffers, strict=True):
        torch.testing.assert_close(a["gu"][recorded], b["gu"][recorded], rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # ~1 min of compilation
def test_compiled_decode_step_on_cpu_matches_eager(tiny_model, id_tokenizer):
    """compile_decode on a CPU: the compiled step runs on plain weights and gives the eager output."""
    prompts = [[2, 9, 4], [2, 3]]
    params = SamplingParams(max_new_tokens=5, greedy=True)
    with torch.no_grad():
        eager = NativeEngine(tiny_model, id_tokenizer).generate(prompts, 2, params)
        compiled = NativeEngine(tiny_model, id_tokenizer, compile_decode=True).generate(prompts, 2, params)
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    assert torch.allclose(compiled.sampling_logprobs, eager.sampling_logprobs, atol=1e-5)


def test_engine_choice_and_fallback(tiny_model, id_tokenizer):
    assert isinstance(build_engine("native", tiny_model, id_tokenizer), NativeEngine)
    assert isinstance(build_engine("transformers", tiny_model, id_tokenizer), TransformersEngine)
    tiny_model.config.model_type = "not-a-llama"
    assert isinstance(build_engine("native", tiny_model, id_tokenizer), TransformersEngine)


def test_a_decode_step_copies_to_the_host_once(tiny_model, id_tokenizer, monkeypatch):
    """On a GPU every device-to-host copy is a sync that stalls the next step's kernels: a step brings its
    tokens, log-probs and eos flags back in one copy (it was three)."""
    tiny_model.generation_config.eos_token_id = None  # no eos: every row runs to the limit, no compaction
    engine = NativeEngine(tiny_model, id_tokenizer)
    engine.eos_ids = torch.tensor([-1])
    copies = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real(self, *a, **k))
    torch.manual_seed(0)
    out = engine.generate([[3, 4, 5], [6, 7]], 3, SamplingParams(max_new_tokens=10))
    assert out.completion_mask.sum() == 6 * 10
    assert len(copies) <= 10 + 2  # one a step, plus set-up
