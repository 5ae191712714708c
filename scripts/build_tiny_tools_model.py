"""Build the bundled `tiny-tools-lm`: a tokenizer with tool-calling tokens, a chat template that renders
`tools=` schemas and Hermes-style `<tool_call>` JSON, and a few-million-parameter Llama trained on the
`tiny_tools` train split to call the `calculator` tool on *part* of the problems, so GRPO can fix the rest.

    .venv/bin/python scripts/make_tiny_tools.py          # first, if the task data is missing
    .venv/bin/python scripts/build_tiny_tools_model.py   # writes src/grpo/assets/tiny-tools-lm/

Stages: (1) byte-level BPE tokenizer (digits single tokens; `<tool_call>`, `</tool_call>` and `<|tool|>`
special) and the chat template; (2) a LlamaForCausalLM from
`--seed`, its layers warm-started from tiny-math-lm (`--warm-start none`: random); (3a) supervised
fine-tuning on whole conversations, loss on the assistant's tokens only, with `--call-fraction` of the
traces calling the calculator (one call with the whole expression, or two: the first product, then the
rest) and the others answering in one go with a plausible but usually wrong number (`#### 9712`);
(3b) `--mix-steps` more in which bare-arithmetic questions ("What is 347 times 28?") call the tool with
probability `--bare-call-rate` and word problems with `--word-call-rate`; (4) held-out evaluation with
the tool in the loop (greedy accuracy, the same with the tool disabled, tool-call rate, pass@8 at
temperature 1, tokens per episode); (5) save in Hugging Face format.

Each trace's system block is rendered from a tool schema whose descriptions are drawn from paraphrases
(and the real `calculator` docstring), so a user's own calculator with its own docstring is called too.
A few traces get an error back from the tool and then answer in one go, as the model must when the tool
is disabled or a call is malformed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import get_json_schema

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from make_tiny_tools import make_problem  # noqa: E402 (scripts/ is on the path: this script's own folder)
from task_data import unique_problems  # noqa: E402

from grpo.agents.calculator import calculator  # noqa: E402
from grpo.rewards.math import gsm8k_correctness  # noqa: E402

DATA_DIR = ROOT / "src/grpo/assets/tiny_tools"
DEFAULT_OUT = ROOT / "src/grpo/assets/tiny-tools-lm"

PAD, EOS, TOOL_ROLE = "<|pad|>", "<|end|>", "<|tool|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, EOS, "<|user|>", "<|assistant|>", "<|system|>", TOOL_ROLE, CALL_OPEN, CALL_CLOSE]

# "<|role|>\n{content}\n" per message. With `tools`, a system block first lists each tool as
# "name(arg: type, ...) - description" and one "  arg: description" line per described argument, read from
# the schema transformers builds (get_json_schema). An assistant message is its content, then one
# "<tool_call>\n{json}\n</tool_call>" per call, then the eos token "<|end|>" and "\n"; a tool result is
# "<|tool|>\n{content}\n". Every message renders on its own, so the template is prefix-preserving.
CHAT_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- if tools -%}"
    "{{ '<|system|>\\n' }}{%- if system -%}{{ system + '\\n' }}{%- endif -%}{{ 'Tools:\\n' }}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = fn['parameters'] if fn['parameters'] is defined and fn['parameters'] else {} -%}"
    "{%- set props = params['properties'] if params['properties'] is defined else {} -%}"
    "{{ fn['name'] + '(' }}"
    "{%- for name, prop in props.items() -%}"
    "{{ name + ': ' + (prop['type'] if prop['type'] is string else (prop['type'] | join('|'))"
    " if prop['type'] is defined else 'any') }}{{ ', ' if not loop.last }}"
    "{%- endfor -%}"
    "{{ ')' }}{%- if fn['description'] is defined and fn['description'] -%}"
    "{{ ' - ' + fn['description'] }}{%- endif -%}{{ '\\n' }}"
    "{%- for name, prop in props.items() -%}"
    "{%- if prop['description'] is defined and prop['description'] -%}"
    "{{ '  ' + name + ': ' + prop['description'] + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endfor -%}"
    "{%- elif system -%}{{ '<|system|>\\n' + system + '\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\\n' }}{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -}}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|end|>\\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|tool|>\\n' + message['content'] + '\\n' }}"
    "{%- elif message['role'] in ['system', 'user'] -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{%- else -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
BARE_RE = re.compile(r"^(What is|Compute|How much is)")  # the bare-arithmetic question phrasings

# Paraphrases of the calculator's description and of its argument's, so that the model calls a
# calculator whatever its docstring says (a user brings their own).
TOOL_DESCRIPTIONS = [
    "Evaluate an arithmetic expression and return its value.",
    "A calculator: computes the value of a math expression.",
    "Calculate the result of a mathematical expression.",
    "Evaluates a math expression such as 3*(4+5).",
    "Compute an arithmetic expression exactly.",
    "Returns the numeric value of an arithmetic expression.",
    "Simple calculator for + - * / and parentheses.",
    "Do arithmetic.",
    "Use this to multiply, add, subtract or divide numbers.",
    "",
]
ARG_DESCRIPTIONS = [
    'The arithmetic expression to evaluate, e.g. "347*28" or "(12+5)*3".',
    "The expression to compute.",
    "A math expression, for example 12*34+5.",
    "Arithmetic expression using numbers, + - * / and parentheses.",
    "What to calculate.",
    "the formula",
    "An expression like 2*(3+4).",
    "",
]
# What a failed call gets back ({e}: the expression), including the texts grpo's ToolBox writes, so a model
# whose calculator is offline (the demo's control) answers in one go after the error instead of retrying.
TOOL_ERRORS = [
    "Error: the calculator is not available.",
    "Error: tool disabled",
    "Error: calculator failed: internal error",
    "Error: timed out",
    "calculator raised RuntimeError: the calculator is offline; '{e}' was not evaluated",
    "calculator did not finish within 5 s; its result, if any, is lost.",
    "calculator raised ValueError: internal error",
]
ANSWER_RE = re.compile(r"####\s*(-?\d+)")


def load_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f]


def calculator_schema(rng: random.Random | None = None) -> dict:
    """The real calculator's schema, or (given an rng) one with paraphrased descriptions."""
    schema = get_json_schema(calculator)
    if rng is None or rng.random() < 0.2:
        return schema
    schema = copy.deepcopy(schema)
    schema["function"]["description"] = rng.choice(TOOL_DESCRIPTIONS)
    schema["function"]["parameters"]["properties"]["expression"]["description"] = rng.choice(ARG_DESCRIPTIONS)
    return schema


# --- (1) tokenizer and chat template ------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Digits first (each digit its own token, as in tiny-math-lm), then GPT-2 style byte-level splitting;
    # the byte-level decoder makes decode(encode(text)) == text.
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
    special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    tok.train_from_iterator((special.sub("\n", text) for text in texts), trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[2:],
        padding_side="left",  # decoder-only generation appends on the right
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def render(tokenizer, messages: list[dict], tools: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


# --- SFT traces ----------------------------------------------------------------------------------------


def guess_near(value: int, rng: random.Random) -> int:
    """A plausible one-shot answer: right magnitude, usually wrong (what a model that cannot multiply in
    its head says); right 5% of the time."""
    if rng.random() < 0.05:
        return value
    for _ in range(100):
        guess = round(value * (1 + rng.uniform(-0.15, 0.15)))
        if guess != value and guess > 0:
            return guess
    return value + rng.choice([1, 2]) if value < 3 else value - 1  # small values: ±15% rounds back to it


def tool_call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def split_expression(expression: str) -> tuple[str, str] | None:
    """'23*45+12*67' -> ('23*45', '+12*67'): the first product and what follows it (two-call traces)."""
    match = re.fullmatch(r"(\d+\*\d+)([+-].+)", expression)
    return (match.group(1), match.group(2)) if match else None


def trace(row: dict, style: str, rng: random.Random) -> list[dict]:
    """The assistant/tool messages of one solution: 'call' (one or two calculator calls), 'guess' (the
    answer in one go) or 'error' (a call the tool answers with an error, then a guess)."""
    expression = row["answer"].split("=", 1)[0]
    value = int(ANSWER_RE.search(row["answer"]).group(1))
    if style == "guess":
        return [{"role": "assistant", "content": f"#### {guess_near(value, rng)}"}]
    if style == "error":
        return [
            {"role": "assistant", "content": "", "tool_calls": [tool_call(expression)]},
            {"role": "tool", "name": "calculator", "content": rng.choice(TOOL_ERRORS).format(e=expression)},
            {"role": "assistant", "content": f"#### {guess_near(value, rng)}"},
        ]
    messages = []
    parts = split_expression(expression)
    if parts and rng.random() < 0.5:  # two calls: the first product, then the rest on its result
        first = calculator(parts[0])
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [tool_call(parts[0])]},
            {"role": "tool", "name": "calculator", "content": first},
        ]
        expression = first + parts[1]
    result = calculator(expression)
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [tool_call(expression)]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"#### {result}"},
    ]
    return messages


def fresh_problems(count: int, exclude: set[str], seed: int) -> list[dict]:
    """`count` more problems from the task's own generator, none of whose questions is in `exclude` (the
    held-out split, and the train split so GRPO's prompts stay the ones it has). Supervised traces over many
    different numbers teach the model to copy numbers into a call, not to remember 6,000 problems."""
    return unique_problems(make_problem, random.Random(seed), count, exclude)


def conversations(rows: list[dict], call_rate, error_rate: float, seed: int) -> list[tuple[list, list]]:
    """(messages, tools) per row; `call_rate(row)` is the chance that the row's trace calls the tool."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        tools = [calculator_schema(rng)]
        u = rng.random()
        style = "error" if u < error_rate else "call" if u < error_rate + call_rate(row) else "guess"
        out.append(([{"role": "user", "content": row["question"]}, *trace(row, style, rng)], tools))
    return out


def encode_conversation(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask): each assistant message is tokenized on its own (as sampled, with its eos),
    everything between them is the text the template adds (as an episode runner injects it), mask 0."""
    ids, mask = [], []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], tools, generation_prompt=True)
        after = render(tokenizer, messages[: i + 1], tools)
        injected = before[len(done) :]
        sampled = after[len(before) :].removesuffix("\n")  # the template's "\n" after eos is injected too
        assert before.startswith(done) and after.startswith(before), "chat template is not prefix-preserving"
        for text, flag in ((injected, 0), (sampled, 1)):
            piece = tokenizer(text, add_special_tokens=False).input_ids
            ids += piece
            mask += [flag] * len(piece)
        done = before + sampled
    return ids, mask


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)  # [B, T], right-padded
    labels = torch.full((len(examples), width), -100)  # [B, T], -100 = no loss
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        row = torch.tensor(ids)
        input_ids[i, : len(ids)] = row
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), row, -100)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask, labels


# --- (2) model ------------------------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=512,  # tools block + question + three turns fit with room to spare
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if args.warm_start:
        warm_start(model, tokenizer, args.warm_start)
    return model


@torch.no_grad()
def warm_start(model: LlamaForCausalLM, tokenizer, source: Path) -> None:
    """Start from tiny-math-lm's weights (it already reads numbers and writes `#### n`; a shorter build).
    Its vocabulary differs: a token both have keeps its embedding, any other gets the mean embedding of
    the pieces tiny-math-lm's tokenizer cuts its text into; the new special tokens keep their random init."""
    old_tok = PreTrainedTokenizerFast.from_pretrained(source)
    old = LlamaForCausalLM.from_pretrained(source)
    if (
        old.config.hidden_size != model.config.hidden_size
        or old.config.num_hidden_layers != model.config.num_hidden_layers
    ):
        raise SystemExit(
            f"--warm-start {source}: its shape differs from --hidden/--layers; drop --warm-start"
        )
    old_vocab, old_emb = old_tok.get_vocab(), old.get_input_embeddings().weight
    new_emb = model.get_input_embeddings().weight
    reused = 0
    for token, index in tokenizer.get_vocab().items():
        if token in old_vocab:
            new_emb[index] = old_emb[old_vocab[token]]
            reused += 1
        elif token not in SPECIAL_TOKENS:
            pieces = old_tok(tokenizer.convert_tokens_to_string([token]), add_special_tokens=False).input_ids
            if pieces:
                new_emb[index] = old_emb[pieces].mean(0)
    state = {k: v for k, v in old.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("embed_tokens" in k or "lm_head" in k for k in missing), (
        missing,
        unexpected,
    )
    print(f"warm start from {source}: {reused} of {len(tokenizer)} token embeddings reused, the rest mapped")


# --- (3) supervised fine-tuning -------------------------------------------------------------------------


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% at `--steps` (phase 1)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(examples: list, batch_size: int, generator: torch.Generator) -> list[list[int]]:
    """One epoch of batches of similar length (less padding, a much cheaper step on a CPU): shuffle,
    sort windows of 50 batches by length, cut, shuffle the batches."""
    order = torch.randperm(len(examples), generator=generator).tolist()
    window = batch_size * 50
    out = []
    for i in range(0, len(order) - batch_size + 1, window):
        chunk = sorted(order[i : i + window], key=lambda j: len(examples[j][0]))
        out += [chunk[k : k + batch_size] for k in range(0, len(chunk) - batch_size + 1, batch_size)]
    return [out[i] for i in torch.randperm(len(out), generator=generator).tolist()]


def sft(model, tokenizer, examples, steps: int, lr_fn, args, phase: str, on_snapshot=None) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(args.seed)
    epoch, start = [], time.time()
    model.train()
    for step in range(steps):
        if not epoch:
            epoch = batches(examples, args.batch_size, generator)
        input_ids, attention_mask, labels = collate(
            [examples[i] for i in epoch.pop()], tokenizer.pad_token_id
        )
        for group in optimizer.param_groups:
            group["lr"] = lr_fn(step)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % 25 == 0 or step == 0:
            print(
                f"{phase} step {step + 1:5d}/{steps}  loss {loss.item():.4f}  lr {lr_fn(step):.2e}  "
                f"{time.time() - start:6.0f}s",
                flush=True,
            )
        if on_snapshot and step + 1 in args.snapshots.get(phase, ()):
            on_snapshot(f"{phase}{step + 1}")
            model.train()


# --- (4) evaluation: a greedy / sampled multi-turn loop with the calculator in it ------------------------


def run_tool(text: str, enabled: bool) -> str | None:
    """The tool message for an assistant message's first `<tool_call>` (an error text when the call is
    malformed, names another tool or the tool is disabled), or None when it makes no call."""
    match = TOOL_CALL_RE.search(text)
    if match is None:
        return None
    if not enabled:
        return "Error: tool disabled"
    try:
        call = json.loads(match.group(1))
        if call.get("name") != "calculator":
            return f"Error: unknown tool {call.get('name')!r}"
        return calculator(**call["arguments"])
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return f"Error: {e}"


@dataclass
class Episode:
    messages: list[dict]  # the conversation so far (what the template renders)
    text: str  # its rendering, up to the current assistant header
    ids: list[int]  # prompt, sampled and injected tokens
    n_prompt: int
    sampled: int = 0
    calls: int = 0
    final: str = ""  # the last assistant message (what the answer is read from)
    done: bool = False

    @property
    def added(self) -> int:
        return len(self.ids) - self.n_prompt


def batch_inputs(batch: list[Episode], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(e.ids) for e in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(e.ids)) + e.ids for e in batch])  # [B, T], left-padded
    attention_mask = torch.tensor([[0] * (width - len(e.ids)) + [1] * len(e.ids) for e in batch])
    return input_ids, attention_mask


@torch.no_grad()
def episodes(model, tokenizer, questions, tools, *, samples, enabled, args) -> list[Episode]:
    """Run one episode per question x sample: generate until eos, run a `<tool_call>` if there is one,
    append the tool message and the next assistant header (tokens of the template's difference, as an
    episode runner injects them), repeat up to `--max-turns` turns and `--max-episode-tokens` added
    tokens. Each turn is one batched generate over the live episodes. Greedy when samples == 1."""
    model.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    eps = []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        prompt = render(tokenizer, messages, tools, generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        eps += [Episode(list(messages), prompt, list(ids), len(ids)) for _ in range(samples)]
    greedy = {"do_sample": False}
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if samples > 1 else greedy
    for _turn in range(args.max_turns):
        live = [e for e in eps if not e.done]
        for i in range(0, len(live), args.eval_batch_size):
            batch = live[i : i + args.eval_batch_size]
            input_ids, attention_mask = batch_inputs(batch, pad)
            room = max(1, args.max_episode_tokens - min(e.added for e in batch))
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=min(args.max_new_tokens, room),
                **sampling,
                pad_token_id=pad,
                eos_token_id=eos,
            )
            for e, row in zip(batch, out[:, input_ids.shape[1] :].tolist(), strict=True):
                new = row[: row.index(eos) + 1] if eos in row else [t for t in row if t != pad]
                new = new[: args.max_episode_tokens - e.added]
                e.ids += new
                e.sampled += len(new)
                e.final = tokenizer.decode(new).removesuffix(EOS)
                content = run_tool(e.final, enabled) if new and new[-1] == eos else None
                if content is None:  # an answer, or cut off by the token cap
                    e.done = True
                    continue
                e.calls += 1
                e.messages += [
                    {"role": "assistant", "content": e.final},
                    {"role": "tool", "name": "calculator", "content": content},
                ]
                # Injected: everything after the sampled eos, up to and including the next assistant header.
                rendered = render(tokenizer, e.messages, tools, generation_prompt=True)
                assert rendered.startswith(e.text + e.final + EOS), "chat template is not prefix-preserving"
                injected = tokenizer(
                    rendered[len(e.text) + len(e.final) + len(EOS) :], add_special_tokens=False
                )
                e.text = rendered
                if e.added + len(injected.input_ids) >= args.max_episode_tokens:
                    e.done = True  # no room left for another turn
                    continue
                e.ids += injected.input_ids
    return eps


def correct(eps: list[Episode], answers: list[str], samples: int) -> list[bool]:
    finals = [e.final for e in eps]
    refs = [answers[j // samples] for j in range(len(eps))]
    return [s == 1.0 for s in gsm8k_correctness([""] * len(eps), finals, answer=refs)]


def evaluate(model, tokenizer, rows: list[dict], args: argparse.Namespace) -> dict[str, float]:
    questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]
    tools = [calculator_schema()]
    start = time.time()
    greedy = episodes(model, tokenizer, questions, tools, samples=1, enabled=True, args=args)
    ok = correct(greedy, answers, 1)
    called = [e.calls > 0 for e in greedy]
    disabled = episodes(model, tokenizer, questions, tools, samples=1, enabled=False, args=args)
    k, n = args.pass_k, args.pass_k_problems
    torch.manual_seed(args.seed)
    sampled = episodes(model, tokenizer, questions[:n], tools, samples=k, enabled=True, args=args)
    sample_ok = correct(sampled, answers, k)
    n_called = sum(called)
    bare = [bool(BARE_RE.match(q)) for q in questions]
    metrics = {
        "greedy_accuracy": sum(ok) / len(rows),
        "greedy_accuracy_tool_disabled": sum(correct(disabled, answers, 1)) / len(rows),
        "tool_call_rate": n_called / len(rows),
        "tool_call_rate_bare": sum(c for c, b in zip(called, bare, strict=True) if b) / max(1, sum(bare)),
        "tool_call_rate_word": sum(c for c, b in zip(called, bare, strict=True) if not b)
        / max(1, len(rows) - sum(bare)),
        "two_call_rate": sum(e.calls >= 2 for e in greedy) / len(rows),
        "accuracy_when_calling": sum(o for o, c in zip(ok, called, strict=True) if c) / max(1, n_called),
        "accuracy_when_not_calling": sum(o for o, c in zip(ok, called, strict=True) if not c)
        / max(1, len(rows) - n_called),
        f"pass@{k}": sum(any(sample_ok[j * k : (j + 1) * k]) for j in range(n)) / n,
        "sample_accuracy": sum(sample_ok) / len(sampled),
        "sample_tool_call_rate": sum(e.calls > 0 for e in sampled) / len(sampled),
        "mean_added_tokens_greedy": sum(e.added for e in greedy) / len(greedy),
        "mean_sampled_tokens_greedy": sum(e.sampled for e in greedy) / len(greedy),
        "mean_added_tokens_sampled": sum(e.added for e in sampled) / len(sampled),
        "max_added_tokens_sampled": max(e.added for e in sampled),
        "mean_prompt_tokens": sum(e.n_prompt for e in greedy) / len(greedy),
        "eval_seconds": time.time() - start,
    }
    for e, o in list(zip(greedy, ok, strict=True))[:3]:
        print(f"example ({'right' if o else 'wrong'}): {tokenizer.decode(e.ids)!r}")
    return metrics


def format_metrics(m: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" if v < 10 else f"{k} {v:.1f}" for k, v in m.items())


# --- (5) save -------------------------------------------------------------------------------------------


def save(model, tokenizer, out: Path, metrics: dict[str, float], args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    build_info = {k: str(v) if isinstance(v, Path | dict) else v for k, v in vars(args).items()}
    command = " ".join(["scripts/build_tiny_tools_model.py", *sys.argv[1:]])
    info = {"command": command, "args": build_info, "metrics": metrics}
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")


def parse_snapshots(text: str) -> dict[str, list[int]]:
    """'sft:600,900;mix:50' -> {'sft': [600, 900], 'mix': [50]}."""
    out = {}
    for part in filter(None, text.split(";")):
        phase, _, steps = part.partition(":")
        out[phase] = [int(s) for s in steps.split(",") if s]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=3500, help="phase-1 SFT steps")
    parser.add_argument("--call-fraction", type=float, default=0.7, help="phase-1 traces that call the tool")
    parser.add_argument("--mix-steps", type=int, default=60, help="phase-2 SFT steps (sets the call rate)")
    parser.add_argument(
        "--bare-call-rate", type=float, default=0.75, help="phase 2: bare questions' call rate"
    )
    parser.add_argument(
        "--word-call-rate", type=float, default=0.25, help="phase 2: word problems' call rate"
    )
    parser.add_argument(
        "--extra-problems",
        type=int,
        default=60000,
        help="SFT on this many fresh problems beside the train split",
    )
    parser.add_argument("--error-rate", type=float, default=0.04, help="traces whose tool call gets an error")
    parser.add_argument(
        "--warm-start",
        type=lambda v: None if v in ("", "none") else Path(v),
        default=ROOT / "src/grpo/assets/tiny-math-lm",
        help="initialise the layers from this model (tiny-math-lm); 'none' for a random init",
    )
    parser.add_argument("--snapshot-eval-size", type=int, default=100)
    parser.add_argument(
        "--init-from", type=Path, default=None, help="start from this saved model + tokenizer"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=768)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="per assistant turn")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-episode-tokens", type=int, default=160, help="sampled + injected per episode")
    parser.add_argument("--eval-batch-size", type=int, default=256)
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--pass-k", type=int, default=8)
    parser.add_argument("--pass-k-problems", type=int, default=100)
    parser.add_argument("--snapshots", type=parse_snapshots, default={}, help="e.g. 'sft:600,900;mix:50'")
    parser.add_argument("--snapshot-dir", type=Path, default=ROOT / "work_tmp/tools_candidates")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    start = time.time()
    train_rows, test_rows = load_jsonl(DATA_DIR / "train.jsonl"), load_jsonl(DATA_DIR / "test.jsonl")
    known = {r["question"] for r in train_rows + test_rows}
    sft_rows = train_rows + fresh_problems(args.extra_problems, known, args.seed + 7919)
    test_rows = test_rows[: args.eval_size]
    phase1 = conversations(sft_rows, lambda _row: args.call_fraction, args.error_rate, args.seed)

    if args.init_from:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
        model = LlamaForCausalLM.from_pretrained(args.init_from)
    else:
        texts = [render(tokenizer=_Renderer(), messages=m, tools=t) for m, t in phase1]
        tokenizer = build_tokenizer(texts, args.vocab_size)
        model = build_model(tokenizer, args)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {model.num_parameters():,} parameters")

    def snapshot(name: str) -> None:
        if not args.snapshot_eval_size:
            save(model, tokenizer, args.snapshot_dir / name, {}, args)
            return
        small = argparse.Namespace(**{**vars(args), "pass_k_problems": args.snapshot_eval_size // 2})
        metrics = evaluate(model, tokenizer, test_rows[: args.snapshot_eval_size], small)
        save(model, tokenizer, args.snapshot_dir / name, metrics, args)
        print(f"snapshot {name}: {format_metrics(metrics)}", flush=True)

    examples = [encode_conversation(tokenizer, m, t) for m, t in phase1]
    lengths = sorted(len(ids) for ids, _ in examples)
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    print(f"phase 1: {len(examples)} conversations of {median} tokens (median), {longest} at most")
    print("example:", repr(tokenizer.decode(examples[0][0])))
    sft(model, tokenizer, examples, args.steps, lambda step: lr_at(step, args), args, "sft", snapshot)
    if args.mix_steps:

        def rate(row: dict) -> float:
            return args.bare_call_rate if BARE_RE.match(row["question"]) else args.word_call_rate

        mixed = conversations(sft_rows, rate, args.error_rate, args.seed + 1)
        examples = [encode_conversation(tokenizer, m, t) for m, t in mixed]
        floor = args.lr * 0.1
        sft(model, tokenizer, examples, args.mix_steps, lambda _step: floor, args, "mix", snapshot)
    metrics = evaluate(model, tokenizer, test_rows, args)
    metrics["build_seconds"] = time.time() - start
    save(model, tokenizer, args.out, metrics, args)
    print(f"held-out ({len(test_rows)} problems): {format_metrics(metrics)}")
    print(f"saved to {args.out}")


class _Renderer:
    """Renders the chat template before a tokenizer exists (the tokenizer is trained on the renderings)."""

    def __init__(self):
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
        self.tokenizer.chat_template = CHAT_TEMPLATE

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)


if __name__ == "__main__":
    main()
