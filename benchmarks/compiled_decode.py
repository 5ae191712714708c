"""The native engine's rollout with the decode step eager (the default) or compiled with static KV
shapes (`generation.compile_decode`), A/B in one process, interleaved.

    PYTHONPATH=src python benchmarks/compiled_decode.py --cell eos-off --repeats 3 --threads 1 --cpu-time

Workload: one rollout of a matrix cell (8 prompts × G rows, the cell's prompt length and completion
limit and eos rate), the matrix's random model, temperature 1. The compiled step attends over the whole
preallocated cache with the unwritten columns masked and keeps finished rows (the eager step drops
them once 1/8 have finished), so on ragged cells it does more arithmetic for less per-op overhead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import MATRIX_PROMPTS, make_matrix_model, make_prompts, matrix_cell, matrix_tokenizer
from transformers import AutoModelForCausalLM

from grpo.model.compiled import compile_report
from grpo.records import SamplingParams
from grpo.rollout.native import NativeEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="eos-off")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true", help="the process's CPU time (use with --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    cell = matrix_cell(args.cell)
    path = make_matrix_model(cell["eos"], cell["completion"])
    tok = matrix_tokenizer(path, False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [
        tok(x, add_special_tokens=False)["input_ids"]
        for x in make_prompts(tok, cell["prompt"], MATRIX_PROMPTS)
    ]
    engines = {False: NativeEngine(model, tok), True: NativeEngine(model, tok, compile_decode=True)}
    sampling = SamplingParams(max_new_tokens=cell["completion"], temperature=1.0, top_k=0, top_p=1.0)
    tokens = {False: [], True: []}

    @torch.no_grad()
    def generate(compiled: bool, seed: int) -> float:
        torch.manual_seed(seed)
        start = clock()
        out = engines[compiled].generate(prompts, cell["G"], sampling)
        tokens[compiled].append(int(out.completion_mask.sum()))
        return clock() - start

    start = time.perf_counter()
    generate(True, 0)
    print(
        f"cell {args.cell}; first compiled generate {time.perf_counter() - start:.1f} s wall; "
        f"{compile_report()}"
    )
    generate(False, 0)
    times = {False: [], True: []}
    for r in range(args.repeats):
        for compiled in (False, True) if r % 2 == 0 else (True, False):
            times[compiled].append(generate(compiled, r + 1))
    print(f"after the repeats: {compile_report()}")
    for compiled, values in times.items():
        name = "compiled, static KV shape" if compiled else "eager (default)"
        print(
            f"| {name} | {statistics.median(values):.3f} s per generate | {[round(v, 3) for v in values]} | "
            f"tokens {tokens[compiled][1:]} |"
        )


if __name__ == "__main__":
    main()
