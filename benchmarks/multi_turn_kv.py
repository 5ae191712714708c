"""Multi-turn rollout on the native engine with each row's K/V kept between turns (model/turn_kv.py) or
every turn prefilling the whole conversation again, A/B in one process, interleaved, same seeds.

    PYTHONPATH=src python benchmarks/multi_turn_kv.py --workload tiny_tools --repeats 5 --threads 1 --cpu-time
    PYTHONPATH=src python benchmarks/multi_turn_kv.py --workload synthetic --repeats 5 --threads 1 --cpu-time

tiny_tools: one step's episodes of `grpo train --config tiny_tools` (the preset's runner, 16 prompts × 8,
up to 4 turns, the bundled tiny-tools-lm at its base weights, temperature 1), a new batch of prompts each
repeat; both arms sample the same episodes (same seed; checked). synthetic: 4 turns of 64 rows (8 prompts
× 8) on the matrix's random model with eos off: a 128-token prompt, 64 sampled tokens a turn, then 32
injected ids, so a turn-4 row is 128 + 3·96 = 416 positions of which 96 are new.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpo.model.turn_kv import TurnCache
from grpo.records import PromptBatch, SamplingParams
from grpo.rollout.native import NativeEngine


def tiny_tools():
    """(run(reuse, seed, repeat) → sampled ids, description)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config import load_config
    from grpo.data.prompts import PromptFormatter
    from grpo.data.sources import load_rows
    from grpo.model.loading import resolve_path
    from grpo.rollout.episodes import build_episodes

    cfg = load_config("tiny_tools")
    path = resolve_path(cfg.model.name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok)
    runner = build_episodes(cfg, PromptFormatter(tok, cfg.data))
    rows = load_rows(cfg.data.dataset, cfg.data)
    p, g, gen = cfg.train.prompts_per_step, cfg.generation.num_generations, cfg.generation
    sampling = SamplingParams(cfg.effective_max_new_tokens, gen.temperature, gen.top_k, gen.top_p)
    turns = []

    def run(reuse: bool, seed: int, repeat: int):
        part = rows[repeat * p : (repeat + 1) * p]
        batch = PromptBatch(
            prompts=[r["prompt"] for r in part],
            prompt_token_ids=[[] for _ in part],
            columns={"answer": [r["answer"] for r in part]},
            indices=list(range(len(part))),
        )
        runner.reuse_kv = reuse
        torch.manual_seed(seed)
        _, out = runner.run(engine, batch, g, sampling)
        if reuse:
            turns.append(sum(e.turns for e in out.episodes) / len(out.episodes))
        return out.completion_ids

    return run, lambda: f"{p} prompts × {g}; mean turns per episode {[round(t, 2) for t in turns]}"


def synthetic(prompt: int = 128, sampled: int = 64, injected: int = 32, turns: int = 4):
    from common import MATRIX_PROMPTS, make_matrix_model, make_prompts, matrix_tokenizer
    from transformers import AutoModelForCausalLM

    path = make_matrix_model(False, sampled)
    tok = matrix_tokenizer(path, False)
    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok)
    prompts = [
        tok(x, add_special_tokens=False)["input_ids"] for x in make_prompts(tok, prompt, MATRIX_PROMPTS)
    ]
    g, sampling = 8, SamplingParams(max_new_tokens=sampled, temperature=1.0, top_k=0, top_p=1.0)
    note = tok(" the tool says: 42", add_special_tokens=False)["input_ids"]
    inject = (note * injected)[:injected]  # the same ids appended after every turn

    def run(reuse: bool, seed: int, repeat: int):
        del repeat
        torch.manual_seed(seed)
        cache = TurnCache() if reuse else None
        keys = list(range(len(prompts) * g))
        kv = {"kv": cache.bind(keys)} if reuse else {}
        out = engine.generate(prompts, g, sampling, **kv)
        rows = [prompts[k // g] + out.completion_ids[k].tolist() for k in keys]
        for _ in range(turns - 1):
            rows = [r + inject for r in rows]
            out = engine.continue_rows(rows, sampling, **({"kv": cache.bind(keys)} if reuse else {}))
            rows = [r + out.completion_ids[k].tolist() for k, r in enumerate(rows)]
        return torch.tensor(rows)

    return (
        run,
        lambda: (
            f"{len(prompts)} prompts × {g}, {turns} turns: prompt {prompt}, "
            f"{sampled} sampled + {injected} injected a turn"
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["tiny_tools", "synthetic"], default="tiny_tools")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true", help="the process's CPU time (use with --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    run, describe = tiny_tools() if args.workload == "tiny_tools" else synthetic()
    run(True, 0, 0)  # warm-up: first-call allocations and the oneDNN weight layouts
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeats):
        ids = {}
        for reuse in (True, False) if r % 2 == 0 else (False, True):
            start = clock()
            ids[reuse] = run(reuse, r + 1, r)
            times[reuse].append(clock() - start)
        same = torch.equal(ids[True], ids[False])
        print(f"repeat {r}: reuse {times[True][-1]:.3f} s, prefill {times[False][-1]:.3f} s, same ids {same}")
    print(f"workload {args.workload}: {describe()}")
    base, new = statistics.median(times[False]), statistics.median(times[True])
    print(f"| whole conversation prefilled every turn | {base:.3f} s per rollout (median) |")
    print(f"| K/V kept between turns | {new:.3f} s per rollout (median) | {base / new:.2f}× |")


if __name__ == "__main__":
    main()
