"""The training passes (reference forward + update) with the native block eager or compiled, A/B in one
process, interleaved; prints the compile time, the graphs compiled and the medians.

    PYTHONPATH=src python benchmarks/compiled_step.py --cell eos-off --repeats 5

Workload: one step's TrainBatch of a matrix cell (8 prompts × G completions, the cell's prompt length;
completion lengths: every row at the limit with eos off, else geometric with mean limit/4 as the matrix
model's eos rate gives), the matrix's random model, β 0.04, the learner's default micro-batches. Each
repeat runs the eager pass and the compiled pass in alternating order. `--compare attention` runs the
grid attention route against the packed one instead (model/packed_attention.py):

    PYTHONPATH=src python benchmarks/compiled_step.py --cell eos-off --compare attention --cpu-time
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import matrix_learner

from grpo.model import shared_prompt
from grpo.model.compiled import compile_report
from grpo.records import TrainBatch


def step_batch(cell: dict, prompts: list[list[int]], seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    n, t, lp = len(prompts) * cell["G"], cell["completion"], max(len(p) for p in prompts)
    if cell["eos"]:
        lengths = torch.distributions.Geometric(probs=torch.tensor(4.0 / t)).sample((n,)) + 1
        lengths = lengths.clamp(max=t).long().tolist()
    else:
        lengths = [t] * n
    ids = torch.zeros(n, lp + t, dtype=torch.long)
    attn = torch.zeros(n, lp + t, dtype=torch.long)
    mask = torch.zeros(n, t)
    for i in range(n):
        p = prompts[i // cell["G"]]
        ids[i, lp - len(p) : lp] = torch.tensor(p)
        ids[i, lp : lp + lengths[i]] = torch.randint(2, 600, (lengths[i],), generator=g)
        attn[i, lp - len(p) : lp + lengths[i]] = 1
        mask[i, : lengths[i]] = 1
    adv = torch.randn(n, 1, generator=g) * mask
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        prompt_width=lp,
        completion_mask=mask,
        advantages=adv,
        group_ids=torch.arange(n) // cell["G"],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="eos-off")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time: on a shared machine with --threads 1 it counts this "
        "process's work only",
    )
    ap.add_argument("--profile", action="store_true", help="after the repeats: top ops of one step each way")
    ap.add_argument(
        "--compare",
        choices=["compile", "attention"],
        default="compile",
        help="compile: the block eager against compiled; attention: the grid attention route against the "
        "packed one (model/packed_attention.py), both with the block as --attention-blocks says",
    )
    ap.add_argument("--attention-blocks", choices=["eager", "compiled"], default="compiled")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    cell, _tok, prompts, _policy, learner = matrix_learner(args.cell)
    decoders = [learner.policy_forward.decoder, learner.reference_forward.decoder]

    grid_route = shared_prompt.attention_route

    def run(variant: bool, batch: TrainBatch) -> tuple[float, float]:
        if args.compare == "attention":  # variant: the packed route
            compiled = args.attention_blocks == "compiled"
            route = "packed" if variant else "gqa"
            shared_prompt.attention_route = lambda _device: route
        else:
            compiled = variant
            shared_prompt.attention_route = grid_route
        for d in decoders:
            d.compile_blocks = compiled
        start = clock()
        batch.ref_logprobs = learner.reference_logprobs(batch)
        mid = clock()
        learner.train_step(batch)
        return mid - start, clock() - mid

    batch = step_batch(cell, prompts, 0)
    slices = learner.micro_slices(batch)
    print(
        f"cell {args.cell}: {len(batch)} rows, {int(batch.completion_mask.sum())} completion tokens, "
        f"{len(slices)} micro-batches of ≤ {learner.micro_batch_tokens} tokens; "
        f"threads {torch.get_num_threads()}, {'CPU' if args.cpu_time else 'wall'} time"
    )
    start = time.perf_counter()
    run(True, batch)
    first = time.perf_counter() - start
    report = compile_report()
    print(f"first compiled step {first:.1f} s; {report}")
    run(False, batch)
    times = {False: [], True: []}
    for r in range(args.repeats):
        batch = step_batch(cell, prompts, r + 1)
        for compiled in (False, True) if r % 2 == 0 else (True, False):
            times[compiled].append(run(compiled, batch))
    after = compile_report()
    print(
        f"after the repeats: compile {after['compile_s']} s, {after['graphs']} graphs (new: "
        f"{after['graphs'] - report['graphs']})"
    )
    names = (
        {False: "grid attention", True: "packed attention"}
        if args.compare == "attention"
        else {False: "eager", True: "compiled"}
    )
    for compiled, values in times.items():
        ref = statistics.median(v[0] for v in values)
        upd = statistics.median(v[1] for v in values)
        print(
            f"| {names[compiled]} | reference {ref:.3f} s | update {upd:.3f} s | "
            f"{[(round(a, 2), round(b, 2)) for a, b in values]} |"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for compiled in (False, True):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(compiled, batch)
            print(f"## {names[compiled]}: ops by self CPU time")
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
                )
            )


if __name__ == "__main__":
    main()
