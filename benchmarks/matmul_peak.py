"""Measured float32 matmul peak of this machine: the denominator of the FLOP utilisation figures.

    python benchmarks/matmul_peak.py --threads 2      # prints GFLOP/s (best of --repeats)

Both GEMM libraries of a PyTorch CPU build are timed, MKL (`a @ b`) and oneDNN (what grpo's native
decoder uses, see src/grpo/model/linear.py), and the faster one is the peak: utilisation is then
measured against the best this machine can do, not against the library we happen to call.
"""

from __future__ import annotations

import argparse
import time

import torch


def _best_seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best  # the best run: the machine's peak, not its average under load


def matmul_peaks(threads: int, size: int = 2048, repeats: int = 10) -> dict[str, float]:
    """GFLOP/s of a float32 [size, size] product per library."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    flops = 2 * size**3
    peaks = {"mkl": flops / _best_seconds(lambda: a @ b, repeats) / 1e9}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        w = b.t().contiguous()  # linear computes a wᵀ

        def onednn() -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")

        peaks["onednn"] = flops / _best_seconds(onednn, repeats) / 1e9
    return peaks


def matmul_peak(threads: int, size: int = 2048, repeats: int = 10) -> float:
    return max(matmul_peaks(threads, size, repeats).values())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--verbose", action="store_true", help="print each library's figure too")
    args = ap.parse_args()
    peaks = matmul_peaks(args.threads, args.size, args.repeats)
    if args.verbose:
        print(", ".join(f"{name} {value:.1f}" for name, value in peaks.items()))
    print(f"{max(peaks.values()):.1f}")
