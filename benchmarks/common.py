"""What the TRL and grpo benchmark runs share: the model, prompts, reward, workloads and FLOP count.

Imported by both sides (the TRL venv and ours), so it depends on torch + transformers only.
"""

from __future__ import annotations

import json
import random
import resource
import time
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


# Every matrix run's RESULT is also appended here, so an interrupted matrix keeps what it measured
# (benchmarks/matrix.py --from-runs builds the table from it).
MATRIX_RUNS = HERE / "results" / "matrix_runs.jsonl"


def emit(result: dict, log: Path | None = None) -> None:
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(json.dumps({**result, "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")


# -- the workload matrix (benchmarks/matrix.py) ---------------------------------------------------------
# A base cell and one-factor-at-a-time variations of it (a full factorial of the issue's axes is
# 2·3·3·3·2·2 = 216 cells, days on two cores). Only the workload is fixed; every other setting is each
# library's default.
MATRIX_PROMPTS = 8  # prompts per optimizer step
# The learning rate changes no cost, but it can change the workload: Adam's first steps move every
# weight by ±lr, and on the eos-rate model (make_matrix_model) 1e-6 already lengthens TRL's
# completions by 40% within 3 steps (its schedule starts at full rate; grpo's warms up). At 1e-7 the
# lengths stay put on both sides.
MATRIX_LEARNING_RATE = 1e-7
MATRIX_BASE = {"eos": True, "prompt": 64, "completion": 128, "G": 8, "beta": 0.04, "chat": False}
MATRIX_VARIATIONS = {
    "base": {},
    "eos-off": {"eos": False},
    "prompt-8": {"prompt": 8},
    "prompt-256": {"prompt": 256},
    "completion-32": {"completion": 32},
    "completion-512": {"completion": 512},
    "G-4": {"G": 4},
    "G-16": {"G": 16},
    "beta-0": {"beta": 0.0},
    "chat": {"chat": True},
}
# With eos on, a row ends at each step with this probability times 1 / the completion limit: lengths are
# geometric with mean ≈ limit / 4, and the longest of 64 rows usually reaches the limit, the ragged case.
EOS_RATE_TIMES_LIMIT = 4.0
MATRIX_MAX_POSITIONS = 1024  # 256-token chat prompts + 512 new tokens fit


def matrix_cell(name: str) -> dict:
    return {**MATRIX_BASE, **MATRIX_VARIATIONS[name]}


def _eos_margin(model, eos: int, ids) -> float:
    """Mean over positions of logit(eos) − logsumexp(other logits): eos's log-odds."""
    import torch

    with torch.no_grad():
        logits = model(ids).logits.float()  # [B, S, V]
    others = torch.cat([logits[..., :eos], logits[..., eos + 1 :]], -1)
    return float((logits[..., eos] - others.logsumexp(-1)).mean())


def make_matrix_model(eos: bool, completion: int) -> Path:
    """The benchmark model with a controlled eos rate, saved once per rate (same architecture and size).

    The random model's logits are nearly uniform, so eos would come at ~1/640 per token. To make eos
    a workload knob, one embedding column is set to a constant for every token: after the final RMSNorm
    it is the same large value at every position, so (tied embeddings) a token's logit is shifted by
    that value times its own entry in the column. Giving eos's entry an offset δ moves eos's log-odds by
    a fixed amount at every position; δ is calibrated on random sequences. eos off: a large negative
    offset, so rows always run to the limit.
    """
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rate = EOS_RATE_TIMES_LIMIT / completion if eos else 0.0
    out = HERE / ".cache" / (f"qwen2-4.9m-eos{rate:.5f}" if eos else "qwen2-4.9m-noeos")
    if (out / "model.safetensors").exists():
        return out
    base = make_model()
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, max_position_embeddings=MATRIX_MAX_POSITIONS
    )
    emb = model.get_input_embeddings().weight
    # 1.0 against the embedding's 0.02 spread: the column dominates every hidden state's norm, so its
    # normalised value, and with it the eos rate, is nearly the same at every position (at 0.1 the rate
    # varies 50× between positions and lengths come out bimodal).
    eos_id, column, constant = tok.eos_token_id, 0, 1.0
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        emb[:, column] = constant
    if not eos:
        with torch.no_grad():
            emb[eos_id, column] = constant - 4.0
    else:
        target = math.log(rate / (1 - rate))  # log-odds of eos against all other tokens together
        for _ in range(4):  # Newton steps on δ: the margin is ~linear in it (slope = the column's value)
            margin = _eos_margin(model, eos_id, ids)
            with torch.no_grad():
                h = model.model(ids).last_hidden_state[..., column].mean()
                emb[eos_id, column] += (target - margin) / float(h)
    margin = _eos_margin(model, eos_id, ids)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "eos.json").write_text(json.dumps({"eos_rate": rate, "log_odds": margin}))
    return out


def matrix_tokenizer(path: Path, chat: bool):
    """The model's tokenizer; with chat, the bundled tiny-math chat template on it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = (TOKENIZER_SOURCE / "chat_template.jinja").read_text() if chat else None
    return tok


def matrix_rows(tokenizer, cell: dict, steps: int) -> list[dict]:
    """Prompts of exactly cell["prompt"] tokens (before any chat template); chat: one user message each."""
    texts = make_prompts(tokenizer, cell["prompt"], MATRIX_PROMPTS * steps)
    if cell["chat"]:
        return [{"prompt": [{"role": "user", "content": t}]} for t in texts]
    return [{"prompt": t} for t in texts]


def vowel_share(prompts, completions, **_columns) -> list[float]:
    """vowel_reward on text or on chat completions (a list of messages, TRL's conversational form)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return vowel_reward(prompts, texts)


def vm_hwm_mb() -> float:
    """Peak resident set (VmHWM) of this process, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return peak_rss_mb()


def matrix_policy(name: str):
    """A matrix cell's workload for the rollout benchmarks (compiled_decode.py, decode_ops.py,
    matrix_ragged.py): the cell, its tokenizer, its prompts' token ids, and a float32 model loaded from the
    cell's model."""
    import torch
    from transformers import AutoModelForCausalLM

    cell = matrix_cell(name)
    path = make_matrix_model(cell["eos"], cell["completion"])
    tok = matrix_tokenizer(path, False)
    texts = make_prompts(tok, cell["prompt"], MATRIX_PROMPTS)
    prompts = [tok(x, add_special_tokens=False)["input_ids"] for x in texts]
    return cell, tok, prompts, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def matrix_pair(name: str):
    """`matrix_policy` with a float32 reference too, for the stage benchmarks (compiled_step.py,
    replay_step.py): the cell, its tokenizer, its prompts' token ids, the policy and the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    cell, tok, prompts, policy = matrix_policy(name)
    path = make_matrix_model(cell["eos"], cell["completion"])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return cell, tok, prompts, policy, reference


def matrix_learner(name: str, **config):
    """`matrix_pair`'s workload with a `Learner` over its models, as the stage benchmarks build it (the cell's
    G, completion limit and β, 8 prompts, learning rate 1e-7; `config`: more GRPOConfig arguments): the cell,
    tokenizer, prompts' ids, policy and learner."""
    from grpo.config import GRPOConfig
    from grpo.learner import Learner

    cell, tok, prompts, policy, reference = matrix_pair(name)
    cfg = GRPOConfig(
        batch_size=MATRIX_PROMPTS,
        num_generations=cell["G"],
        max_new_tokens=cell["completion"],
        beta=cell["beta"],
        learning_rate=1e-7,
        **config,
    ).validate()
    return cell, tok, prompts, policy, Learner(policy, reference, cfg, total_optimizer_steps=1000)
