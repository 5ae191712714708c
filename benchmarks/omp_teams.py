"""What a second thread's torch ops cost while the main thread's OpenMP team exists (GNU OpenMP).

    PYTHONPATH=src python benchmarks/omp_teams.py [--threads 2] [--repeats 5]

The main thread runs one parallel op first, so it owns a team (its workers, idle and asleep, stay alive as
long as the thread). Then the same loops run on the main thread and on a new thread, interleaved: small ops
(a [64, 512] × [512, 512] product, SiLU and an affine step, the size of a small model's decode) and large
ones (a [256, 2048] × [2048, 2048] product). With more OpenMP threads in the process than CPUs, GNU OpenMP
lets an idle worker spin only ~100 times before it sleeps, so each parallel op of the second thread's team
wakes its worker from a futex; small ops pay that on every call. This is why the gateway's engine calls run
on the step's own thread (gateway/batching.py, `Batcher.host`). The same applies to any torch work on another
thread while the main thread's team is alive: a reward model called from a reward function that runs on its
own thread (`rewards.reward_timeout` with thread isolation), a tool's torch code on its thread.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, w = torch.randn(64, 512), torch.randn(512, 512)
    big, wb = torch.randn(256, 2048), torch.randn(2048, 2048)

    def small(n: int = 3000) -> float:
        start = time.perf_counter()
        for _ in range(n):
            y = torch.nn.functional.silu(x @ w)
            y = y * 1.0001 + 0.5
        return time.perf_counter() - start

    def large(n: int = 30) -> float:
        start = time.perf_counter()
        for _ in range(n):
            big @ wb
        return time.perf_counter() - start

    def on_a_thread(fn) -> float:
        box: dict = {}
        thread = threading.Thread(target=lambda: box.update(s=fn()))
        thread.start()
        thread.join()
        return box["s"]

    small(), large()  # the main thread's team exists from here on
    names = ("small, main", "small, thread", "large, main", "large, thread")
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.repeats):
        times["small, main"].append(small())
        times["small, thread"].append(on_a_thread(small))
        times["large, main"].append(large())
        times["large, thread"].append(on_a_thread(large))
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} s | {[round(v, 3) for v in values]} |")
    for kind in ("small", "large"):
        ratio = statistics.median(times[f"{kind}, thread"]) / statistics.median(times[f"{kind}, main"])
        print(f"{kind} ops: second thread / main thread = {ratio:.2f}×")


if __name__ == "__main__":
    main()
