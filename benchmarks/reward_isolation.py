"""What a reward call costs in a forked child (algorithm.reward_isolation=process) against in-process.

    python benchmarks/reward_isolation.py [--model Qwen/...]   # default: the bundled tiny model

Loads a policy first, so the fork copies a trainer-sized address space, then times score_completions on a
trivial reward (the overhead alone) for batches of 4, 64 and 512 completions, thread and process
interleaved, and prints the median of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

from grpo.config import GRPOConfig
from grpo.model.loading import load_policy
from grpo.rewards.scoring import score_completions


def length_reward(prompts, completions, **_):  # noqa: ARG001 (the reward signature)
    return [len(c) / 100 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-math-lm")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    import torch

    policy = load_policy(GRPOConfig(model=args.model), torch.device("cpu"))
    print(f"policy: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M parameters loaded")
    for n in (4, 64, 512):
        prompts, completions = ["What is 2 + 3?"] * n, ["The answer is 5. #### 5"] * n
        times: dict[str, list[float]] = {"thread": [], "process": []}
        for _ in range(args.repeats):
            for isolation in times:  # interleaved, so load on a shared machine hits both alike
                start = time.perf_counter()
                score_completions([length_reward], None, prompts, completions, {}, isolation=isolation)
                times[isolation].append(time.perf_counter() - start)
        thread, process = (statistics.median(times[k]) * 1e3 for k in ("thread", "process"))
        extra = process - thread
        print(f"{n:4d} completions: thread {thread:7.2f} ms, process {process:7.2f} ms (+{extra:.2f} ms)")


if __name__ == "__main__":
    main()
