"""Measured float32 matmul peak of this machine: the denominator of the FLOP utilisation figures.

    python benchmarks/matmul_peak.py --threads 2      # prints GFLOP/s (best of --repeats)
"""

from __future__ import annotations

import argparse
import time

import torch


def matmul_peak(threads: int, size: int = 2048, repeats: int = 10) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9  # the best run: the machine's peak, not its average under load


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    print(f"{matmul_peak(args.threads, args.size, args.repeats):.1f}")
