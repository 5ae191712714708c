"""The native decoder matches transformers: logits per architecture, shared-prompt log-probs and gradients."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo.model import packed as native_logprobs
from grpo.model import shared_prompt as shared_prompt_module
from grpo.model.decoder import GroupLayout, NativeDecoder, unsupported_reason
from grpo.model.forward import token_logprobs
from grpo.model.packed import ChunkedTokenLogprobs, shared_prompt_logprobs
from tests.unit.test_learner import random_batch

ARCHS = {
    "llama": {},
    "llama3.1": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "qwen2": {},  # q/k/v bias
    "qwen3": {},  # q/k RMSNorm
    "mistral": {"sliding_window": None},
}


def random_model(arch: str, seed: int = 0):
    """A tiny model of `arch` with every parameter random (biases and norm weights too)."""
    torch.manual_seed(seed)
    kind = arch.split("3.1")[0]
    cfg = AutoConfig.for_model(
        kind,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=(kind != "llama"),
        **ARCHS[arch],
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def lora_model(arch: str, targets: list[str]):
    """random_model(arch) under peft LoRA adapters whose B is random (peft starts it at 0: a no-op)."""
    from grpo.config import LoraSettings
    from grpo.model.lora import apply_lora

    model = apply_lora(random_model(arch), LoraSettings(r=4, alpha=8, target_modules=targets)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_and_decode_logits_match_transformers(arch):
    check_prefill_and_decode(random_model(arch), arch)


@pytest.mark.parametrize(("arch", "targets"), [("qwen2", ["all-linear"]), ("qwen3", [])], ids=str)
def test_lora_models_decode_natively_with_their_adapters(arch, targets):
    """The native decoder folds active LoRA adapters into the projections (W + s·BA) and matches peft's
    forward; with the adapters switched off it matches the base model."""
    model = lora_model(arch, targets)
    assert unsupported_reason(model) is None
    # x(W + sBA)ᵀ rounds differently from peft's xWᵀ + s(xAᵀ)Bᵀ: ~1e-4 on logits of size ~5 here
    check_prefill_and_decode(model, arch, atol=2e-4)
    with torch.no_grad(), model.disable_adapter():
        _, base_logits = NativeDecoder(model).prefill([[3, 4, 5]], pad_id=0)
        assert torch.allclose(base_logits[0], model(torch.tensor([[3, 4, 5]])).logits[0, -1], atol=1e-5)
    with torch.no_grad():
        _, lora_logits = NativeDecoder(model).prefill([[3, 4, 5]], pad_id=0)
    assert (lora_logits - base_logits).abs().max() > 0.1  # the adapters change the logits


def test_lora_adapters_the_native_decoder_cannot_fold_are_named():
    assert "lm_head" in unsupported_reason(lora_model("llama", ["q_proj", "lm_head"]))
    model = lora_model("llama", [])
    model.peft_config["default"].use_dora = True
    assert "DoRA" in unsupported_reason(model)


def check_prefill_and_decode(model, arch: str, atol: float = 1e-5):
    assert unsupported_reason(model) is None
    dec = NativeDecoder(model)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    cache, logits = dec.prefill(prompts, pad_id=0)  # [P, V]
    continuation = torch.randint(1, 64, (len(prompts), 2, 6))  # 2 completions per prompt, 6 tokens each
    with torch.no_grad():
        for i, p in enumerate(prompts):
            assert torch.allclose(logits[i], model(torch.tensor([p])).logits[0, -1], atol=atol)
        # Decode: 2 rows per prompt, each row's tokens fed one at a time against the shared prompt KV.
        layout = GroupLayout(torch.arange(6) // 2, cache.lengths, 3)
        shape = (6, dec.num_kv_heads, 6, dec.head_dim)
        ck = [torch.zeros(shape) for _ in dec.layers]
        cv = [torch.zeros(shape) for _ in dec.layers]
        rows = continuation.view(6, 6)
        for step in range(6):
            weights = dec.decode_weights(fuse=step % 2 == 0)  # fused and separate projections alike
            cos, sin = dec.rope(layout.prompt_len_per_row + step)
            caches = [(k[:, :, : step + 1], v[:, :, : step + 1]) for k, v in zip(ck, cv, strict=True)]
            step_logits = dec.decode_step(rows[:, step], cache, layout, caches, weights, cos, sin)  # [6, V]
            for r in range(6):
                full = torch.tensor(prompts[r // 2] + rows[r, : step + 1].tolist())
                ref = model(full[None]).logits[0, -1]
                assert torch.allclose(step_logits[r], ref, atol=atol), (arch, step, r)


def test_unsupported_architectures_are_named():
    cfg = AutoConfig.for_model("gpt2", vocab_size=32, n_embd=16, n_layer=1, n_head=2)
    assert "gpt2" in unsupported_reason(AutoModelForCausalLM.from_config(cfg))
    sliding = random_model("mistral")
    sliding.config.sliding_window = 8
    assert "sliding" in unsupported_reason(sliding)


def shared_prompt_batch(seed=0):
    """random_batch with rows 0-3 and 4-7 answering the same prompt (two groups of four)."""
    batch = random_batch(seed=seed)
    width = batch.prompt_width
    for i in range(8):
        src = 0 if i < 4 else 4
        batch.input_ids[i, :width] = batch.input_ids[src, :width]
        batch.attention_mask[i, :width] = batch.attention_mask[src, :width]
    return batch


@pytest.mark.parametrize("arch", ["qwen2", "llama3.1"])
@pytest.mark.parametrize(
    "route, query_chunk",  # grid: one attention call; three causal query chunks. packed: the CPU default
    [("gqa", 64), ("gqa", 2), ("packed", 64)],
)
def test_shared_prompt_loss_and_gradients_equal_unshared(arch, route, query_chunk, monkeypatch):
    monkeypatch.setattr(shared_prompt_module, "QUERY_CHUNK", query_chunk)
    monkeypatch.setattr(shared_prompt_module, "attention_route", lambda _device: route)
    model = random_model(arch).train()
    batch = shared_prompt_batch()
    mask, adv = batch.completion_mask, batch.advantages

    def loss_and_grads(logprob_fn):
        model.zero_grad()
        logp, entropy = logprob_fn()
        loss = -(logp * adv * mask).sum() / mask.sum() + 0.1 * (logp * mask).square().sum()
        loss.backward()
        return logp.detach(), entropy, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = loss_and_grads(lambda: token_logprobs(model, batch, 0.8, with_entropy=True))
    ours = loss_and_grads(lambda: shared_prompt_logprobs(NativeDecoder(model), batch, 0.8, with_entropy=True))
    assert torch.allclose(ours[0] * mask, ref[0] * mask, atol=1e-5)
    assert torch.allclose(ours[1] * mask, ref[1] * mask, atol=1e-5)
    assert ours[2] == pytest.approx(ref[2], rel=1e-5)
    for name, grad in ref[3].items():  # float32 summation order differs: compare against the scale
        assert (ours[3][name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_gradient_checkpointing_changes_nothing():
    model = random_model("qwen3").train()
    batch = shared_prompt_batch(seed=1)
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        dec = NativeDecoder(model)
        dec.gradient_checkpointing = checkpointing
        logp, _ = shared_prompt_logprobs(dec, batch, 1.0)
        (logp * batch.advantages).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_chunked_logprobs_match_full_softmax(monkeypatch):
    monkeypatch.setattr(native_logprobs, "CHUNK_ELEMENTS", 3 * 50)  # 3 rows per chunk
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    upstream = torch.randn(10)
    logp, entropy = ChunkedTokenLogprobs.apply(hidden, weight, targets, 0.7, True)
    (logp * upstream).sum().backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full = (hidden @ weight.T / 0.7).log_softmax(-1)  # [10, 50]
    ref = full.gather(-1, targets[:, None]).squeeze(-1)
    (ref * upstream).sum().backward()
    assert torch.allclose(logp, ref, atol=1e-6)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)
    assert torch.allclose(ours[0], hidden.grad, atol=1e-5) and torch.allclose(ours[1], weight.grad, atol=1e-5)
