"""The bundled tiny_tools task and tiny-tools-lm: well-formed rows the GSM8K scorer reads, a tokenizer
whose tool tokens are single ids, and a chat template that renders any tool's schema and Hermes-style
`<tool_call>` JSON and is prefix-preserving over a multi-turn tool conversation."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

from grpo.agents.calculator import calculator
from grpo.config import DataConfig
from grpo.data import load_rows
from grpo.data.tasks import ANSWER_SCORER, TASKS, find_task
from grpo.model.loading import resolve_path
from grpo.rewards.math import gsm8k_correctness, reference_answer

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "src/grpo/assets/tiny_tools"


def _rows(split):
    return [json.loads(line) for line in (TASK_DIR / f"{split}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_path("tiny-tools-lm"))


def lookup_price(item: str, quantity: int) -> str:
    """Look up what some items cost in the shop.

    Args:
        item: The item's name, e.g. "pen".
        quantity: How many of them.
    """
    return f"{quantity} {item}"


# -- the data -----------------------------------------------------------------------------------------


def test_rows_are_questions_with_a_gsm8k_answer_the_calculator_confirms():
    train, test = _rows("train"), _rows("test")
    assert len(test) == 500 and len(train) == 6000
    for row in train + test:
        assert set(row) == {"question", "answer"}
        expression, _, value = row["answer"].partition("\n#### ")[0].partition("=")
        assert calculator(expression) == value == reference_answer(row["answer"])
        assert re.match(r"[1-9]\d{1,2}\*[1-9]\d[+-]?", expression)  # a 2-3 digit by 2 digit product first
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_the_files_are_what_the_seeded_script_writes():
    spec = importlib.util.spec_from_file_location("make_tiny_tools", ROOT / "scripts/make_tiny_tools.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    train, test = script.generate(2026, 6000, 500)
    assert (train[:50], test) == (_rows("train")[:50], _rows("test"))


def test_the_task_loads_and_is_scored_like_gsm8k():
    task = find_task("tiny_tools:test")
    assert task is TASKS["tiny_tools"] and task.scorer is ANSWER_SCORER
    assert task.settings()["algorithm.reward_funcs"] == ["gsm8k_correctness", "gsm8k_format"]
    rows = load_rows("tiny_tools:test", DataConfig())
    assert len(rows) == 500 and rows[0]["prompt"] == _rows("test")[0]["question"]
    answer = rows[0]["answer"]
    right, wrong = f"#### {reference_answer(answer)}", f"#### {int(reference_answer(answer)) + 1}"
    assert gsm8k_correctness(["p", "p"], [right, wrong], answer=[answer, answer]) == [1.0, 0.0]


# -- the tokenizer and chat template ------------------------------------------------------------------


def test_tool_tokens_are_single_special_ids(tokenizer):
    for token in ("<tool_call>", "</tool_call>", "<|tool|>", "<|end|>", "<|assistant|>", "<|user|>"):
        ids = tokenizer(token, add_special_tokens=False).input_ids
        assert len(ids) == 1 and token in tokenizer.all_special_tokens, token
    assert tokenizer.eos_token == "<|end|>"
    assert "<tool_call>" in tokenizer.chat_template  # what tool-call format detection looks for


def test_digits_are_single_tokens_and_text_round_trips(tokenizer):
    def pieces(text):
        return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False).input_ids)

    assert pieces("47952") == ["4", "7", "9", "5", "2"]
    text = '{"expression": "1035+12*67"} #### 1839'
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_the_template_renders_any_tool_from_its_schema(tokenizer):
    messages = [{"role": "user", "content": "What do 3 pens cost?"}]
    text = tokenizer.apply_chat_template(
        messages, tools=[get_json_schema(lookup_price)], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|system|>\nTools:\n"
        "lookup_price(item: string, quantity: integer) - Look up what some items cost in the shop.\n"
        '  item: The item\'s name, e.g. "pen".\n'
        "  quantity: How many of them.\n"
        "<|user|>\nWhat do 3 pens cost?\n<|assistant|>\n"
    )
    # A callable is turned into the same schema by transformers; no tools, no system block.
    assert text == tokenizer.apply_chat_template(
        messages, tools=[lookup_price], tokenize=False, add_generation_prompt=True
    )
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert plain == "<|user|>\nWhat do 3 pens cost?\n<|assistant|>\n"


def _call(expression, as_text=False):
    arguments = {"expression": expression}
    return {
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps(arguments) if as_text else arguments},
    }


CONVERSATION = [
    {"role": "system", "content": "Answer as '#### n'."},
    {"role": "user", "content": "Ana buys 23 boxes of 45 pens and 12 boxes of 67 pencils. How many?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("23*45")]},
    {"role": "tool", "name": "calculator", "content": "1035"},
    {"role": "assistant", "content": "", "tool_calls": [_call("1035+12*67", as_text=True)]},
    {"role": "tool", "name": "calculator", "content": "1839"},
    {"role": "assistant", "content": "#### 1839"},
]


def test_tool_calls_render_as_hermes_json_and_tool_results_as_tool_messages(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=[calculator], tokenize=False)
    assert text.startswith("<|system|>\nAnswer as '#### n'.\nTools:\ncalculator(expression: string) - ")
    assert text.endswith(
        "How many?\n"
        "<|assistant|>\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "23*45"}}\n'
        "</tool_call><|end|>\n"
        "<|tool|>\n1035\n"
        "<|assistant|>\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "1035+12*67"}}\n'
        "</tool_call><|end|>\n"
        "<|tool|>\n1839\n"
        "<|assistant|>\n#### 1839<|end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text


def test_the_template_is_prefix_preserving_across_turns(tokenizer):
    def render(n, prompt):
        return tokenizer.apply_chat_template(
            CONVERSATION[:n], tools=[calculator], tokenize=False, add_generation_prompt=prompt
        )

    for n in range(2, len(CONVERSATION)):
        longer = render(n + 1, False)
        assert longer.startswith(render(n, False)), n
        if CONVERSATION[n]["role"] == "assistant":  # what the model saw before it sampled this turn
            assert longer.startswith(render(n, True)), n
            ids_before = tokenizer(render(n, True), add_special_tokens=False).input_ids
            assert tokenizer(longer, add_special_tokens=False).input_ids[: len(ids_before)] == ids_before


# -- the model ----------------------------------------------------------------------------------------


def test_the_bundled_tool_model_loads_with_room_for_three_turns(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(resolve_path("tiny-tools-lm"))
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.max_position_embeddings >= 512
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 4_000_000
