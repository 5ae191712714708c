"""CPU seconds per model call of the gateway's server path and of the agent's `openai` client (issue 31 §2).

    PYTHONPATH=src python benchmarks/gateway_request_cpu.py --episodes 200 --repeats 5
    PYTHONPATH=src python benchmarks/gateway_request_cpu.py --before /work/main  # A/B, another checkout

A load-robust number for what the gateway adds per call, where wall-clock pairs of
benchmarks/gateway_concurrency.py are noise on a shared machine. The engine is canned (no model: the bundled
tool model's tokenizer, a reply that calls the calculator, then a final answer), so what is measured is the
Python around the engine: the server's request threads (HTTP parsing, JSON, the chat template and tokenizer,
the reply) and the agent's thread (examples/tiny_tools_agent.py's `run`: the `openai` client, httpx), each by
its own thread CPU time (time.thread_time), one episode at a time, at one torch thread. `--before DIR` runs
the same measurement with DIR's src/ in a child process, alternating with this checkout's, so both sides see
the same machine; the medians per call are printed side by side. `--concurrent N` runs N episodes at once, on
threads sharing one HTTP client as in an agent worker (the gateway's `agent_http_client` where the checkout
has it, else httpx's pool as before it), the batcher serving them together; `--keep-alive` serves with
env.agent_keep_alive on (a checkout from before the key: GRPO_GATEWAY_KEEP_ALIVE=1). `--continuations`
measures, in one process,
interleaved, the server's ids of a continued row both ways: the delta rule (two renderings) and the gateway's
one rendering (gateway/service.py, _Renderer.continued_ids), checked equal.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# the server's request threads' CPU, counted by gateway_rollout's Thread.run wrapper (key "server")
from gateway_rollout import _THREAD_CPU, _counted_run, _lock

ROOT = Path(__file__).resolve().parent.parent


def _http_client():
    try:
        from grpo.gateway.agent_http import agent_http_client
    except ImportError:  # a checkout from before it: httpx's pool, as its agent workers had
        import httpx

        return httpx.Client(timeout=None, limits=httpx.Limits(max_connections=None))
    return agent_http_client()


def _episodes(gateway, server, http, sessions: list, concurrent: int) -> float:
    """Run the sessions' episodes, `concurrent` live at a time (served together); the agents' CPU seconds."""
    import openai
    from tiny_tools_agent import run as agent

    cpu: list[float] = []

    def one(s) -> None:
        client = openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)
        start = time.thread_time()
        agent(client, s.row)
        cpu.append(time.thread_time() - start)

    for at in range(0, len(sessions), concurrent):
        wave = sessions[at : at + concurrent]
        for s in wave:
            gateway.sessions.add(s)
        threads = [threading.Thread(target=one, args=(s,)) for s in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in wave:
            s.end("answer")
        gateway.sessions.remove(wave)
    return sum(cpu)


def measure(episodes: int, repeats: int, concurrent: int = 1, keep_alive: bool = False) -> list[dict]:
    """In this process: `repeats` rounds of `episodes` episodes, `concurrent` at a time; CPU per call."""
    import torch

    torch.set_num_threads(1)
    threading.Thread.run = _counted_run
    sys.path.insert(0, str(ROOT / "examples"))
    from transformers import AutoTokenizer

    from grpo.agents.parsing import detect_parser
    from grpo.gateway.server import GatewayServer
    from grpo.gateway.service import Gateway, Limits
    from grpo.gateway.sessions import Session
    from grpo.model.loading import resolve_path
    from grpo.records import Rollouts, SamplingParams

    path = resolve_path("tiny-tools-lm")
    tok = AutoTokenizer.from_pretrained(path)
    parser = detect_parser(tok, path, "auto", optional=True)
    eos = tok.eos_token_id
    call = tok('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>',
               add_special_tokens=False)["input_ids"]  # fmt: skip
    answer = tok("The answer is 408.", add_special_tokens=False)["input_ids"]
    response = tok.convert_tokens_to_ids("<tool_response>") if "<tool_response>" in tok.get_vocab() else None

    class Canned:
        """Turn 1 calls the calculator, turn 2 answers: the tiny_tools episode's shape, without a model."""

        def generate(self, prompt_ids, n, sampling, chunk_prompts=None):  # noqa: ARG002 - the engine's
            return self.continue_rows([ids for ids in prompt_ids for _ in range(n)], sampling)

        def continue_rows(self, rows, sampling):  # noqa: ARG002 - the engine's signature
            outs = []
            for ids in rows:
                told = response in ids if response is not None else "<tool_response>" in tok.decode(ids)
                outs.append([*(answer if told else call), eos])
            width = max(len(o) for o in outs)
            out = torch.full((len(outs), width), eos)
            mask = torch.zeros(len(outs), width)
            for r, o in enumerate(outs):
                out[r, : len(o)], mask[r, : len(o)] = torch.tensor(o), 1.0
            done = torch.zeros(len(outs), dtype=torch.bool)
            return Rollouts(group_ids=torch.arange(len(outs)), completion_ids=out, completion_mask=mask,
                            sampling_logprobs=-0.25 * mask, truncated=done)  # fmt: skip

    gateway = Gateway(tok, parser, Limits(160, 48, 4096), Canned(), SamplingParams(max_new_tokens=48),
                      window_s=0.0)  # fmt: skip
    if "keep_alive" in inspect.signature(GatewayServer).parameters:
        server = GatewayServer(gateway, keep_alive=keep_alive)
    else:  # before env.agent_keep_alive
        os.environ["GRPO_GATEWAY_KEEP_ALIVE"] = "1" if keep_alive else "0"
        server = GatewayServer(gateway)
    rows = [{"prompt": f"What is {a} * {a + 7}?", "answer": str(a * (a + 7))} for a in range(episodes)]
    out = []
    try:
        for rep in range(repeats + 1):  # the first round warms up
            sessions = [Session(k, k, row) for k, row in enumerate(rows)]
            # as an agent worker's client; closed at the round's end, so the server's connection threads (kept
            # alive between calls) end and their CPU is counted
            http = _http_client()
            with _lock:
                _THREAD_CPU["server"] = 0.0
            client_cpu = _episodes(gateway, server, http, sessions, concurrent)
            http.close()
            # each request thread's CPU is counted as it exits: with keep-alive, dozens end at the close above
            deadline = time.monotonic() + 5
            serving = [t for t in threading.enumerate() if "process_request" in t.name]
            while time.monotonic() < deadline and any(t.is_alive() for t in serving):
                time.sleep(0.01)
            time.sleep(0.05)
            calls = sum(s.calls for s in sessions)
            with _lock:
                server_cpu = _THREAD_CPU["server"]
            if rep:
                out.append({"calls": calls, "server_ms": 1e3 * server_cpu / calls,
                            "client_ms": 1e3 * client_cpu / calls})  # fmt: skip
    finally:
        server.close()
        gateway.batcher.close() if hasattr(gateway.batcher, "close") else None
    return out


def continuations(rounds: int = 7, n: int = 50) -> None:
    """CPU per continued row's ids: ChatRenderer.injected_ids against _Renderer.continued_ids (see the module
    docstring), interleaved in this process at one torch thread; the first request's rendering not counted."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_tools_agent import TOOLS
    from transformers import AutoTokenizer

    from grpo.agents.chat import ChatRenderer
    from grpo.gateway.service import _Renderer
    from grpo.model.loading import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("tiny-tools-lm"))
    delta, once = ChatRenderer(tok, TOOLS), _Renderer(tok, TOOLS)
    once._checked = once.VERIFY  # past the first calls' check against the delta rule
    cases = []
    for a in range(n):
        first = [{"role": "user", "content": f"What is {a} * {a + 7}?"}]
        call = {"type": "function", "id": "call00001",
                "function": {"name": "calculator", "arguments": {"expression": f"{a}*{a + 7}"}}}  # fmt: skip
        tool = {
            "role": "tool",
            "tool_call_id": "call00001",
            "name": "calculator",
            "content": str(a * (a + 7)),
        }
        history = [*first, {"role": "assistant", "content": "", "tool_calls": [call]}]
        cases.append((history, [tool], once.render(first, add_generation_prompt=True)))
    assert all(delta.injected_ids(h, new) == once.continued_ids(h, new, r)[0] for h, new, r in cases)
    times: dict[str, list[float]] = {"delta rule": [], "one rendering": []}
    for rep in range(rounds):
        for side in list(times) if rep % 2 else list(times)[::-1]:
            start = time.thread_time()
            for h, new, r in cases:
                delta.injected_ids(h, new) if side == "delta rule" else once.continued_ids(h, new, r)
            times[side].append((time.thread_time() - start) / n)
    load = Path("/proc/loadavg").read_text().split()[0]
    for side, values in times.items():
        print(
            f"{side}: {1e3 * statistics.median(values):.3f} ms per continuation "
            f"(median of {rounds}; load {load})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=200, help="episodes per round (2 model calls each)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (per side, alternating with --before)")
    ap.add_argument("--before", type=Path, help="another checkout (e.g. main) to measure the same way")
    ap.add_argument("--concurrent", type=int, default=1, help="episodes at once (threads sharing one client)")
    ap.add_argument("--keep-alive", action="store_true", help="serve with env.agent_keep_alive on")
    ap.add_argument("--json", action="store_true", help="(internal) measure one round here, print JSON")
    ap.add_argument("--continuations", action="store_true", help="the continued row's ids both ways (above)")
    args = ap.parse_args()
    if args.continuations:
        continuations()
        return
    if args.json:
        print(json.dumps(measure(args.episodes, args.repeats, args.concurrent, args.keep_alive)))
        return
    sides = {"this": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(args.repeats):
        for side in sides if rep % 2 == 0 else list(sides)[::-1]:
            root = sides[side]
            cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--episodes", str(args.episodes),
                   "--repeats", "1", "--concurrent", str(args.concurrent)]  # fmt: skip
            cmd += ["--keep-alive"] if args.keep_alive else []
            env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1",
                   "GRPO_BENCH_ROOT": str(root)}  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
            if proc.returncode != 0:
                raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])[0]
            results[side].append(r)
            print(f"round {rep} {side}: server {r['server_ms']:.3f} ms/call, "
                  f"client {r['client_ms']:.3f} ms/call ({r['calls']} calls)", flush=True)  # fmt: skip
    load = Path("/proc/loadavg").read_text().split()[0]
    for side, rs in results.items():
        server = statistics.median(r["server_ms"] for r in rs)
        client = statistics.median(r["client_ms"] for r in rs)
        print(
            f"{side}: server {server:.3f} ms/call, client {client:.3f} ms/call "
            f"(medians of {len(rs)}; load {load})"
        )


if __name__ == "__main__":
    main()
