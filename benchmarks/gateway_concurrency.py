"""64 concurrent agent episodes through the gateway against the in-process `tools=` runner (issue 31 §2).

    PYTHONPATH=src python benchmarks/gateway_concurrency.py --repeats 3 --steps 5

The same workload both ways: the bundled `tiny_tools` task and tool model, 8 prompts × 8 episodes = 64
concurrent episodes a step, at most 4 model calls each, 48 tokens a turn. Side A is the `tiny_tools` preset
(the calculator as a `tools=` function, the turn loop in grpo's process); side B is the `tiny_tools_agent`
preset (examples/tiny_tools_agent.py, a plain openai-python agent, one thread per episode, every model call
an HTTP request to the gateway, the calculator run by the agent). The learning rate is 1e-9 so the policy,
and with it the episodes' lengths and tool calls, stays the same across steps and sides. Each repeat runs A
then B as fresh processes (interleaved: drift in the machine's speed hits both); a run's time is the median of
its steps after the first. Reported: s/step and rollout s/step per side, B/A per repeat and their median,
the mean turns and tool calls per episode (same workload check), and the host's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPUINFO = Path("/proc/cpuinfo")
SIDES = {
    "tools=": ["--config", "tiny_tools"],
    "gateway": ["--config", "tiny_tools_agent"],
}
COMMON = [
    "train.prompts_per_step=8",
    "generation.num_generations=8",
    "optim.learning_rate=1e-9",
    "optim.warmup_steps=0",
    "train.eval_before=false",
    "train.eval_after=false",
    "train.eval_steps=0",
    "train.save_steps=0",
    "train.logging_steps=1",
]


def load() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def one_run(side: str, steps: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gwbench-") as out:
        cmd = [
            sys.executable,
            "-m",
            "grpo.cli",
            "train",
            *SIDES[side],
            "--output-dir",
            out,
            "--steps",
            str(steps),
        ]
        cmd += [*COMMON, f"train.num_threads={threads}"]
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "src"}
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "time/step" in r][1:]  # the first step warms up

    def mean(key: str) -> float:
        values = [r[key] for r in steps_rows if key in r]
        return statistics.mean(values) if values else float("nan")

    return {
        "side": side,
        "s_per_step": statistics.median(r["time/step"] for r in steps_rows),
        "rollout_s": statistics.median(r.get("time/rollout", float("nan")) for r in steps_rows),
        "turns": mean("episode/turns"),
        "tool_calls": mean("episode/tool_calls"),
        "forks": sum(r.get("gateway/forks", 0) for r in steps_rows),
        "wall_s": wall,
        "load": load(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gateway_concurrency.json"))
    args = ap.parse_args()
    runs = []
    for rep in range(args.repeats):
        pair = {}
        for side in SIDES:
            pair[side] = one_run(side, args.steps, args.threads)
            r = pair[side]
            print(
                f"# repeat {rep} {side}: {r['s_per_step']:.2f} s/step, rollout {r['rollout_s']:.2f} s, "
                f"turns {r['turns']:.2f}, tool calls {r['tool_calls']:.2f}, forks {r['forks']}, "
                f"load {r['load']:.2f}",
                flush=True,
            )
        pair["ratio_step"] = pair["gateway"]["s_per_step"] / pair["tools="]["s_per_step"]
        pair["ratio_rollout"] = pair["gateway"]["rollout_s"] / pair["tools="]["rollout_s"]
        print(
            f"# repeat {rep}: gateway/tools= step {pair['ratio_step']:.3f}×, "
            f"rollout {pair['ratio_rollout']:.3f}×"
        )
        runs.append(pair)
    summary = {
        "ratio_step_median": statistics.median(p["ratio_step"] for p in runs),
        "ratio_rollout_median": statistics.median(p["ratio_rollout"] for p in runs),
        "runs": runs,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": next(
            (
                ln.split(":", 1)[1].strip()
                for ln in CPUINFO.read_text().splitlines()
                if ln.startswith("model name")
            ),
            "?",
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(
        f"gateway/tools= per step: median {summary['ratio_step_median']:.3f}× "
        f"(rollout {summary['ratio_rollout_median']:.3f}×) over {args.repeats} interleaved repeats"
    )


if __name__ == "__main__":
    main()
