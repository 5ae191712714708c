"""Nothing a model writes crashes the run (issue 32 §3): every parser answers arbitrary text with calls and
error messages, never an exception; deep nesting and huge integers become messages for the model."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo.agents import HermesParser, Llama3JsonParser, MistralParser
from grpo.agents.parsing import MAX_ARGUMENT_DEPTH, ParsedTurn, ToolCall, parse_turn

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEEP = "[" * 100_000 + "]" * 100_000
BIG_INT = "9" * 5000
# Text built from the pieces the parsers look for, so that the fuzzing reaches the JSON inside calls.
PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "</think>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        '{"name": "f", "arguments": ',
        '{"name": "f", "parameters": ',
        '"arguments": "',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ";",
        ",",
        ":",
        "null",
        "1e999",
        BIG_INT,
        "[" * 3000,
        '{"a":' * 2000,
        "calc",
        " ",
        "\n",
    ]
)
MODEL_TEXT = st.one_of(
    st.text(max_size=300), st.lists(st.one_of(PIECES, st.text(max_size=5)), max_size=30).map("".join)
)


def _well_formed(turn: ParsedTurn) -> None:
    assert isinstance(turn.content, str)
    assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in turn.calls)
    assert all(isinstance(e, str) and e for e in turn.errors)


@settings(FAST)
@given(MODEL_TEXT)
def test_hermes_answers_any_model_text(text):
    _well_formed(HermesParser().parse(text))


@settings(FAST)
@given(MODEL_TEXT)
def test_llama3_json_answers_any_model_text(text):
    _well_formed(Llama3JsonParser().parse(text))


@settings(FAST)
@given(MODEL_TEXT)
def test_mistral_answers_any_model_text(text):
    _well_formed(MistralParser().parse(text))
    _well_formed(MistralParser(named_calls=True).parse(text))


# The arguments a model writes for a tool "f" (as JSON text), each of which must become one error message.
HOSTILE = {
    "deep": DEEP,
    "deep inside": '{"x": ' + DEEP + "}",
    "deep inside a string": '"{\\"x\\": ' + DEEP + '}"',
    "huge integer": '{"x": ' + BIG_INT + "}",
    "huge integer in a string": '"{\\"x\\": ' + BIG_INT + '}"',
    "too deep to use": '{"x": ' + "[" * 200 + "]" * 200 + "}",
}
FORMATS = {
    "hermes": (HermesParser(), lambda args: f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>'),
    "llama3_json": (Llama3JsonParser(), lambda args: f'<|python_tag|>{{"name": "f", "parameters": {args}}}'),
    "mistral": (MistralParser(), lambda args: f'[TOOL_CALLS][{{"name": "f", "arguments": {args}}}]'),
    "mistral_named": (MistralParser(named_calls=True), lambda args: f"[TOOL_CALLS]f[ARGS]{args}"),
}


@pytest.mark.parametrize("family", FORMATS)
@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_calls_become_one_error_message(family, case):
    parser, fmt = FORMATS[family]
    turn = parser.parse(fmt(HOSTILE[case]))
    assert turn.calls == [] and len(turn.errors) == 1, turn.errors
    assert turn.errors[0].startswith("tool call 1 ")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser(), f"<tool_call>{DEEP}</tool_call>"),
        (Llama3JsonParser(), f"<|python_tag|>{DEEP}"),
        (MistralParser(), f"[TOOL_CALLS]{DEEP}"),
    ],
)
def test_a_call_nested_100000_deep_is_one_error_message(parser, text):
    turn = parser.parse(text)
    assert turn.calls == [] and len(turn.errors) == 1 and "nests too deeply" in turn.errors[0]


def test_arguments_at_the_depth_limit_are_still_a_call():
    nested = "[" * (MAX_ARGUMENT_DEPTH - 1) + "]" * (MAX_ARGUMENT_DEPTH - 1)
    turn = HermesParser().parse('<tool_call>{"name": "f", "arguments": {"x": ' + nested + "}}</tool_call>")
    assert len(turn.calls) == 1 and turn.errors == []


def test_a_parser_that_raises_gives_the_model_a_message():
    class Broken:
        name, usage = "broken", "<call>...</call>"

        def parse(self, text):
            raise KeyError("surprise")

    turn = parse_turn(Broken(), " hello ")
    assert turn.calls == [] and turn.content == "hello"
    assert turn.errors == ["the tool calls could not be read (KeyError: 'surprise'); write <call>...</call>"]


def test_the_gateway_answers_arguments_nested_100000_deep_with_a_400():
    from grpo.gateway import ChatRequest, GatewayError

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": ' + DEEP + "}"}}
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }
    with pytest.raises(GatewayError, match="not JSON"):
        ChatRequest.parse(body)


def test_logprobs_flags_are_checked_and_kept():
    from grpo.gateway.wire import ChatRequest, GatewayError

    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatRequest.parse({**base, "logprobs": True, "top_logprobs": 20}).logprobs is True
    assert ChatRequest.parse(base).logprobs is False
    for bad_body, param in (({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(GatewayError) as error:
            ChatRequest.parse({**base, **bad_body})
        assert error.value.param == param
