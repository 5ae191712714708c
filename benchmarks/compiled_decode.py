"""The native engine's rollout with the decode step eager or hybrid (`generation.compile_decode`: the
compiled full-batch graph until rows finish, then the eager compacting step), A/B in one process,
interleaved.

    PYTHONPATH=src python benchmarks/compiled_decode.py --cell eos-off --repeats 3 --threads 1 --cpu-time

Workload: one rollout of a matrix cell (8 prompts × G rows, the cell's prompt length and completion
limit and eos rate), the matrix's random model, temperature 1. `--variants` picks what runs: `eager`,
`hybrid` (the default compiled graph; on a CPU with inductor's cpp_wrapper: its kernels called from
generated C++), `hybrid-py` (the same graph called from inductor's Python wrapper). A `+record` suffix
(`eager+record`, `hybrid+record`) arms replay's tape before each generate call, as a training step does
(`train.replay_rollout_forward`), so the rollout records each layer's products; its storage is kept from
call to call, as the trainer keeps it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import matrix_policy

from grpo.model.compiled import compile_report
from grpo.model.replay import ReplayTape
from grpo.records import SamplingParams
from grpo.rollout import native
from grpo.rollout.native import NativeEngine


def engine(variant: str, model, tok) -> NativeEngine:
    if variant.endswith("+record"):
        built = engine(variant.removesuffix("+record"), model, tok)
        built.tape = ReplayTape()
        return built
    if variant == "eager":
        return NativeEngine(model, tok)
    built = NativeEngine(model, tok, compile_decode=True)
    if variant == "hybrid-py":
        built._full_step = torch.compile(native._full_batch_step, options=native._INDUCTOR)
    elif variant != "hybrid":
        raise SystemExit(f"--variants: unknown {variant!r} (eager, hybrid, hybrid-py, each +record)")
    return built


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="eos-off")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default="eager,hybrid", help="eager, hybrid, hybrid-py (+record)")
    ap.add_argument("--cpu-time", action="store_true", help="the process's CPU time (use with --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    cell, tok, prompts, model = matrix_policy(args.cell)
    variants = args.variants.split(",")
    engines = {v: engine(v, model, tok) for v in variants}
    sampling = SamplingParams(max_new_tokens=cell["completion"], temperature=1.0, top_k=0, top_p=1.0)
    tokens = {v: [] for v in variants}

    @torch.no_grad()
    def generate(variant: str, seed: int) -> float:
        torch.manual_seed(seed)
        tape = engines[variant].tape
        start = clock()
        if tape is not None:
            tape.arm()
        out = engines[variant].generate(prompts, cell["G"], sampling)
        if tape is not None:
            assert tape.take() is not None, "the recording did not fit its budget"
        tokens[variant].append(int(out.completion_mask.sum()))
        return clock() - start

    for v in variants:  # first calls: compilation (its wall time), warm-up
        start = time.perf_counter()
        generate(v, 0)
        wall = time.perf_counter() - start
        print(f"cell {args.cell}; first {v} generate {wall:.1f} s wall; {compile_report()}")
    times = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants if r % 2 == 0 else variants[::-1]:
            times[v].append(generate(v, r + 1))
    print(f"after the repeats: {compile_report()}")
    for v, values in times.items():
        print(
            f"| {v} | {statistics.median(values):.3f} s per generate | {[round(x, 3) for x in values]} | "
            f"tokens {tokens[v][1:]} |"
        )


if __name__ == "__main__":
    main()
