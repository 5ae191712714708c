"""Real-model vocabulary shapes on tiny models: an embedding larger than the tokenizer (as in Qwen, 151,936
rows for 151,665 tokens), and no [tokens, vocab] tensor in rollout, reference, update or evaluation."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo import GRPOConfig, GRPOTrainer
from grpo.model.forward import token_logprobs
from grpo.model.packed import CHUNK_ELEMENTS
from grpo.records import TrainBatch
from grpo.rewards.model import CausalLMLikelihoodReward
from tests.tiny_run import write_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from build_real_model import build

pytestmark = pytest.mark.slow

SMALL_QWEN = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
}


class VocabRows(TorchDispatchMode):
    """Records the most rows (numel / vocab) of any tensor an op produces with a dimension of size `vocab`."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.vocab in t.shape:
                self.most = max(self.most, t.numel() // self.vocab)
        return out


def small_qwen(path: Path, vocab: int) -> Path:
    return build("qwen2.5-0.5b", path, vocab_size=vocab, max_position_embeddings=512, **SMALL_QWEN)


def train(model_dir: Path, tmp: Path, **overrides):
    data = write_dataset(tmp / "data.jsonl", 8)
    cfg = GRPOConfig(
        model=str(model_dir),
        dataset=str(data),
        eval_dataset=str(data),
        eval_max_samples=4,
        eval_before=True,
        eval_after=True,
        output_dir=str(tmp / "run"),
        batch_size=2,
        num_generations=4,
        max_new_tokens=32,
        steps=2,
        beta=0.04,
        learning_rate=1e-3,
        logging_steps=1,
        progress_bar=False,
        num_threads=1,
        seed=3,
        tensorboard=False,
        **overrides,
    )
    return GRPOTrainer(config=cfg, reward_funcs=["gsm8k_correctness", "gsm8k_format"]).train()


@pytest.mark.parametrize("engine", ["native", "transformers"])
def test_ids_beyond_the_tokenizer_do_not_crash_anything(tmp_path, engine):
    model_dir = small_qwen(tmp_path / "model", vocab=2048)  # 3.2× the 641-token tokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == 641
    train(model_dir, tmp_path, engine=engine)
    run = tmp_path / "run"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples  # written, with the text of completions whose ids the tokenizer does not know
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert sum("eval/accuracy" in m for m in metrics) == 2  # before and after
    assert (run / "report" / "index.html").is_file()
    # The random model samples ids past the tokenizer's 641 almost always (1,407 of 2,048 ids).
    policy = AutoModelForCausalLM.from_pretrained(run / "final_model")
    ids = torch.multinomial(policy(torch.tensor([[5, 6, 7]])).logits[0, -1].softmax(-1), 64, replacement=True)
    assert (ids >= len(tokenizer)).float().mean() > 0.4


LORA = {"lora.enabled": True, "lora.r": 4, "lora.alpha": 8}


@pytest.mark.parametrize(
    ("engine", "lora"), [("native", False), ("transformers", False), ("native", True)], ids=str
)
def test_no_tokens_by_vocab_tensor_in_a_training_run(tmp_path, engine, lora):
    vocab = 32768
    model_dir = small_qwen(tmp_path / "model", vocab=vocab)
    watch = VocabRows(vocab)
    with watch:
        train(model_dir, tmp_path, engine=engine, **(LORA if lora else {}))
    # 8 completions × 32 tokens = 256 predicted tokens per update; a [N, T, V] tensor would be 256 rows.
    # Allowed: sampling's [rows, V] per step (8) and the chunked head's CHUNK_ELEMENTS / V rows (128).
    assert 0 < watch.most <= max(8, CHUNK_ELEMENTS // vocab) < 256


def _batch(tokenizer, n: int = 4, t: int = 12, vocab: int = 4096) -> TrainBatch:
    torch.manual_seed(0)
    prompt = torch.tensor(tokenizer("<|user|>\nWhat is 2+3?\n<|assistant|>\n").input_ids)
    completion = torch.randint(0, vocab, (n, t))
    ids = torch.cat([prompt.expand(n, -1), completion], dim=1)
    mask = torch.ones(n, t)
    mask[1, 7:] = 0
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.cat([torch.ones(n, len(prompt)), mask], 1).long(),
        prompt_width=len(prompt),
        completion_mask=mask,
        advantages=torch.ones(n, t),
        group_ids=torch.zeros(n, dtype=torch.long),
    )


def test_chunked_head_matches_full_log_softmax_values_and_gradients(tmp_path, monkeypatch):
    vocab = 4096
    monkeypatch.setattr("grpo.model.packed.CHUNK_ELEMENTS", 5 * vocab)  # 5 rows a chunk: 10 chunks
    model = AutoModelForCausalLM.from_pretrained(small_qwen(tmp_path / "m", vocab=vocab))
    batch = _batch(AutoTokenizer.from_pretrained(tmp_path / "m"), vocab=vocab)
    width = batch.prompt_width

    def reference():
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        logp_all = torch.log_softmax(out.logits[:, width - 1 : -1].float() / 0.7, -1)  # [N, T, V]
        logp = logp_all.gather(-1, batch.input_ids[:, width:, None]).squeeze(-1)
        return logp, -(logp_all.exp() * logp_all).sum(-1)

    def grads(logp):
        model.zero_grad()
        ((logp * batch.completion_mask * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_entropy = reference()
    want_grads = grads(want)
    watch = VocabRows(vocab)
    with watch:
        got, entropy = token_logprobs(model, batch, 0.7, with_entropy=True)
        got_grads = grads(got)
    assert watch.most == 16  # the head's [V, d] weight gradient; chunks are 5 rows, N·T is 48
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-5, atol=1e-5)
    assert want.abs().mean() > 1  # real log-probs of a 4,096-token vocabulary, not zeros
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert want_grads["model.embed_tokens.weight"].abs().sum() > 0


def test_lora_chunked_head_matches_the_peft_forward_values_and_gradients(tmp_path, monkeypatch):
    """LoRA policy and its adapters-off reference run the decoder + chunked head, and equal peft's own
    full-logits forward: log-probs, and the adapters' gradients."""
    from grpo.config import LoraSettings
    from grpo.model.lora import ReferenceWithoutAdapters, apply_lora

    vocab = 4096
    monkeypatch.setattr("grpo.model.packed.CHUNK_ELEMENTS", 5 * vocab)
    model_dir = small_qwen(tmp_path / "m", vocab=vocab)
    policy = apply_lora(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraSettings(r=4, alpha=8, dropout=0.0)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts B at 0 (adapters a no-op); move them so they change the logits
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    batch = _batch(AutoTokenizer.from_pretrained(model_dir), vocab=vocab)
    width, inputs = batch.prompt_width, {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}

    def full_logprobs(model):
        logits = model(**inputs, position_ids=batch.position_ids, use_cache=False).logits
        logp_all = torch.log_softmax(logits[:, width - 1 : -1].float() / 0.7, -1)  # [N, T, V]
        return logp_all.gather(-1, batch.input_ids[:, width:, None]).squeeze(-1)

    def adapter_grads(logp):
        policy.zero_grad()
        ((logp * batch.completion_mask * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum()).backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}

    want = full_logprobs(policy)
    want_grads = adapter_grads(want)
    watch = VocabRows(vocab)
    with watch:
        got, _ = token_logprobs(policy, batch, 0.7)
        got_grads = adapter_grads(got)
        with torch.no_grad():
            ref, _ = token_logprobs(ReferenceWithoutAdapters(policy), batch, 0.7)
    assert watch.most == 16  # d: the head weight's transposed view in backward; chunks are 5 rows, N·T 48
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want_grads and all(g.abs().sum() > 0 for g in want_grads.values())
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad(), policy.disable_adapter():
        base = full_logprobs(policy)
    torch.testing.assert_close(ref, base, rtol=1e-5, atol=1e-5)
    assert (ref - got.detach()).abs().max() > 0.1  # the adapters matter, and were switched off for π_ref


def test_likelihood_reward_scores_as_full_logits_without_them(tmp_path):
    vocab = 32768
    model_dir = small_qwen(tmp_path / "m", vocab=vocab)
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(model_dir),
        AutoTokenizer.from_pretrained(model_dir),
    )
    reward = CausalLMLikelihoodReward(model, tokenizer)
    prompts, completions = ["What is 2+3?", "Name a colour."], ["It is 5, since 2+3=5.", "blue " * 30]
    watch = VocabRows(vocab)
    with watch:
        got = reward(prompts, completions)
    assert watch.most <= CHUNK_ELEMENTS // vocab
    want = []
    for prompt, completion in zip(prompts, completions, strict=True):
        p, c = reward._token_ids(prompt, completion)
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
        want.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).mean().item())
    assert got == pytest.approx(want, abs=1e-5)
    assert all(w < -5 for w in want)  # ~log(1/32768) = −10.4 for a random model
