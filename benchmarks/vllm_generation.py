"""Generation alone: vLLM vs the native engine vs `transformers` `generate`, same model, batch, settings.

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm_generation.py \
        --prompt-tokens 6 --new-tokens 128 --repeats 5

8 prompts × 8 completions of the random 4.9M-parameter benchmark model (benchmarks/common.py), float32,
temperature 1, no top-k/top-p, eos ignored everywhere so every row generates exactly --new-tokens tokens.
vLLM runs in-process (the engine `generation.engine=vllm` builds), one request per prompt with n = 8,
log-probs of the sampled tokens returned as in training. The three engines run in turn, --repeats times
(interleaved, so drift in the machine's speed hits all three alike); prints medians and ratios.
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
from grpo.rollout.vllm import VLLMEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = make_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    texts = make_prompts(tok, args.prompt_tokens, PROMPTS)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    native_engine = NativeEngine(model, tok)
    native_engine.eos_ids = torch.tensor([-1])
    start = time.perf_counter()
    vllm_engine = VLLMEngine(model, tok)
    startup = time.perf_counter() - start
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_k=0, top_p=1.0)
    import vllm

    vllm_params = vllm.SamplingParams(
        n=GENERATIONS,
        max_tokens=args.new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        logprobs=1,
        ignore_eos=True,
        detokenize=False,
    )

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
        return int(native_engine.generate(prompts, GENERATIONS, sampling).completion_mask.sum())

    def with_vllm() -> int:
        threads = torch.get_num_threads()
        outs = vllm_engine.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], vllm_params, use_tqdm=False
        )
        torch.set_num_threads(threads)
        # As after a weight sync in training: no prompt reuse across calls.
        vllm_engine.llm.reset_prefix_cache()
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    engines = {"transformers generate": hf, "grpo native": native, "vLLM (in-process)": with_vllm}
    runs: dict[str, list[float]] = {name: [] for name in engines}
    with torch.no_grad():
        for fn in engines.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in engines.items():
                start = time.perf_counter()
                tokens = fn()
                assert tokens == PROMPTS * GENERATIONS * args.new_tokens, (name, tokens)
                runs[name].append(tokens / (time.perf_counter() - start))
    print(
        f"\nGeneration, {PROMPTS}×{GENERATIONS} rows, {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens, {args.threads} thread(s); median of {args.repeats} interleaved runs; "
        f"vLLM start-up {startup:.1f} s (not in the table)\n"
    )
    print("| engine | tokens/s | runs (tokens/s) | vs transformers | vs native |\n|---|---|---|---|---|")
    base, native_median = (statistics.median(runs[k]) for k in ("transformers generate", "grpo native"))
    for name, values in runs.items():
        med = statistics.median(values)
        print(
            f"| {name} | {med:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {med / base:.2f}× | "
            f"{med / native_median:.2f}× |"
        )
    vllm_engine.close()


if __name__ == "__main__":
    main()
