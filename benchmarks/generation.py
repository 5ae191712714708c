"""Generation alone: the native engine vs `transformers` `generate`, same model, batch, lengths, sampling.

    PYTHONPATH=src python benchmarks/generation.py --prompt-tokens 6 --new-tokens 256 --repeats 5

8 prompts × 8 completions, temperature 1, no top-k/top-p, eos suppressed on both sides so every row
generates exactly --new-tokens tokens. Runs alternate between the two engines; prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import GENERATIONS, PROMPTS, make_model, make_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.records import SamplingParams
from grpo.rollout.native import NativeEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = make_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every row runs to the full length on both sides
    texts = make_prompts(tok, args.prompt_tokens, PROMPTS)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    engine = NativeEngine(model, tok)
    engine.eos_ids = torch.tensor([-1])
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_k=0, top_p=1.0)

    def hf() -> int:
        out = model.generate(
            **batch,
            do_sample=True,
            num_return_sequences=GENERATIONS,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=tok.pad_token_id,
        )
        return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]

    def native() -> int:
        return int(engine.generate(prompts, GENERATIONS, sampling).completion_mask.sum())

    runs = {"transformers generate": [], "grpo native": []}
    with torch.no_grad():
        hf(), native()  # warm-up
        for _ in range(args.repeats):
            for name, fn in (("transformers generate", hf), ("grpo native", native)):
                start = time.perf_counter()
                tokens = fn()
                runs[name].append(tokens / (time.perf_counter() - start))
    rows = PROMPTS * GENERATIONS
    print(
        f"\nGeneration, {PROMPTS}×{GENERATIONS} rows, {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens, {args.threads} thread(s); median of {args.repeats}\n"
    )
    print("| engine | tokens/s | ms per decode step | speed-up |\n|---|---|---|---|")
    base = statistics.median(runs["transformers generate"])
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"| {name} | {med:,.0f} | {1000 * rows / med:.2f} | {med / base:.2f}× |")


if __name__ == "__main__":
    main()
