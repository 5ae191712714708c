"""TRL's GRPOTrainer on a real-size model directory, with the settings of benchmarks/real_size.py; prints
RESULT {json}. Runs in benchmarks/.venv-trl (started by real_size.py):

    benchmarks/.venv-trl/bin/python benchmarks/trl_real_step.py --model benchmarks/.cache/real/qwen2.5-0.5b

Same prompts as `grpo train` (the bundled tiny_math train split, first rows, as a user turn through the
model's chat template), the same float32 CPU model, β, group size, completion length and temperature.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch
from common import text_length
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl_step import StepTimer

DATA = Path(__file__).resolve().parents[1] / "src" / "grpo" / "assets" / "tiny_math" / "train.jsonl"


def lora_config():
    from peft import LoraConfig, TaskType

    # grpo's lora.* defaults: peft's target modules for the architecture, no dropout.
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lora", action="store_true", help="peft LoRA, r 8, alpha 16 (grpo's lora.* defaults)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import trl
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[: args.prompts * args.steps]]
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["question"]}],
            }
            for r in rows
        ]
    )
    cfg = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        gradient_accumulation_steps=1,
        max_completion_length=args.new_tokens,
        beta=args.beta,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=1e-6,
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
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=text_length,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[timer],
        peft_config=lora_config() if args.lora else None,
    )
    trainer.train()
    print(
        "RESULT "
        + json.dumps(
            {
                "framework": f"trl {trl.__version__}",
                "step_times": timer.times,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
