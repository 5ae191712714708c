"""Tool calls parsed in each family's own format from exact texts; the family read from real templates."""

import pytest

from grpo.agents import HermesParser, Llama3JsonParser, MistralParser, ToolCall, detect_parser
from grpo.config import ConfigError
from tests.chat_templates import bundled_tokenizer, family_tokenizer

CALC = "calculator"
HERMES_USAGE = '; write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'


def test_hermes_reads_several_calls_and_keeps_the_prose():
    text = (
        "Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5 + 6"}}\n</tool_call>'
    )
    turn = HermesParser().parse(text)
    assert turn.content == "Let me compute."
    assert turn.calls == [ToolCall(CALC, {"expression": "12 * 34"}), ToolCall(CALC, {"expression": "5 + 6"})]
    assert turn.errors == []


def test_hermes_malformed_calls_become_messages_for_the_model():
    text = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}\n</tool_call>'  # a } missing
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>'
    )
    turn = HermesParser().parse(text)
    assert turn.errors == [
        "tool call 1 is not valid JSON: Expecting ',' delimiter (char 55)" + HERMES_USAGE,
        'tool call 2 has no "name" (a non-empty string)' + HERMES_USAGE,
        "tool call 3 has arguments that are a JSON array, not an object" + HERMES_USAGE,
    ]
    assert turn.error_positions == [0, 1, 2]
    # OpenAI-style arguments (a JSON object in a string) are read, not refused.
    assert turn.calls == [ToolCall(CALC, {"expression": "2"})]
    assert turn.content == ""


def test_hermes_unclosed_call_counts_when_complete_and_calls_while_thinking_do_not():
    turn = HermesParser().parse(
        '<think>I could <tool_call>{"name": "x"}</tool_call></think>Computing. '
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'
    )
    assert turn.calls == [ToolCall(CALC, {"expression": "1"})]
    assert turn.content == '<think>I could <tool_call>{"name": "x"}</tool_call></think>Computing.'
    cut = HermesParser().parse('<tool_call>{"name": "calculator", "arg')
    assert cut.calls == []
    assert cut.errors == [
        "tool call 1 is not valid JSON and is not closed with </tool_call>: "
        "Unterminated string starting at (char 23)" + HERMES_USAGE
    ]


def test_llama3_json_with_and_without_python_tag():
    parser = Llama3JsonParser()
    tagged = parser.parse(
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "12 * 34"}}; '
        '{"name": "calculator", "parameters": {"expression": "1 + 1"}}'
    )
    assert tagged.calls == [
        ToolCall(CALC, {"expression": "12 * 34"}),
        ToolCall(CALC, {"expression": "1 + 1"}),
    ]
    assert tagged.content == ""
    bare = parser.parse('{"name": "calculator", "parameters": {"expression": "2"}}')
    assert bare.calls == [ToolCall(CALC, {"expression": "2"})]
    # Prose, and JSON that names no function, are answers, not calls.
    assert parser.parse("The answer is 408.").calls == []
    assert parser.parse('{"answer": 408}').content == '{"answer": 408}'


def test_llama3_json_malformed_and_builtin_calls_are_reported():
    parser = Llama3JsonParser()
    usage = '; write {"name": ..., "parameters": {...}} (several separated by ";")'
    broken = parser.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1"}; {"name"')
    assert broken.errors == ["tool call 1 is not valid JSON: Expecting ',' delimiter (char 56)" + usage]
    builtin = parser.parse('<|python_tag|>brave_search.call(query="x")')
    assert builtin.errors == ["tool call 1 is not valid JSON: Expecting value (char 0)" + usage]


def test_mistral_list_and_named_forms():
    parser = MistralParser()
    listed = parser.parse(
        '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12 * 34"}, "id": "abc123XYZ"}, '
        '{"name": "clock", "arguments": {}}]'
    )
    assert listed.calls == [ToolCall(CALC, {"expression": "12 * 34"}, "abc123XYZ"), ToolCall("clock", {})]
    named = parser.parse(
        'Sure.[TOOL_CALLS]calculator[ARGS]{"expression": "1"}[TOOL_CALLS]clock[CALL_ID]abc123XYZ[ARGS]{}'
    )
    assert named.content == "Sure."
    assert named.calls == [ToolCall(CALC, {"expression": "1"}), ToolCall("clock", {}, "abc123XYZ")]
    broken = parser.parse('[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1"}]')
    assert broken.errors == [
        "tool call 1 is not valid JSON: Expecting ',' delimiter (char 56); "
        'write [TOOL_CALLS][{"name": ..., "arguments": {...}}]'
    ]


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.2", "mistral-nemo", "mistral-small-3.2"])
def test_format_call_is_what_the_template_renders_and_parses_back(family):
    call = ToolCall(CALC, {"expression": "12 × 34"}, "abc123XYZ")
    tokenizer = family_tokenizer(family)
    parser = detect_parser(tokenizer, family)
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "id": call.id, "function": {"name": CALC, "arguments": call.arguments}}
        ],
    }
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12 × 34?"}, message], tokenize=False, date_string="26 Jul 2024"
    )
    assert parser.format_call(call) in rendered
    back = parser.parse(parser.format_call(call))
    assert back.calls == [call if parser.name == "mistral" else ToolCall(CALC, call.arguments)]
    assert back.content == ""


@pytest.mark.parametrize(
    ("family", "expected"),
    [("qwen2.5", "hermes"), ("qwen3", "hermes"), ("llama3.2", "llama3_json"), ("llama3.3", "llama3_json"),
     ("mistral-nemo", "mistral"), ("mistral-small-3.2", "mistral")],
)  # fmt: skip
def test_detect_parser_reads_the_template(family, expected):
    assert detect_parser(family_tokenizer(family), family).name == expected


def test_detect_parser_refuses_a_template_without_tools_naming_the_model():
    with pytest.raises(ConfigError) as err:
        detect_parser(bundled_tokenizer(), "tiny-math-lm")
    message = str(err.value)
    assert message.startswith("tiny-math-lm's chat template declares no tool-call format")
    assert "env.tool_parser=hermes|llama3_json|mistral" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence


def test_detect_parser_without_template_and_forced_choices():
    tokenizer = bundled_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match=r"^my-org/base has no chat template.*env\.tool_parser=hermes"):
        detect_parser(tokenizer, "my-org/base")
    assert detect_parser(tokenizer, "my-org/base", choice="mistral").name == "mistral"
    with pytest.raises(
        ConfigError, match=r"env\.tool_parser='xml' .*choose auto\|hermes\|llama3_json\|mistral"
    ):
        detect_parser(tokenizer, "my-org/base", choice="xml")


def test_a_call_without_arguments_has_empty_arguments():
    turn = HermesParser().parse(
        '<tool_call>{"name": "clock"}</tool_call><tool_call>{"name": "clock", "arguments": null}</tool_call>'
    )
    assert turn.calls == [ToolCall("clock", {}), ToolCall("clock", {})]
    assert turn.errors == []


def test_detect_parser_refuses_qwen3_coder_xml_calls():
    tokenizer = bundled_tokenizer()
    # Qwen3-Coder's template lines that write a call (vLLM examples/tool_chat_template_qwen3coder.jinja).
    tokenizer.chat_template = (
        "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
        "{{- '<parameter=' + args_name + '>\\n' }}\n"
    )
    with pytest.raises(ConfigError, match=r"^qwen3-coder's chat template declares XML tool calls"):
        detect_parser(tokenizer, "qwen3-coder")
