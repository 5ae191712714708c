"""Where a gateway step's time goes against the `tools=` step's, stage by stage (issue 31 §2).

    PYTHONPATH=src python benchmarks/gateway_step_account.py --side gateway --steps 5
    PYTHONPATH=src python benchmarks/gateway_step_account.py --side tools= --steps 5

Runs one training run in this process (the workload of gateway_concurrency.py) with every stage of the step
(`time/rollout`, `time/update`, ...) also measured in CPU seconds: the trainer process's own (getrusage), its
child processes' (the agent workers, the tool workers: /proc/PID/stat, live children only), and the trainer's
minor page faults. Printed per step after the first, as JSON lines, then the medians per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_concurrency import COMMON, SIDES

TICK = os.sysconf("SC_CLK_TCK")


def children_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each live child process of this one."""
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # fields[1]: the parent's pid
            out[int(entry)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def snapshot() -> tuple[float, float, dict[int, float], int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), ru.ru_utime + ru.ru_stime, children_cpu(), ru.ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", default="gateway", choices=list(SIDES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from grpo import cli
    from grpo.run import metrics as run_metrics

    rows: list[dict] = []
    current: dict = {}

    @contextmanager
    def timed(self, stage: str):
        wall0, cpu0, kids0, flt0 = snapshot()
        try:
            yield
        finally:
            wall1, cpu1, kids1, flt1 = snapshot()
            self.seconds[stage] = self.seconds.get(stage, 0.0) + wall1 - wall0
            kids = sum(v - kids0.get(pid, 0.0) for pid, v in kids1.items())
            current[stage] = {
                "wall": wall1 - wall0,
                "cpu": cpu1 - cpu0,
                "children_cpu": kids,
                "minflt": flt1 - flt0,
            }
            if stage == "update":  # the last stage of a step that matters here: the step ends soon after
                rows.append(dict(current))
                current.clear()

    run_metrics.StageTimer.__call__ = timed
    with tempfile.TemporaryDirectory(prefix="gwacct-") as out:
        argv = ["train", *SIDES[args.side], "--output-dir", out, "--steps", str(args.steps)]
        argv += [*COMMON, f"train.num_threads={args.threads}"]
        try:
            cli.main(argv)
        except SystemExit as err:
            if err.code:
                raise
        lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "time/step" in r]
    for i, r in enumerate(rows):
        r["step_wall"] = steps[i]["time/step"] if i < len(steps) else None
        print(json.dumps({"side": args.side, "step": i + 1, **r}))
    later = rows[1:]
    summary = {}
    for stage in later[0]:
        if isinstance(later[0][stage], dict):
            summary[stage] = {
                k: round(statistics.median(r[stage][k] for r in later), 4) for k in later[0][stage]
            }
    summary["step_wall"] = round(statistics.median(r["step_wall"] for r in later), 4)
    print(json.dumps({"side": args.side, "median": summary, "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
