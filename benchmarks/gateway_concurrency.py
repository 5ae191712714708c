"""64 concurrent agent episodes through the gateway against the in-process `tools=` runner (issue 31 §2).

    PYTHONPATH=src python benchmarks/gateway_concurrency.py --repeats 3 --steps 5

The same workload both ways: the bundled `tiny_tools` task and tool model, 8 prompts × 8 episodes = 64
concurrent episodes a step, at most 4 model calls each, 48 tokens a turn. Side A is the `tiny_tools` preset
(the calculator as a `tools=` function, the turn loop in grpo's process); side B is the `tiny_tools_agent`
preset (examples/tiny_tools_agent.py, a plain openai-python agent, one thread per episode, every model call
an HTTP request to the gateway, the calculator run by the agent). The learning rate is 1e-9 so the policy,
and with it the episodes' lengths and tool calls, stays the same across steps and sides. The gateway
batches its calls in episode order (gateway/batching.py, `in_episode_order`), so the two sides sample the
same episodes token for token (turns, tool calls and sampled tokens per episode are printed to check it);
before, the gateway's episodes hung on the agents' timing and its steps fell in two clusters (a third turn
or not). Each repeat runs A then B as fresh processes (interleaved: drift in the machine's speed hits
both); a run's time is the median of its steps after the first. Reported: s/step and rollout s/step per
side, B/A per repeat and their median, the mean turns, tool calls and sampled tokens per episode (same
workload check), and the host's load.
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
    # the example agent in worker processes (env.agent_workers unset: one per core), and on threads in the
    # trainer's process (env.agent_workers=0: how the gateway ran before the workers)
    "gateway": ["--config", "tiny_tools_agent"],
    "gateway-threads": ["--config", "tiny_tools_agent", "env.agent_workers=0"],
    # the gateway with each keep-alive setting named (env.agent_keep_alive), whatever the default
    "gateway-keep-alive": ["--config", "tiny_tools_agent", "env.agent_keep_alive=true"],
    "gateway-close": ["--config", "tiny_tools_agent", "env.agent_keep_alive=false"],
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


def one_run(side: str, steps: int, threads: int, root: Path = ROOT) -> dict:
    """`root`: the checkout whose code runs (--before: another worktree, e.g. main before a change)."""
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
            cmd, cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "src"}
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
        "sampled_tokens": mean("episode/sampled_tokens"),
        "forks": sum(r.get("gateway/forks", 0) for r in steps_rows),
        "wall_s": wall,
        "load": load(),
        # every stage the step timed (rollout, scoring, reference, update, weight sync), median s
        "stages": {
            k[5:]: statistics.median(r[k] for r in steps_rows if k in r)
            for k in sorted({k for r in steps_rows for k in r if k.startswith("time/") and k != "time/step"})
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gateway_concurrency.json"))
    ap.add_argument("--sides", default="tools=,gateway", help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument(
        "--before",
        metavar="CHECKOUT",
        help="also run the gateway side from this checkout (e.g. a worktree at main before a change) as side "
        "`gateway-before`, interleaved with this one's, its order against `gateway` swapped every repeat",
    )
    args = ap.parse_args()
    sides = args.sides.split(",")
    if "tools=" not in sides or not set(sides) <= set(SIDES):
        ap.error(f"--sides: tools= and any of {', '.join(SIDES)}, comma-separated")
    roots = dict.fromkeys(sides, ROOT)
    if args.before:
        before = Path(args.before).resolve()
        if not (before / "src" / "grpo").is_dir():
            ap.error(f"--before {args.before}: not a grpo checkout (no src/grpo in it)")
        SIDES["gateway-before"] = SIDES["gateway"]
        sides.append("gateway-before")
        roots["gateway-before"] = before
    runs = []
    for rep in range(args.repeats):
        pair = {}
        order = list(sides)
        if args.before and rep % 2:  # drift within a repeat hits the before and after sides alike
            a, b = order.index("gateway"), order.index("gateway-before")
            order[a], order[b] = order[b], order[a]
        for side in order:
            pair[side] = one_run(side, args.steps, args.threads, roots[side])
            r = pair[side]
            print(
                f"# repeat {rep} {side}: {r['s_per_step']:.2f} s/step, rollout {r['rollout_s']:.2f} s, "
                f"turns {r['turns']:.2f}, tool calls {r['tool_calls']:.2f}, "
                f"sampled {r['sampled_tokens']:.2f}, forks {r['forks']}, "
                f"load {r['load']:.2f}; stages " + ", ".join(f"{k} {v:.3f}" for k, v in r["stages"].items()),
                flush=True,
            )
        for side in sides[1:]:
            tag = "" if side == "gateway" else f"_{side}"
            pair[f"ratio_step{tag}"] = pair[side]["s_per_step"] / pair["tools="]["s_per_step"]
            pair[f"ratio_rollout{tag}"] = pair[side]["rollout_s"] / pair["tools="]["rollout_s"]
            print(
                f"# repeat {rep}: {side}/tools= step {pair[f'ratio_step{tag}']:.3f}×, "
                f"rollout {pair[f'ratio_rollout{tag}']:.3f}×"
            )
        if args.before:  # the change itself, load drift within the repeat aside
            pair["after_before"] = pair["gateway"]["s_per_step"] / pair["gateway-before"]["s_per_step"]
            print(f"# repeat {rep}: gateway / gateway-before per step {pair['after_before']:.3f}×")
        runs.append(pair)
    summary = {
        f"ratio_{kind}{tag}_median": statistics.median(p[f"ratio_{kind}{tag}"] for p in runs)
        for side in sides[1:]
        for tag in ("" if side == "gateway" else f"_{side}",)
        for kind in ("step", "rollout")
    }
    if args.before:
        summary["after_before_median"] = statistics.median(p["after_before"] for p in runs)
    summary |= {
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
    for side in sides[1:]:
        tag = "" if side == "gateway" else f"_{side}"
        print(
            f"{side}/tools= per step: median {summary[f'ratio_step{tag}_median']:.3f}× "
            f"(rollout {summary[f'ratio_rollout{tag}_median']:.3f}×) over {args.repeats} interleaved repeats"
        )
    if args.before:
        print(f"gateway / gateway-before per step: median {summary['after_before_median']:.3f}×")


if __name__ == "__main__":
    main()
