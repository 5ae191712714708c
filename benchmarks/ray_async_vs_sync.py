"""Ray rollout, sync vs async, on a long-completion workload: learner steps per second.

    PYTHONPATH=src python benchmarks/ray_async_vs_sync.py --steps 6 --new-tokens 256

Workload: the bundled model's architecture with random weights (so completions run long: eos is one
token in 640), 8 prompts × 8 completions of up to --new-tokens tokens, β = 0.04 (reference pass on).
One Ray rollout actor and the learner, one CPU thread each, so on a 2-core machine each has a core:
the same split as one learner GPU and one rollout GPU. sync: the learner waits for every batch
(rollout, then update, in turn); async: the actor samples batch k+1 while the learner trains on
batch k (max_staleness 1). Step 1 (start-up) is left out of the mean. Prints a markdown table and
writes benchmarks/results/ray_async_vs_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import load_rows
from grpo.model.loading import bundled_model_path


def constant(prompts, completions, **_):
    """Reward with spread in every group, so every step has a gradient; its value does not matter here."""
    del prompts  # reward functions take every argument by keyword; this one reads only the completions
    return [float(len(c) % 7) for c in completions]


def random_model(directory: Path) -> str:
    config = AutoConfig.from_pretrained(bundled_model_path())
    config.max_position_embeddings = 512  # room for prompt + 256 new tokens (rotary: no new weights)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(directory)
    return str(directory)


def run(mode: str, model: str, out: Path, args) -> dict:
    cfg = GRPOConfig(
        **{
            "model.name_or_path": model,
            "rollout.mode": mode,
            "max_staleness": 1,
            "steps": args.steps,
            "batch_size": 8,
            "num_generations": 8,
            "max_new_tokens": args.new_tokens,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-5,
            "warmup_steps": 0,
            "beta": 0.04,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "logging_steps": 1,
            "progress_bar": False,
            "eval_dataset": None,
            "num_threads": 1,
            "tensorboard": False,
            "save_steps": 0,
            "output_dir": str(out / mode),
            "seed": 3,
        }
    )
    rows = load_rows("tiny_math", cfg.data)[:200]
    start = time.perf_counter()
    GRPOTrainer(config=cfg, train_dataset=rows, reward_funcs=[constant]).train()
    wall = time.perf_counter() - start
    lines = [json.loads(x) for x in (out / mode / "metrics.jsonl").read_text().splitlines()]
    steady = [x["time/step"] for x in lines[1:]]
    return {
        "mode": mode,
        "steps_per_s": 1 / statistics.mean(steady),
        "step_s": statistics.mean(steady),
        "rollout_wait_s": statistics.mean(x.get("time/rollout", 0.0) for x in lines[1:]),
        "update_s": statistics.mean(x["time/update"] + x.get("time/reference", 0.0) for x in lines[1:]),
        "tokens_per_step": statistics.mean(x["completion_len/mean"] * 64 for x in lines[1:]),
        "staleness_max": max(x["rollout/staleness"] for x in lines),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    import ray

    torch.set_num_threads(1)
    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's default 15 starves actors on a busy machine
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(Path(tmp) / "model")
        results = [run(mode, model, Path(tmp), args) for mode in ("sync", "async")]
    ray.shutdown()
    print("| mode | steps/s | s/step | rollout wait s/step | update s/step | tokens/step | max staleness |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['mode']} | {r['steps_per_s']:.4f} | {r['step_s']:.2f} | {r['rollout_wait_s']:.2f} | "
            f"{r['update_s']:.2f} | {r['tokens_per_step']:.0f} | {r['staleness_max']:.0f} |"
        )
    print(f"async / sync steps per second: {results[1]['steps_per_s'] / results[0]['steps_per_s']:.2f}x")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "ray_async_vs_sync.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
