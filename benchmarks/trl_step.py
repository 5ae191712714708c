"""One TRL GRPOTrainer run on a benchmark workload; prints RESULT {json}. Runs in benchmarks/.venv-trl.

benchmarks/.venv-trl/bin/python benchmarks/trl_step.py --workload b --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

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
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self.start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


class CompletionTokens(TrainerCallback):
    def __init__(self):
        self.per_step: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            self.per_step.append(logs["completions/mean_length"] * PROMPTS * GENERATIONS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import trl
    from trl import GRPOConfig, GRPOTrainer

    path = make_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _, new_tokens = WORKLOADS[args.workload]
    rows = dataset_rows(tok, args.workload, args.steps)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS * GENERATIONS,
            num_generations=GENERATIONS,
            gradient_accumulation_steps=1,
            max_completion_length=new_tokens,
            beta=BETA,
            temperature=TEMPERATURE,
            top_p=1.0,
            top_k=0,
            learning_rate=LEARNING_RATE,
            max_steps=args.steps,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            shuffle_dataset=False,
            seed=0,
            dataloader_num_workers=0,
        )
        timer, tokens = StepTimer(), CompletionTokens()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=vowel_reward,
            args=cfg,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[timer, tokens],
        )
        trainer.train()
    times = timer.times[1:]  # the first step warms up allocators and caches
    gen = tokens.per_step[1:] if len(tokens.per_step) > 1 else tokens.per_step
    emit(
        {
            "framework": f"trl {trl.__version__}",
            "workload": args.workload,
            "step_times": timer.times,
            "median_s": statistics.median(times),
            "completion_tokens": statistics.median(gen),
            "peak_rss_mb": peak_rss_mb(),
        }
    )


if __name__ == "__main__":
    main()
