"""Time to first token of a gateway request that arrives while a batch decodes, per engine, with and without
step-wise driving (issue 31 §2: real streaming; on vLLM its continuous batching).

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/gateway_ttft.py --repeats 5 --threads 1

The bundled tiny-math-lm, greedy. Batch A: 4 streamed requests on a prompt that decodes 96 tokens (no eos).
Request B (a chat question, ~10 tokens) arrives half-way through A (half of A's duration, measured alone
first). Through the gateway's batcher (gateway/batching.py, its default window), four variants, interleaved
in each repeat so drift in the machine's speed hits all alike:
  vllm-before          vLLM through generate/continue_rows only: the batcher's engine calls, no streaming
  vllm-continuous      vLLM driven step by step (add_row/step_rows): B joins the running batch
  transformers-before  transformers generate without on_step: a request's tokens arrive when its call ends
  transformers-stream  transformers generate with on_step: B waits for A's call, then streams
Wall clock (what a client waits), so name the machine's load beside the numbers; prints medians (seconds).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.gateway.batching import Batcher, Job
from grpo.model.loading import resolve_path
from grpo.records import SamplingParams
from grpo.rollout.transformers import TransformersEngine
from grpo.rollout.vllm import VLLMEngine

NEW_TOKENS = 96


class Stamped(queue.SimpleQueue):
    """A job's events, each stamped when the batcher put it."""

    def __init__(self):
        super().__init__()
        self.stamps: list[tuple[float, str]] = []

    def put(self, item, block=True, timeout=None):
        self.stamps.append((time.perf_counter(), item[0]))
        super().put(item, block, timeout)


class CallsOnly:
    """The engine seen through generate/continue_rows alone: no on_step, no add_row/step_rows."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, n, sampling, chunk_prompts=None):
        return self.engine.generate(prompts, n, sampling, chunk_prompts)

    def continue_rows(self, rows, sampling):
        return self.engine.continue_rows(rows, sampling)


def drain(job: Job) -> None:
    while job.events.get(timeout=600)[0] == "token":
        pass


def once(engine, long_ids, short_ids, delay: float | None) -> dict:
    """A's 4 requests, then B after `delay` (None: A alone); times from A's submission."""
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    batcher = Batcher(engine, greedy, live=lambda: (5, 0))  # five live sessions: A's four and B
    try:
        start = time.perf_counter()
        a = [batcher.submit(Job(list(long_ids), NEW_TOKENS, stream=True, events=Stamped())) for _ in range(4)]
        if delay is None:
            for job in a:
                drain(job)
            return {"a_s": time.perf_counter() - start}
        time.sleep(delay)
        b_at = time.perf_counter()
        b = batcher.submit(Job(list(short_ids), NEW_TOKENS, stream=True, events=Stamped()))
        for job in (*a, b):
            drain(job)
    finally:
        batcher.close()
    first = next(t for t, kind in b.events.stamps if kind in ("token", "done"))  # unstreamed: the reply
    done = next(t for t, kind in b.events.stamps if kind == "done")
    a_done = max(t for job in a for t, kind in job.events.stamps if kind == "done")
    return {"b_ttft_s": first - b_at, "b_reply_s": done - b_at, "a_s": a_done - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_path("tiny-math-lm")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    long_ids = tok("1 2 3 4 5 6 7 8", add_special_tokens=False)["input_ids"]  # greedy: 96 tokens, no eos
    short_ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    vllm_engine = VLLMEngine(model, tok)
    torch.set_num_threads(args.threads)
    hf_engine = TransformersEngine(model, tok)
    variants = {
        "vllm-before": CallsOnly(vllm_engine),
        "vllm-continuous": vllm_engine,
        "transformers-before": CallsOnly(hf_engine),
        "transformers-stream": hf_engine,
    }
    delays = {name: once(engine, long_ids, short_ids, None)["a_s"] / 2 for name, engine in variants.items()}
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, engine in variants.items():
            rows[name].append(once(engine, long_ids, short_ids, delays[name]))
    vllm_engine.close()
    for name, runs in rows.items():
        medians = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        print(json.dumps({"variant": name, "b_arrives_s": round(delays[name], 3), **medians}))


if __name__ == "__main__":
    main()
