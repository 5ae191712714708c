"""Real architectures with random weights, saved as from_pretrained directories (no hub access needed).

    # writes benchmarks/.cache/real/qwen2.5-0.5b
    PYTHONPATH=src .venv/bin/python scripts/build_real_model.py qwen2.5-0.5b
    PYTHONPATH=src .venv/bin/python scripts/build_real_model.py all --out /tmp/real

Importable: `from build_real_model import build, ARCHITECTURES` (tests add scripts/ to sys.path).

The configs are the published `config.json` numbers of each model (sources below); only the weights are
random (seeded). The tokenizer is the bundled tiny-math-lm BPE (640 tokens, with pad/eos and a chat
template), far SMALLER than the 128k/152k-row embedding — as in the real Qwen models, whose embedding has
151,936 rows for a 151,665-token tokenizer — so sampled ids beyond the tokenizer happen and must be
handled. Special-token ids in the config point at the tokenizer's own pad/eos.

Sources of the numbers (checked against public copies of the hub configs):
- Qwen2.5-0.5B: huggingface.co/Qwen/Qwen2.5-0.5B config.json (mirrored e.g. in rwth-i6/i6_experiments
  users/juanola/.../qwen2_configs.py): 24 layers, d 896, ffn 4864, 14 heads / 2 KV, QKV bias, tied,
  rope θ 1e6, vocab 151,936 → 494,032,768 parameters.
- Qwen3-0.6B: huggingface.co/Qwen/Qwen3-0.6B config.json: 28 layers, d 1024, ffn 3072, 16 heads / 8 KV,
  head_dim 128, q/k RMSNorm, no bias, tied, rope θ 1e6, vocab 151,936 → 596,049,920 parameters.
- Llama-3.2-1B: huggingface.co/meta-llama/Llama-3.2-1B config.json (mirrored in
  kevinstephano/thunder_model_blocks hf_llama/llama_config.py): 16 layers, d 2048, ffn 8192, 32 heads /
  8 KV, tied, rope θ 5e5 with llama3 scaling (factor 32, low 1, high 4, original 8192), vocab 128,256
  → 1,235,814,400 parameters.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_SOURCE = ROOT / "src" / "grpo" / "assets" / "tiny-math-lm"
DEFAULT_ROOT = ROOT / "benchmarks" / ".cache" / "real"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

ARCHITECTURES: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "max_window_layers": 24,
        "hidden_act": "silu",
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "hidden_act": "silu",
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}
PARAMS = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "llama-3.2-1b": 1_235_814_400}


def make_config(name: str, tokenizer, **overrides):
    """The transformers config of architecture `name`, special tokens taken from `tokenizer`."""
    from transformers import AutoConfig

    spec = dict(ARCHITECTURES[name], **overrides)
    kind = spec.pop("model_type")
    if "rope_scaling" in spec:  # transformers 5 folds θ and scaling into rope_parameters
        spec["rope_parameters"] = {"rope_theta": spec.pop("rope_theta"), **spec.pop("rope_scaling")}
    elif "rope_theta" in spec:
        spec["rope_parameters"] = {"rope_type": "default", "rope_theta": spec.pop("rope_theta")}
    return AutoConfig.for_model(
        kind,
        **spec,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def build(name: str, out: Path | str | None = None, seed: int = 0, **overrides) -> Path:
    """Save architecture `name` with random weights (and the small tokenizer) to `out`; returns `out`.

    `overrides` change config fields (tests shrink layers/width but keep the big vocabulary). A directory
    that already holds model.safetensors is reused when no overrides are given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out) if out is not None else DEFAULT_ROOT / name
    if not overrides and (out / "model.safetensors").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_SOURCE)
    config = make_config(name, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (TOKENIZER_SOURCE / f).exists():
            shutil.copy(TOKENIZER_SOURCE / f, out / f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=[*ARCHITECTURES, "all"])
    ap.add_argument("--out", type=Path, default=None, help="directory (one per model under it for 'all')")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = list(ARCHITECTURES) if args.name == "all" else [args.name]
    for name in names:
        out = None if args.out is None else (args.out / name if args.name == "all" else args.out)
        path = build(name, out, args.seed)
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
