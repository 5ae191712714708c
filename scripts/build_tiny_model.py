"""Build the bundled `tiny-math-lm`: a BPE tokenizer and a few-million-parameter Llama, trained from scratch
on the `tiny_math` train split so that it is *partially* competent in a way GRPO can fix.

    .venv/bin/python scripts/make_tiny_math.py     # first, if the task data is missing
    .venv/bin/python scripts/build_tiny_model.py   # writes src/grpo/assets/tiny-math-lm/ in ~15 min (2 cores)
    .venv/bin/python scripts/build_tiny_model.py --steps 0 --init-from DIR --out /tmp/m   # phase 2 only

Stages: (1) train a byte-level BPE tokenizer whose digits are always single tokens (so arithmetic is
learnable digit by digit) and give it a chat template; (2) build a randomly initialised
LlamaForCausalLM from `--seed`; (3a) supervised fine-tuning on worked solutions
(`6*9=54\n54-34=20\n#### 20` + `<|end|>`, loss on the completion only) for `--steps`;
(3b) `--terse-steps` more on a mix in which `--terse-fraction` of the targets are the bare answer
(`#### 20`); (4) held-out evaluation: greedy accuracy, format rate, how often greedy decoding shows its
working and how accurate each style is, pass@8 with temperature-1 sampling (what GRPO samples with);
(5) save in Hugging Face format.

Why two phases: after (3a) the model solves most problems *when it writes out the steps*; (3b) teaches
it to often skip them, as models tuned on answer-only data do, and answering in one go is mostly wrong.
Greedy decoding then picks the bare answer on most problems, while sampled completions still show
their working often enough (and are right when they do) for GRPO's group-relative reward to select
that behaviour: the demo's gain is GRPO learning to show its work, the same behaviour RL is known for
on large models. `--snapshots` / `--terse-snapshots` save and evaluate intermediate checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "src/grpo/assets/tiny_math"
DEFAULT_OUT = ROOT / "src/grpo/assets/tiny-math-lm"

PAD, EOS = "<|pad|>", "<|end|>"
SPECIAL_TOKENS = [PAD, EOS, "<|user|>", "<|assistant|>", "<|system|>"]
# "<|role|>\n{content}\n" per turn; an assistant turn ends with the eos token instead of the newline, so
# a generation prompt is "<|user|>\n{question}\n<|assistant|>\n" and the model answers "...#### 16<|end|>".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|end|>' + '\\n' }}"
    "{%- elif message['role'] in ['system', 'user'] -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{%- else -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
ANSWER_RE = re.compile(r"####\s*(-?\d+)")


def load_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


# --- (1) tokenizer ----------------------------------------------------------------------------------


def build_tokenizer(rows: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Digits first (each digit its own token, so "128" and "12" share pieces), then GPT-2 style byte-level
    # splitting on spaces and punctuation; the byte-level decoder makes decode(encode(text)) == text.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator((text for row in rows for text in (row["question"], row["answer"])), trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[2:],
        padding_side="left",  # decoder-only generation appends on the right
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def check_round_trip(tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> None:
    for row in rows:
        text = chat_prompt(tokenizer, row["question"]) + row["answer"] + EOS
        decoded = tokenizer.decode(tokenizer(text).input_ids)
        assert decoded == text, f"tokenizer does not round-trip: {text!r} -> {decoded!r}"


def chat_prompt(tokenizer: PreTrainedTokenizerFast, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


# --- (2) model --------------------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=True,  # the embedding is a large share of a model this small
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# --- (3) supervised fine-tuning ---------------------------------------------------------------------


def encode_examples(
    tokenizer: PreTrainedTokenizerFast, rows: list[dict], completions: list[str]
) -> list[tuple[list[int], int]]:
    """(token ids of prompt + completion + eos, prompt length). Prompt and completion are tokenized
    separately, exactly as at generation time, so the model learns the token boundaries it sees in
    rollouts."""
    prompts = tokenizer([chat_prompt(tokenizer, r["question"]) for r in rows], add_special_tokens=False)
    answers = tokenizer([c + EOS for c in completions], add_special_tokens=False)
    return [(p + a, len(p)) for p, a in zip(prompts.input_ids, answers.input_ids, strict=True)]


def collate(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)  # [B, T], right-padded
    labels = torch.full((len(examples), width), -100)  # [B, T], -100 = no loss
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask, labels


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% at `--schedule-steps`. The schedule does not depend on
    `--steps`, so stopping early gives exactly the same model as a snapshot of a longer run."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.schedule_steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def terse_completions(rows: list[dict], terse_fraction: float, seed: int) -> list[str]:
    """Phase-2 SFT targets: the bare final line (`#### 20`) with probability `terse_fraction`, else the
    worked solution. Fixed per row (seeded), so the build is reproducible."""
    rng = random.Random(seed)
    return [r["answer"].rsplit("\n", 1)[-1] if rng.random() < terse_fraction else r["answer"] for r in rows]


def sft(model, tokenizer, examples, eval_rows, args, steps: int, lr_fn, phase: str) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(examples), generator=generator).tolist()
    position, start = 0, time.time()
    snapshots = set(args.snapshots if phase == "worked" else args.terse_snapshots)
    model.train()
    for step in range(steps):
        if position + args.batch_size > len(order):  # next epoch: reshuffle
            order, position = torch.randperm(len(examples), generator=generator).tolist(), 0
        batch = [examples[i] for i in order[position : position + args.batch_size]]
        position += args.batch_size
        input_ids, attention_mask, labels = collate(batch, tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_fn(step)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % 50 == 0 or step == 0:
            print(
                f"{phase} step {step + 1:5d}/{steps}  loss {loss.item():.4f}  lr {lr_fn(step):.2e}  "
                f"{time.time() - start:6.0f}s",
                flush=True,
            )
        if step + 1 in snapshots:
            out = args.snapshot_dir / f"{phase}{step + 1}"
            metrics = evaluate(model, tokenizer, eval_rows, args)
            save(model, tokenizer, out, metrics, args)
            model.train()
            print(f"snapshot {out}: {format_metrics(metrics)}", flush=True)


# --- (4) evaluation ---------------------------------------------------------------------------------


def extract_answer(text: str) -> int | None:
    """The number after the last `####`, as GSM8K graders do."""
    matches = ANSWER_RE.findall(text)
    return int(matches[-1]) if matches else None


@torch.no_grad()
def generate(
    model, tokenizer, questions: list[str], num_samples: int, max_new_tokens: int, batch_size: int
) -> list[tuple[list[int], str]]:
    """(completion ids, completion text) for each question x sample; greedy when num_samples == 1."""
    model.eval()
    results = []
    for i in range(0, len(questions), batch_size):
        prompts = [chat_prompt(tokenizer, q) for q in questions[i : i + batch_size]]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = (
            {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
            if num_samples > 1
            else {"do_sample": False}
        )
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, num_return_sequences=num_samples, **sampling
        )
        for row in out[:, enc.input_ids.shape[1] :].tolist():
            ids = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
            results.append((ids, tokenizer.decode(ids, skip_special_tokens=True)))
    return results


def evaluate(model, tokenizer, rows: list[dict], args: argparse.Namespace) -> dict[str, float]:
    questions = [r["question"] for r in rows]
    targets = [extract_answer(r["answer"]) for r in rows]
    greedy = generate(model, tokenizer, questions, 1, args.max_new_tokens, args.eval_batch_size)
    correct = [extract_answer(text) == t for (_, text), t in zip(greedy, targets, strict=True)]
    # Well formatted: stopped with eos right after a final "#### <number>" line.
    formatted = [
        ids[-1:] == [tokenizer.eos_token_id] and re.search(r"#### \d+$", text) is not None
        for ids, text in greedy
    ]

    k, n_pass = args.pass_k, args.pass_k_problems
    torch.manual_seed(args.seed)
    sampled = generate(model, tokenizer, questions[:n_pass], k, args.max_new_tokens, max(1, 256 // k))
    sample_correct = [extract_answer(text) == targets[j // k] for j, (_, text) in enumerate(sampled)]
    pass_k = [any(sample_correct[j * k : (j + 1) * k]) for j in range(n_pass)]

    # "Shows work": writes at least one equation line before the final answer.
    worked = [text.count("\n") > 0 for _, text in greedy]
    n_worked = sum(worked)
    prompt_lens = [
        len(tokenizer(chat_prompt(tokenizer, q), add_special_tokens=False).input_ids) for q in questions
    ]
    return {
        "greedy_accuracy": sum(correct) / len(rows),
        "format_rate": sum(formatted) / len(rows),
        "shows_work_rate": n_worked / len(rows),
        "accuracy_when_showing_work": sum(c for c, w in zip(correct, worked, strict=True) if w)
        / max(1, n_worked),
        "accuracy_when_terse": sum(c for c, w in zip(correct, worked, strict=True) if not w)
        / max(1, len(rows) - n_worked),
        f"pass@{k}": sum(pass_k) / n_pass,
        "sample_accuracy": sum(sample_correct) / len(sampled),
        "mean_completion_tokens": sum(len(ids) for ids, _ in greedy) / len(greedy),
        "mean_prompt_tokens": sum(prompt_lens) / len(prompt_lens),
    }


def format_metrics(m: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" if v < 10 else f"{k} {v:.1f}" for k, v in m.items())


# --- (5) save ---------------------------------------------------------------------------------------


def save(model, tokenizer, out: Path, metrics: dict[str, float], args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    build_info = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (out / "build_info.json").write_text(
        json.dumps({"args": build_info, "metrics": metrics}, indent=2) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=1500, help="phase-1 SFT steps on worked solutions")
    parser.add_argument(
        "--schedule-steps",
        type=int,
        default=1500,
        help="length of the phase-1 learning-rate schedule (cosine to 10%% of --lr)",
    )
    parser.add_argument(
        "--terse-steps",
        type=int,
        default=100,
        help="phase-2 SFT steps on a mix of worked and bare-answer targets",
    )
    parser.add_argument(
        "--terse-fraction",
        type=float,
        default=0.45,
        help="share of phase-2 targets that give the bare answer without working",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this saved model + tokenizer instead of building new ones",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=640)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--eval-batch-size", type=int, default=250)
    parser.add_argument("--pass-k", type=int, default=8)
    parser.add_argument("--pass-k-problems", type=int, default=200)
    parser.add_argument(
        "--snapshots",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="comma-separated SFT steps at which to also save + evaluate a checkpoint",
    )
    parser.add_argument(
        "--terse-snapshots",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="the same for the phase-2 (terse-mix) steps",
    )
    parser.add_argument("--snapshot-dir", type=Path, default=ROOT / "work_tmp/candidates")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    start = time.time()
    train_rows, test_rows = load_jsonl(DATA_DIR / "train.jsonl"), load_jsonl(DATA_DIR / "test.jsonl")

    if args.init_from:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
        model = LlamaForCausalLM.from_pretrained(args.init_from)
    else:
        tokenizer = build_tokenizer(train_rows, args.vocab_size)
        model = build_model(tokenizer, args)
    check_round_trip(tokenizer, train_rows[:2000] + test_rows)
    print(f"tokenizer: {len(tokenizer)} tokens; prompt example {chat_prompt(tokenizer, 'Q?')!r}")
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")

    worked = encode_examples(tokenizer, train_rows, [r["answer"] for r in train_rows])
    sft(model, tokenizer, worked, test_rows, args, args.steps, lambda step: lr_at(step, args), "worked")
    if args.terse_steps:
        mixed = encode_examples(
            tokenizer, train_rows, terse_completions(train_rows, args.terse_fraction, args.seed + 1)
        )
        floor = args.lr * 0.1
        sft(model, tokenizer, mixed, test_rows, args, args.terse_steps, lambda _step: floor, "terse-mix")
    metrics = evaluate(model, tokenizer, test_rows, args)
    metrics["build_seconds"] = time.time() - start
    save(model, tokenizer, args.out, metrics, args)
    print(f"held-out ({len(test_rows)} problems): {format_metrics(metrics)}")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
