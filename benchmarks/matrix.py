"""The workload matrix: grpo against TRL 1.16's GRPOTrainer, each with its defaults; JSON + markdown.

    PYTHONPATH=src python benchmarks/matrix.py --repeats 3 --steps 4            # every cell
    PYTHONPATH=src python benchmarks/matrix.py --cells base eos-off --repeats 1  # a few
    PYTHONPATH=src python benchmarks/matrix.py --cells eos-off --grpo-args= --grpo-args='--compile-training'
                                                  # TRL and two grpo variants, interleaved in each repeat

Cells (common.MATRIX_VARIATIONS): a base cell (eos on, 64-token prompts, ≤ 128 new tokens, G = 8,
β = 0.04, plain-text prompts, 8 prompts per step) and one-factor-at-a-time variations of it, not a
full factorial (216 cells would take days on two cores). Both libraries get the same random model
(common.make_matrix_model: eos at a set rate), prompts, reward, sampling, learning rate and steps; the
rest is each library's default (TRL: gradient checkpointing, one micro-batch of P·G; grpo: its own).

Each repeat runs TRL then grpo as fresh processes (interleaved, so drift in the machine's speed hits
both); a run's time is the median of its steps after the first (warm-up). Reported per cell: the median
over repeats of s/step, TRL/grpo, the peak RSS (VmHWM, max over repeats) and grpo's stage times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402 (benchmarks/ is not a package: its path goes in first)
    MATRIX_PROMPTS,
    MATRIX_RUNS,
    MATRIX_VARIATIONS,
    make_matrix_model,
    matrix_cell,
)

STAGES = ("rollout", "reward", "reference", "update")


def run(cmd: list[str], env: dict) -> dict:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=HERE)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def load() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def describe(cell: dict) -> str:
    return (
        f"eos {'on' if cell['eos'] else 'off'}, {cell['prompt']}{' chat' if cell['chat'] else ''}"
        f"+{cell['completion']}, G {cell['G']}, β {cell['beta']:g}"
    )


def summarise(name: str, runs: dict[str, list[dict]]) -> dict:
    """One row per cell; `runs` maps a side ("trl", "grpo", or "grpo <args>" for an A/B variant) to its
    repeats. "grpo" (or the first variant) fills row["grpo"]; every variant's ratio is in row["variants"]."""
    cell = matrix_cell(name)
    row = {"cell": name, **cell, "prompts_per_step": MATRIX_PROMPTS}
    variants = {}
    for side, results in runs.items():
        summary = {
            "s_per_step": statistics.median(r["median_s"] for r in results),
            "runs_s_per_step": [r["median_s"] for r in results],
            "completion_len": statistics.median(r["completion_len"] for r in results),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "threads": results[0]["threads"],
        }
        if side == "trl":
            row["trl"] = summary
            continue
        summary["micro_batch"] = results[0]["micro_batch"]
        summary["stages"] = {
            s: statistics.median(r["stages"].get(f"time/{s}", 0.0) for r in results) for s in STAGES
        }
        variants[side] = summary
    if variants:
        row["grpo"] = variants.get("grpo", next(iter(variants.values())))
        row["variants"] = variants
    if "trl" in row and "grpo" in row:
        row["speedup"] = row["trl"]["s_per_step"] / row["grpo"]["s_per_step"]
        for summary in variants.values():
            summary["speedup"] = row["trl"]["s_per_step"] / summary["s_per_step"]
    return row


def markdown(rows: list[dict]) -> str:
    out = [
        (
            "| cell | workload | TRL s/step | grpo s/step | TRL/grpo | TRL peak RSS | grpo peak RSS | "
            "mean len TRL / grpo | grpo rollout / reference / update s |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(side: dict | None, key: str, f: str) -> str:
        return "–" if side is None else f.format(side[key])

    for r in rows:
        t = r.get("trl")
        for label, g in (r.get("variants") or {"grpo": None}).items():
            speedup = f"{g['speedup']:.2f}×" if g and "speedup" in g else "–"
            stages = (
                " / ".join(f"{g['stages'][s]:.2f}" for s in ("rollout", "reference", "update")) if g else "–"
            )
            name = r["cell"] if label == "grpo" else f"{r['cell']} ({label})"
            out.append(
                f"| {name} | {describe(r)} | {fmt(t, 's_per_step', '{:.2f}')} | "
                f"{fmt(g, 's_per_step', '{:.2f}')} | {speedup} | "
                f"{fmt(t, 'peak_rss_mb', '{:,.0f} MB')} | {fmt(g, 'peak_rss_mb', '{:,.0f} MB')} | "
                f"{fmt(t, 'completion_len', '{:.0f}')} / {fmt(g, 'completion_len', '{:.0f}')} | {stages} |"
            )
    ratios = [r["speedup"] for r in rows if "speedup" in r]
    if ratios:
        out.append(
            f"\nTRL/grpo: median {statistics.median(ratios):.2f}×, min {min(ratios):.2f}× "
            f"({min(rows, key=lambda r: r.get('speedup', 1e9))['cell']}), max {max(ratios):.2f}×."
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", choices=sorted(MATRIX_VARIATIONS), default=list(MATRIX_VARIATIONS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trl-python", default=str(HERE / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--skip-trl", action="store_true", help="only grpo (e.g. while iterating)")
    ap.add_argument("--out", default=str(HERE / "results" / "matrix.json"))
    ap.add_argument(
        "--grpo-args",
        action="append",
        help="extra matrix_grpo.py arguments for an A/B of one setting, given with '=' (a value starting "
        "with -- would read as an option): --grpo-args='--compile-training'. Repeat it for several "
        "variants, run interleaved in each repeat; --grpo-args= is the defaults. Default: the defaults only.",
    )
    ap.add_argument(
        "--from-runs",
        metavar="SINCE",
        help=f"no runs: tabulate the runs {MATRIX_RUNS.name} logged since this time (YYYY-MM-DD HH:MM)",
    )
    args = ap.parse_args()
    if args.from_runs:
        results: dict[str, dict[str, list[dict]]] = {}
        for line in MATRIX_RUNS.read_text().splitlines():
            r = json.loads(line)
            if r["time"] >= args.from_runs and r["cell"] in args.cells:
                side = "grpo" if r["framework"] == "grpo" else "trl"  # variants are not told apart here
                results.setdefault(r["cell"], {}).setdefault(side, []).append(r)
        rows = [summarise(name, results[name]) for name in args.cells if name in results]
        meta = {"command": " ".join(["python", "benchmarks/matrix.py", *sys.argv[1:]]), "from_runs": True}
        write(args.out, meta, rows)
        return
    for name in args.cells:  # build every model before timing anything
        cell = matrix_cell(name)
        make_matrix_model(cell["eos"], cell["completion"])
    src = os.environ.get("GRPO_SRC", str(HERE.parent / "src"))  # another checkout's grpo, e.g. a frozen copy
    env = {**os.environ, "PYTHONPATH": src, "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, dict[str, list[dict]]] = {}
    loads = [load()]
    started = time.time()
    for repeat in range(args.repeats):
        for name in args.cells:
            sides = [
                (f"grpo {extra}".strip(), [sys.executable, "matrix_grpo.py", *extra.split()])
                for extra in args.grpo_args or [""]
            ]
            if not args.skip_trl:
                sides.insert(0, ("trl", [args.trl_python, "trl_step.py"]))
            for side, cmd in sides:
                r = run([*cmd, "--cell", name, "--steps", str(args.steps)], env)
                results.setdefault(name, {}).setdefault(side, []).append(r)
                loads.append(load())
                print(
                    f"# repeat {repeat} {name} {side}: {r['median_s']:.2f} s/step, steps "
                    f"{[round(t, 2) for t in r['step_times']]}, len {r['completion_len']:.1f}, "
                    f"RSS {r['peak_rss_mb']:.0f} MB, load {loads[-1]:.2f}, stages {r.get('stages', {})}",
                    file=sys.stderr,
                    flush=True,
                )
    rows = [summarise(name, results[name]) for name in args.cells]
    meta = {
        "command": " ".join(["python", "benchmarks/matrix.py", *sys.argv[1:]]),
        "repeats": args.repeats,
        "steps": args.steps,
        "load_average_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "wall_s": round(time.time() - started),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    write(args.out, meta, rows)


def write(out: str, meta: dict, rows: list[dict]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"meta": meta, "cells": rows}, indent=1) + "\n")
    table = markdown(rows)
    Path(out).with_suffix(".md").write_text(table + "\n")
    print(json.dumps(meta))
    print(table)


if __name__ == "__main__":
    main()
