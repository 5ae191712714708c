"""One TRL GRPOTrainer run on a benchmark workload or matrix cell; prints RESULT {json}. Runs in
benchmarks/.venv-trl. The grpo twins are grpo_step.py (--workload) and matrix_grpo.py (--cell).

benchmarks/.venv-trl/bin/python benchmarks/trl_step.py --workload b --steps 4
benchmarks/.venv-trl/bin/python benchmarks/trl_step.py --cell base --steps 4

A matrix cell sets only the workload (batch of P·G completions per optimizer step, G, completion
limit, β, sampling, learning rate, steps, float32 on the CPU); the rest is TRL's defaults, gradient
checkpointing included. --threads defaults to torch's own choice there, as it does for a user.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (
    BETA,
    GENERATIONS,
    LEARNING_RATE,
    MATRIX_LEARNING_RATE,
    MATRIX_PROMPTS,
    MATRIX_RUNS,
    MATRIX_VARIATIONS,
    PROMPTS,
    TEMPERATURE,
    WORKLOADS,
    dataset_rows,
    emit,
    make_matrix_model,
    make_model,
    matrix_cell,
    matrix_rows,
    matrix_tokenizer,
    peak_rss_mb,
    vm_hwm_mb,
    vowel_reward,
    vowel_share,
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
    """Mean completion length per logged step (TRL's completions/mean_length)."""

    def __init__(self):
        self.per_step: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            self.per_step.append(logs["completions/mean_length"])


def workload_settings(args) -> tuple[dict, Path, object, list[dict], dict]:
    """(GRPOConfig settings, model path, tokenizer, dataset rows, result fields) of --workload or --cell."""
    if args.cell:
        cell = matrix_cell(args.cell)
        path = make_matrix_model(cell["eos"], cell["completion"])
        tok = matrix_tokenizer(path, cell["chat"])
        settings = {
            "per_device_train_batch_size": MATRIX_PROMPTS * cell["G"],
            "num_generations": cell["G"],
            "max_completion_length": cell["completion"],
            "beta": cell["beta"],
            "learning_rate": MATRIX_LEARNING_RATE,
        }
        return settings, path, tok, matrix_rows(tok, cell, args.steps), {"cell": args.cell}
    path = make_model()
    tok = AutoTokenizer.from_pretrained(path)
    settings = {
        "per_device_train_batch_size": PROMPTS * GENERATIONS,
        "num_generations": GENERATIONS,
        "gradient_accumulation_steps": 1,
        "max_completion_length": WORKLOADS[args.workload][1],
        "beta": BETA,
        "learning_rate": LEARNING_RATE,
    }
    return settings, path, tok, dataset_rows(tok, args.workload, args.steps), {"workload": args.workload}


def main() -> None:
    ap = argparse.ArgumentParser()
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--workload", choices=sorted(WORKLOADS))
    which.add_argument("--cell", choices=sorted(MATRIX_VARIATIONS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import trl
    from trl import GRPOConfig, GRPOTrainer

    settings, path, tok, rows, fields = workload_settings(args)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out,
            **settings,
            temperature=TEMPERATURE,
            top_p=1.0,
            top_k=0,
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
            reward_funcs=vowel_share if args.cell else vowel_reward,
            args=cfg,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[timer, tokens],
        )
        trainer.train()
    times = timer.times[1:]  # the first step warms up allocators and caches
    lengths = tokens.per_step[1:] if len(tokens.per_step) > 1 else tokens.per_step
    rows_per_step = settings["per_device_train_batch_size"]
    emit(
        {
            "framework": f"trl {trl.__version__}",
            **fields,
            "step_times": timer.times,
            "median_s": statistics.median(times),
            "completion_len": statistics.median(lengths),
            "completion_tokens": statistics.median(lengths) * rows_per_step,
            "threads": torch.get_num_threads(),
            "peak_rss_mb": vm_hwm_mb() if args.cell else peak_rss_mb(),
        },
        log=MATRIX_RUNS if args.cell else None,
    )


if __name__ == "__main__":
    main()
