"""One `grpo` run on a benchmark workload; prints RESULT {json}. The TRL twin is trl_step.py.

PYTHONPATH=src python benchmarks/grpo_step.py --workload b --steps 4 [--engine transformers]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from common import (
    BETA,
    GENERATIONS,
    LEARNING_RATE,
    PROMPTS,
    TEMPERATURE,
    WORKLOADS,
    dataset_rows,
    emit,
    make_model,
    peak_rss_mb,
    vowel_reward,
)
from transformers import AutoTokenizer

from grpo import GRPOConfig, GRPOTrainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", default="native", choices=("native", "transformers"))
    # A memory knob only (the loss and gradient do not change): 2 groups per forward/backward keeps
    # activations, and so peak RSS, below TRL's gradient-checkpointed single micro-batch of 64.
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = make_model()
    tok = AutoTokenizer.from_pretrained(path)
    _, new_tokens = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            model={
                "name_or_path": str(path),
                "dtype": "float32",
                "device": "cpu",
                "gradient_checkpointing": args.gradient_checkpointing,
            },
            data={"use_chat_template": False, "max_prompt_length": 512},
            generation={
                "num_generations": GENERATIONS,
                "max_new_tokens": new_tokens,
                "temperature": TEMPERATURE,
                "top_k": 0,
                "top_p": 1.0,
                "engine": args.engine,
            },
            algorithm={"beta": BETA},
            optim={"learning_rate": LEARNING_RATE, "warmup_steps": 0},
            train={
                "prompts_per_step": PROMPTS,
                "micro_batch_size": args.micro_batch,
                "steps": args.steps,
                "output_dir": out,
                "logging_steps": 1,
                "save_steps": 0,
                "progress_bar": False,
                "tensorboard": False,
                "num_threads": args.threads,
            },
        )
        trainer = GRPOTrainer(
            config=cfg,
            train_dataset=dataset_rows(tok, args.workload, args.steps),
            reward_funcs=[vowel_reward],
        )
        trainer.train()
        steps = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "time/step" in s]
    times = [s["time/step"] for s in steps]
    later = steps[1:]  # the first step warms up allocators and caches
    emit(
        {
            "framework": f"grpo ({args.engine})",
            "workload": args.workload,
            "step_times": times,
            "median_s": statistics.median(s["time/step"] for s in later),
            "completion_tokens": statistics.median(
                s["completion_len/mean"] * PROMPTS * GENERATIONS for s in later
            ),
            "stages": {k: statistics.median(s[k] for s in later) for k in later[0] if k.startswith("time/")},
            "peak_rss_mb": peak_rss_mb(),
        }
    )


if __name__ == "__main__":
    main()
