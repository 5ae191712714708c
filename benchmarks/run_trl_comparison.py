"""TRL GRPOTrainer vs grpo, same model, prompts, reward and settings, runs interleaved; a markdown table.

    benchmarks/run_trl_comparison.sh                       # creates benchmarks/.venv-trl on first use
    python benchmarks/run_trl_comparison.py --workloads a b c --repeats 3 --threads 2

Each repeat runs TRL then grpo back to back as fresh processes, --steps steps each; a run's time is
the median of its steps after the first. The table gives the median over repeats, the ratio, generated
tokens/s, peak RSS, and FLOP utilisation against the matmul peak measured before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Run as a script, so its directory is on sys.path and `common` beside it imports, as in the other benchmarks.
from common import GENERATIONS, MODEL_CONFIG, PROMPTS, WORKLOADS, make_model, param_count, step_flops

HERE = Path(__file__).resolve().parent


def run(cmd: list[str], env: dict) -> dict:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=HERE)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trl-python", default=str(HERE / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--skip-trl", action="store_true", help="only grpo (e.g. while iterating)")
    args = ap.parse_args()
    make_model()
    env = {
        **os.environ,
        "PYTHONPATH": str(HERE.parent / "src"),
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    peak_cmd = [sys.executable, "matmul_peak.py", "--threads", str(args.threads)]
    peaks = [float(subprocess.run(peak_cmd, check=False, capture_output=True, text=True, cwd=HERE).stdout)]
    loads = [load()]
    results: dict[tuple[str, str], list[dict]] = {}
    for w in args.workloads:
        for _ in range(args.repeats):
            sides = [("grpo", [sys.executable, "grpo_step.py"])]
            if not args.skip_trl:
                sides.insert(0, ("trl", [args.trl_python, "trl_step.py"]))
            for name, cmd in sides:
                r = run(
                    [*cmd, "--workload", w, "--steps", str(args.steps), "--threads", str(args.threads)], env
                )
                results.setdefault((w, name), []).append(r)
                print(
                    f"# {w} {name}: {r['median_s']:.2f} s/step, "
                    f"steps {[round(t, 2) for t in r['step_times']]}, load {load()}",
                    file=sys.stderr,
                    flush=True,
                )
        loads.append(load())
    peaks.append(
        float(subprocess.run(peak_cmd, check=False, capture_output=True, text=True, cwd=HERE).stdout)
    )
    peak = max(peaks)

    c = MODEL_CONFIG
    params = param_count()
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    print(
        f"\n{PROMPTS} prompts × {GENERATIONS} completions, β = 0.04, {args.threads} thread(s); median over "
        f"{args.repeats} interleaved runs of {args.steps} steps (first step of each run dropped). "
        f"Matmul peak {peak:.0f} GFLOP/s (measured {', '.join(f'{p:.0f}' for p in peaks)}); "
        f"load average during runs {', '.join(loads)}.\n"
    )
    print(
        "| workload | TRL s/step | grpo s/step | speed-up | TRL tok/s | grpo tok/s | TRL peak RSS | "
        "grpo peak RSS | TRL % peak | grpo % peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in args.workloads:
        prompt_len, new = WORKLOADS[w]
        row = {}
        for name in ("trl", "grpo"):
            runs = results.get((w, name))
            if not runs:
                row[name] = None
                continue
            secs = statistics.median(r["median_s"] for r in runs)
            toks = statistics.median(r["completion_tokens"] for r in runs)
            lens = [toks / (PROMPTS * GENERATIONS)] * (PROMPTS * GENERATIONS)
            flops = step_flops(
                params, c["num_hidden_layers"], c["num_attention_heads"] * head_dim, prompt_len, lens, PROMPTS
            )
            row[name] = (
                secs,
                toks / secs,
                max(r["peak_rss_mb"] for r in runs),
                100 * flops / secs / (peak * 1e9),
            )
        t, g = row["trl"], row["grpo"]
        print(
            f"| ({w}) {prompt_len}+{new} | {fmt(t and t[0], '{:.2f}')} | {g[0]:.2f} | "
            f"{fmt(t and t[0] / g[0], '{:.2f}×')} | {fmt(t and t[1], '{:,.0f}')} | {g[1]:,.0f} | "
            f"{fmt(t and t[2], '{:,.0f} MB')} | {g[2]:,.0f} MB | {fmt(t and t[3], '{:.0f}%')} | {g[3]:.0f}% |"
        )
    stages = {
        w: {
            k: statistics.median(r["stages"][k] for r in results[(w, "grpo")])
            for k in results[(w, "grpo")][0]["stages"]
        }
        for w in args.workloads
    }
    print(
        "\ngrpo stage medians (s): "
        + "; ".join(
            f"({w}) " + ", ".join(f"{k[5:]} {v:.2f}" for k, v in s.items()) for w, s in stages.items()
        )
    )


def fmt(x: float | None, f: str) -> str:
    """A table cell, or – where TRL was skipped."""
    return "–" if x is None else f.format(x)


if __name__ == "__main__":
    main()
