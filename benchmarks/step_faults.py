"""A matrix cell's step stage by stage (rollout, reference, update) with each stage's wall clock, user and
kernel CPU time and minor page faults, from getrusage: where fresh memory is paged in, and what it costs.

    PYTHONPATH=src python benchmarks/step_faults.py --cell eos-off --steps 4 --threads 2

Runs the learner and the native engine as a run does (replay on, the default on a CPU), prints the medians
of steps 2.. (the first creates AdamW's state and the replay storage). For an A/B of allocator settings run
it once per setting in alternation: MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ in the environment make
grpo leave glibc's thresholds alone (model/memory.py).
"""

from __future__ import annotations

import argparse
import itertools
import resource
import statistics
import time

import torch
from common import matrix_learner

from grpo.model.replay import ReplayTape
from grpo.records import PromptBatch, SamplingParams
from grpo.rollout.native import NativeEngine
from grpo.stages import build_train_batch


def usage() -> tuple[float, float, float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime, float(r.ru_minflt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="eos-off")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cell, tok, prompts, policy, learner = matrix_learner(args.cell)
    engine = NativeEngine(policy, tok, compile_decode=False)
    engine.tape = learner.replay_tape = ReplayTape()
    sampling = SamplingParams(max_new_tokens=cell["completion"], temperature=1.0)
    steps = []
    for i in range(args.steps):
        engine.tape.arm()
        torch.manual_seed(i)
        marks = [usage()]
        rollouts = engine.generate(prompts, cell["G"], sampling)
        marks.append(usage())
        pb = PromptBatch(prompts=[""] * len(prompts), prompt_token_ids=prompts)
        adv = torch.randn(len(rollouts.group_ids), generator=torch.Generator().manual_seed(i))
        old = rollouts.sampling_logprobs
        batch = build_train_batch(pb, rollouts, adv, tok.pad_token_id, old_logprobs=old)
        batch.ref_logprobs = learner.reference_logprobs(batch)
        marks.append(usage())
        learner.train_step(batch)
        marks.append(usage())
        steps.append([[b - a for a, b in zip(x, y, strict=True)] for x, y in itertools.pairwise(marks)])
    later = steps[1:]
    parts = []
    for k, name in enumerate(("rollout", "reference", "update")):
        wall, user, sys_, faults = (statistics.median(s[k][j] for s in later) for j in range(4))
        parts.append(f"{name} wall {wall:.2f} s, user {user:.2f}, sys {sys_:.2f}, faults {faults / 1e3:.0f}k")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{args.cell}, {args.threads} threads: " + " | ".join(parts) + f" | peak RSS {peak} MB")


if __name__ == "__main__":
    main()
