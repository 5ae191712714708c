"""The native rollout with grpo's CPU decode ops (grpo/kernels) against PyTorch's ops, interleaved in one
process, recording as a training step with replay does.

    PYTHONPATH=src python benchmarks/decode_ops.py --cell eos-off --repeats 7

Both sides draw from the same seed: the script says whether they sampled the same tokens and how far
their log-probs are apart, then the median wall time of a `generate` call for each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import matrix_policy

from grpo import kernels
from grpo.model.replay import ReplayTape
from grpo.records import SamplingParams
from grpo.rollout.native import NativeEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="eos-off")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if kernels.cpu_ops() is None:
        raise SystemExit(f"grpo's CPU ops are not available: {kernels.why_unavailable()}")
    cell, tok, prompts, model = matrix_policy(args.cell)
    engine = NativeEngine(model, tok)
    engine.tape = ReplayTape()
    sampling = SamplingParams(max_new_tokens=cell["completion"], temperature=1.0, top_k=0, top_p=1.0)

    @torch.no_grad()
    def generate(side: str, seed: int):
        os.environ["GRPO_CPU_KERNELS"] = "1" if side == "grpo ops" else "0"
        torch.manual_seed(seed)
        start = time.perf_counter()
        engine.tape.arm()
        out = engine.generate(prompts, cell["G"], sampling)
        engine.tape.take()
        return time.perf_counter() - start, out

    sides = ["pytorch ops", "grpo ops"]
    first = {side: generate(side, 0)[1] for side in sides}
    a, b = (first[s] for s in sides)
    same = torch.equal(a.completion_ids, b.completion_ids)
    gap = (a.sampling_logprobs - b.sampling_logprobs).abs().max().item() if same else float("nan")
    print(f"cell {args.cell}: same tokens {same}; largest log-prob difference {gap:.2e}")
    times = {side: [] for side in sides}
    for r in range(args.repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            times[side].append(generate(side, r + 1)[0])
    for side, values in times.items():
        runs = [round(x, 3) for x in values]
        print(f"| {side} | {statistics.median(values):.3f} s per generate | {runs} |")


if __name__ == "__main__":
    main()
