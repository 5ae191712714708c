"""One grpo run of a matrix cell through the seed API with default settings; prints RESULT {json}.

PYTHONPATH=src python benchmarks/matrix_grpo.py --cell base --steps 4      (driver: benchmarks/matrix.py)

Only the workload is set (prompts per step, G, completion limit, β, sampling, learning rate, steps,
prompt length cap); micro-batch, engine, threads, precision and everything else are grpo's defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from common import (
    MATRIX_LEARNING_RATE,
    MATRIX_PROMPTS,
    MATRIX_RUNS,
    MATRIX_VARIATIONS,
    TEMPERATURE,
    emit,
    make_matrix_model,
    matrix_cell,
    matrix_rows,
    matrix_tokenizer,
    vm_hwm_mb,
    vowel_share,
)
from transformers import AutoModelForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.model.compiled import compile_report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", choices=sorted(MATRIX_VARIATIONS), required=True)
    ap.add_argument("--steps", type=int, default=4)
    # Not defaults: the seed API's row knob (issue 26's workload) and the compiled training block, for A/Bs.
    ap.add_argument("--gradient-accumulation-steps", type=int, default=None)
    ap.add_argument("--compile-training", action="store_true")
    ap.add_argument("--compile-decode", action="store_true")
    replay = ap.add_mutually_exclusive_group()  # default: null (auto), on where its conditions hold on a CPU
    replay.add_argument("--replay", action="store_true", help="train.replay_rollout_forward=true (A/B)")
    replay.add_argument("--no-replay", action="store_true", help="train.replay_rollout_forward=false (A/B)")
    args = ap.parse_args()
    cell = matrix_cell(args.cell)
    path = make_matrix_model(cell["eos"], cell["completion"])
    tok = matrix_tokenizer(path, cell["chat"])

    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            batch_size=MATRIX_PROMPTS,
            num_generations_per_prompt=cell["G"],
            max_new_tokens=cell["completion"],
            kl_coef=cell["beta"],
            temperature=TEMPERATURE,
            top_k=0,
            top_p=1.0,
            learning_rate=MATRIX_LEARNING_RATE,
            steps=args.steps,
            output_dir=out,
            logging_steps=1,
            save_steps=0,
        )
        cfg.update({"data.max_prompt_length": 1024})  # the workload's prompts are never cut
        if args.gradient_accumulation_steps is not None:
            cfg.update({"train.gradient_accumulation_steps": args.gradient_accumulation_steps})
        if args.compile_training:
            cfg.update({"model.compile_training": True})
        if args.compile_decode:
            cfg.update({"generation.compile_decode": True})
        if args.replay or args.no_replay:
            cfg.update({"train.replay_rollout_forward": bool(args.replay)})
        trainer = GRPOTrainer(
            model=load(),
            ref_model=load() if cell["beta"] else None,
            tokenizer=tok,
            config=cfg,
            train_dataset=matrix_rows(tok, cell, args.steps),
            reward_funcs=[vowel_share],
        )
        trainer.train()
        steps = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "time/step" in s]
    later = steps[1:]  # the first step warms up allocators and caches
    emit(
        {
            "framework": "grpo",
            "cell": args.cell,
            "step_times": [s["time/step"] for s in steps],
            "median_s": statistics.median(s["time/step"] for s in later),
            "completion_len": statistics.median(s["completion_len/mean"] for s in later),
            "stages": {k: statistics.median(s[k] for s in later) for k in later[0] if k.startswith("time/")},
            "micro_batch": cfg.resolved_micro_batch_size or "by tokens (train.micro_batch_tokens)",
            "compile_training": cfg.model.compile_training,
            "compile_decode": cfg.generation.compile_decode,
            "compile": compile_report()
            if cfg.model.compile_training or cfg.generation.compile_decode
            else None,
            "threads": torch.get_num_threads(),
            "peak_rss_mb": vm_hwm_mb(),
        },
        log=MATRIX_RUNS,
    )


if __name__ == "__main__":
    main()
