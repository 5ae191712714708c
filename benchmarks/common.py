"""What the TRL and grpo benchmark runs share: the model, prompts, reward, workloads and FLOP count.

Imported by both sides (the TRL venv and ours), so it depends on torch + transformers only.
"""

from __future__ import annotations

import json
import random
import resource
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / ".cache" / "qwen2-4.9m"
TOKENIZER_SOURCE = HERE.parent / "src" / "grpo" / "assets" / "tiny-math-lm"

PROMPTS, GENERATIONS, BETA, TEMPERATURE, LEARNING_RATE = 8, 8, 0.04, 1.0, 1e-5
WORKLOADS = {  # name: (prompt tokens, new tokens)
    "a": (6, 32),
    "b": (6, 256),
    "c": (128, 128),
}
# A Qwen2-style decoder (GQA, q/k/v bias, tied embeddings) of 4.9M parameters on a 640-token vocabulary.
MODEL_CONFIG = {
    "vocab_size": 640,
    "hidden_size": 256,
    "intermediate_size": 976,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}


def param_count(c: dict = MODEL_CONFIG) -> int:
    """Parameters of MODEL_CONFIG (tied embeddings counted once): 4,900,096."""
    d, hd = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    attention = (d * d + d) + 2 * (d * kv + kv) + d * d
    layer = attention + 3 * d * c["intermediate_size"] + 2 * d
    return c["vocab_size"] * d + c["num_hidden_layers"] * layer + d


def make_model() -> Path:
    """Random-initialised Qwen2 model + the bundled tokenizer (chat template removed), saved once."""
    if (MODEL_DIR / "model.safetensors").exists():
        return MODEL_DIR
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(TOKENIZER_SOURCE)
    tok.chat_template = None  # plain-text prompts on both sides: no template differences
    cfg = Qwen2Config(
        **MODEL_CONFIG, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None
    )
    model = Qwen2ForCausalLM(cfg)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL_DIR)
    tok.save_pretrained(MODEL_DIR)
    (MODEL_DIR / "chat_template.jinja").unlink(missing_ok=True)
    return MODEL_DIR


def make_prompts(tokenizer, prompt_tokens: int, count: int, seed: int = 0) -> list[str]:
    """`count` distinct texts that tokenize to exactly `prompt_tokens` tokens (words of one token each)."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words = [t[1:] for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2]
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        text = " ".join(rng.choice(words) for _ in range(prompt_tokens))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) > prompt_tokens:
            text = text.rsplit(" ", 1)[0]
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == prompt_tokens and text not in prompts:
            prompts.append(text)
    return prompts


def dataset_rows(tokenizer, workload: str, steps: int) -> list[dict]:
    prompt_tokens, _ = WORKLOADS[workload]
    return [{"prompt": p} for p in make_prompts(tokenizer, prompt_tokens, PROMPTS * steps)]


def vowel_reward(prompts, completions, **kwargs) -> list[float]:
    """Share of characters that are vowels: cheap, deterministic, and varies across a group."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def text_length(prompts, completions, **kwargs) -> list[float]:
    """Characters of each completion / 10 (chat messages or strings): a random real-size model's samples
    decode to few characters (most ids lie past the small tokenizer), and this still varies in a group."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 10 for t in texts]


def step_flops(
    params: int, layers: int, attn_dim: int, prompt_len: int, completion_lens: list[int], groups: int
) -> float:
    """FLOPs a GRPO step must do: generation (prefill once per group + one forward per generated token),
    the reference forward and the policy forward+backward (6N per token), with attention.

    Matmul FLOPs: 2·N per token forward (N counts the tied embedding once, as the LM head). Attention:
    4·d_attn·(context) per token per layer forward (QKᵀ and PV); backward ×2. Every prompt is counted
    once per group, the least work the step needs, for TRL and grpo alike.
    """

    def attention(prefix: int, n: int) -> float:  # tokens at positions prefix … prefix+n−1, causal
        return 4.0 * attn_dim * layers * (n * prefix + n * (n + 1) / 2)

    tokens = groups * prompt_len + sum(completion_lens)
    attn = groups * attention(0, prompt_len) + sum(attention(prompt_len, t) for t in completion_lens)
    generation = 2.0 * params * tokens + attn
    reference = 2.0 * params * tokens + attn
    policy = 6.0 * params * tokens + 3 * attn
    return generation + reference + policy


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)
