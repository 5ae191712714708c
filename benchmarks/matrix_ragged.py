"""Ragged (eos-ended) work in isolation, A/B in one process: generation with finished rows dropped at
different thresholds, and the packed training forward+backward: the grid attention route with and
without skipping the padding after short rows, and the packed attention route (the CPU default).

    PYTHONPATH=src python benchmarks/matrix_ragged.py --repeats 3 --threads 1 --cpu-time

Workload: the matrix's base cell (common.MATRIX_BASE): 8 prompts of 64 tokens × 8 completions of at
most 128 tokens, eos at 4/128 per token (lengths geometric, mean ≈ 30); training: one default
micro-batch (16 rows, 2 groups) of such completions. Variants alternate within each repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import matrix_policy

from grpo.model import shared_prompt
from grpo.model.decoder import NativeDecoder, pack_shared_prompts
from grpo.model.packed import ChunkedTokenLogprobs
from grpo.records import SamplingParams
from grpo.rollout import native

CLOCK = time.perf_counter


def timed(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time, not the wall clock: on a machine shared with other jobs "
        "and with --threads 1 it counts this process's work only",
    )
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    cell, tok, prompts, model = matrix_policy("base")
    engine = native.NativeEngine(model, tok)
    sampling = SamplingParams(max_new_tokens=cell["completion"], temperature=1.0, top_k=0, top_p=1.0)

    # Generation: drop finished rows at the default threshold, at every finish, or never.
    fractions = {"drop at 1/8 finished (default)": native._COMPACT_FRACTION, "drop at every finish": 1}
    fractions["never drop"] = 10**9
    gen: dict[str, list[float]] = {k: [] for k in fractions}
    tokens: list[int] = []

    def generate(fraction: int) -> None:
        native._COMPACT_FRACTION = fraction
        torch.manual_seed(len(tokens))
        out = engine.generate(prompts, cell["G"], sampling)
        tokens.append(int(out.completion_mask.sum()))

    # Training: one micro-batch of 2 groups × 8 rows, lengths from the same eos rate.
    g = torch.Generator().manual_seed(0)
    rate = 4.0 / cell["completion"]
    lengths = (torch.distributions.Geometric(probs=torch.tensor(rate)).sample((16,)) + 1).clamp(
        max=cell["completion"]
    )
    completions = [torch.randint(2, 640, (int(n),), generator=g).tolist() for n in lengths]
    pack = pack_shared_prompts(prompts[:2], [0] * 8 + [1] * 8, completions, cell["completion"], model.device)
    dec = NativeDecoder(model)
    real = pack.input_lengths

    grid_route = shared_prompt.attention_route

    def train(skip_padding: bool | None) -> None:
        """None: the packed attention (the CPU default); else the grid route, skipping padding or not."""
        shared_prompt.attention_route = grid_route if skip_padding is None else (lambda _device: "gqa")
        pack.input_lengths = real if skip_padding in (None, True) else [pack.input_width] * pack.num_rows
        model.zero_grad()
        hidden = dec.shared_prompt_hidden(pack)
        logp, _ = ChunkedTokenLogprobs.apply(hidden, dec.lm_head_weight, pack.targets, 1.0, False)
        logp.sum().backward()

    train_t = {
        "grid attention over every row": [],
        "grid attention skips rows past their end": [],
        "packed attention (model/packed_attention.py)": [],
    }
    with torch.no_grad():
        generate(8)  # warm-up
    train(True)
    for _ in range(args.repeats):
        with torch.no_grad():
            for name, fraction in fractions.items():
                gen[name].append(timed(lambda f=fraction: generate(f)))
        for name, skip in zip(train_t, (False, True, None), strict=True):
            train_t[name].append(timed(lambda s=skip: train(s)))
    print(
        f"threads {torch.get_num_threads()}, {'CPU' if args.cpu_time else 'wall'} time; generation: 64 rows, "
        f"{statistics.median(tokens[1:]):.0f} "
        f"tokens per call (median); training: 16 rows, lengths {sorted(int(x) for x in lengths)}"
    )
    for name, times in {**gen, **train_t}.items():
        print(f"| {name} | {statistics.median(times) * 1000:.0f} ms | {[round(t * 1000) for t in times]} |")


if __name__ == "__main__":
    main()
