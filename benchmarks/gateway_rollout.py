"""One step's rollout of 64 episodes, in one process: the `tools=` runner against the gateway with the example
agent (issue 31 §2), A/B interleaved on one engine, the same prompts and seeds, and where the gateway's extra
time goes.

    PYTHONPATH=src python benchmarks/gateway_rollout.py --repeats 6 --threads 1

The workload of benchmarks/gateway_concurrency.py without the learner and the process start: the tiny_tools
preset's MultiTurn runner (the calculator as a `tools=` function) and the tiny_tools_agent preset's
AgentRunner (examples/tiny_tools_agent.py, a plain openai-python agent, one thread per episode, every model
call an HTTP request to the gateway), 8 prompts × 8, the bundled tool model at its base weights. Per side and
repeat: wall and process CPU seconds of `runner.run`, the engine calls (rows each) and their seconds; for the
gateway also the CPU seconds of the agent threads (the openai client and the agent) and of the server's
request threads, which are robust to a shared machine where wall time is not. The first rollout of each side
warms up and is not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import torch

_THREAD_CPU: dict[str, float] = {"agent": 0.0, "server": 0.0}
_lock = threading.Lock()
_run = threading.Thread.run


def _counted_run(self):
    """Thread.run, adding the thread's CPU time to its kind (agent threads, the server's request threads)."""
    kind = (
        "agent"
        if self.name.startswith("grpo-agent")
        else "server"
        if "process_request" in self.name
        else None
    )
    if kind is None:
        return _run(self)
    start = time.thread_time()
    try:
        return _run(self)
    finally:
        with _lock:
            _THREAD_CPU[kind] += time.thread_time() - start


def _children_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the live worker processes `pids` have used so far."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is comparable)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--agent-workers", type=int, default=2, help="the `workers` side's env.agent_workers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threading.Thread.run = _counted_run  # this benchmark's process only

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config import load_config
    from grpo.data import make_prompt_batch
    from grpo.data.prompts import PromptFormatter
    from grpo.data.sources import load_rows
    from grpo.model.loading import resolve_path
    from grpo.records import SamplingParams
    from grpo.rollout.episodes import build_episodes
    from grpo.rollout.native import NativeEngine

    cfgs = {
        "tools=": load_config("tiny_tools"),
        # the agents on threads in this process (env.agent_workers=0), and in worker processes
        "gateway": load_config("tiny_tools_agent", {"env.agent_workers": 0}),
        "workers": load_config("tiny_tools_agent", {"env.agent_workers": args.agent_workers}),
    }
    path = resolve_path(cfgs["tools="].model.name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok)
    calls: list[tuple[int, float]] = []
    first: list[float] = []  # when the first engine call of a rollout started
    depth = threading.local()
    for name in ("generate", "continue_rows"):
        method = getattr(engine, name)

        def timed(*a, _method=method, _name=name, **kw):
            if getattr(depth, "in_call", False):  # continue_rows calls generate: count the outer call
                return _method(*a, **kw)
            depth.in_call, start = True, time.perf_counter()
            if not first:
                first.append(start)
            try:
                out = _method(*a, **kw)
            finally:
                depth.in_call = False
            calls.append((len(a[0]) * (a[1] if _name == "generate" else 1), time.perf_counter() - start))
            return out

        setattr(engine, name, timed)
    runners = {side: build_episodes(c, PromptFormatter(tok, c.data)) for side, c in cfgs.items()}
    rows = load_rows(cfgs["tools="].data.dataset, cfgs["tools="].data)
    gen = cfgs["tools="].generation
    sampling = SamplingParams(cfgs["tools="].effective_max_new_tokens, gen.temperature, gen.top_k, gen.top_p)
    p, g = args.prompts, cfgs["tools="].generation.num_generations

    def one(side: str, rep: int) -> dict:
        runner, part = runners[side], rows[rep * p : (rep + 1) * p]
        prompts = make_prompt_batch(
            list(range(len(part))),
            part,
            PromptFormatter(tok, cfgs[side].data),
            tokenize=not runner.renders_prompts,
        )
        calls.clear()
        first.clear()
        with _lock:
            _THREAD_CPU.update(agent=0.0, server=0.0)
        torch.manual_seed(rep)
        pool = getattr(runner, "_pool", None)
        before = _children_cpu(pool.pids if pool else [])
        wall, cpu = time.perf_counter(), time.process_time()
        _, out = runner.run(engine, prompts, g, sampling)
        to_first = first[0] - wall if first else float("nan")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        pool = getattr(runner, "_pool", None)
        workers_cpu = _children_cpu(pool.pids if pool else []) - before
        if hasattr(runner, "metrics"):
            runner.metrics()  # the gateway's counters restart each step
        with _lock:
            threads = dict(_THREAD_CPU)
        return {
            "wall": wall,
            "cpu": cpu,
            "engine_s": sum(s for _, s in calls),
            "to_first": to_first,
            "cpu_all": cpu + workers_cpu,  # this process's and its agent workers'
            "rows": [r for r, _ in calls],
            "turns": sum(e.turns for e in out.episodes) / len(out.episodes),
            **threads,
            "workers_cpu": workers_cpu,
        }

    try:
        for side in runners:
            one(side, 0)  # warm-up
        results: dict[str, list[dict]] = {side: [] for side in runners}
        for rep in range(1, args.repeats + 1):
            for side in list(runners) if rep % 2 else list(runners)[::-1]:
                r = one(side, rep)
                results[side].append(r)
                extra = (
                    f", agent threads {r['agent']:.3f} s, server {r['server']:.3f} s"
                    if side == "gateway"
                    else f", worker processes {r['workers_cpu']:.3f} s, server {r['server']:.3f} s"
                    if side == "workers"
                    else ""
                )
                print(
                    f"repeat {rep} {side}: wall {r['wall']:.3f} s, cpu {r['cpu']:.3f} s, "
                    f"engine {r['engine_s']:.3f} s ({r['rows']} rows, first after {r['to_first']:.3f} s), "
                    f"turns {r['turns']:.2f}{extra}",
                    flush=True,
                )
    finally:
        runners["gateway"].close()
        runners["workers"].close()
    med = {
        side: {
            k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu", "engine_s", "to_first", "cpu_all")
        }
        for side, rs in results.items()
    }
    for side, m in med.items():
        print(
            f"| {side} | wall {m['wall']:.3f} s | cpu {m['cpu']:.3f} s "
            f"(with agent workers {m['cpu_all']:.3f} s) "
            f"| engine {m['engine_s']:.3f} s | "
            f"first engine call after {m['to_first']:.3f} s |"
        )
    for side in ("gateway", "workers"):
        print(
            f"{side}/tools= rollout: wall {med[side]['wall'] / med['tools=']['wall']:.2f}×, "
            f"cpu {med[side]['cpu'] / med['tools=']['cpu']:.2f}× (with agent workers "
            f"{med[side]['cpu_all'] / med['tools=']['cpu']:.2f}×; medians of {args.repeats}, interleaved); "
            f"load {Path('/proc/loadavg').read_text().split()[0]}"
        )


if __name__ == "__main__":
    main()
