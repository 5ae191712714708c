"""A whole tool episode through parse → run → messages → injected ids equals the template's render of it."""

import pytest

from grpo.agents import ChatRenderer, ToolBox, ToolCall, detect_parser
from grpo.agents.messages import assistant_message, call_id, tool_messages
from tests.chat_templates import family_tokenizer


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "12 * 34"
    """
    return str(eval(expression, {"__builtins__": {}}))  # test double: trusted input only


USER = {"role": "user", "content": "What is 12 * 34?"}


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.2", "mistral-nemo", "mistral-small-3.2"])
def test_an_episode_of_sampled_and_injected_ids_is_the_full_render(family):
    tokenizer = family_tokenizer(family)
    parser, box = detect_parser(tokenizer, family), ToolBox([calculator])
    chat = ChatRenderer(tokenizer, box.schemas, date_string="26 Jul 2024")
    eos = tokenizer.convert_tokens_to_ids(chat.end_of_turn)

    episode = chat.prompt_ids([USER])
    # What the policy samples; Mistral models write a call id (the other formats have none).
    text = parser.format_call(ToolCall("calculator", {"expression": "12 * 34"}, "abc123XYZ"))
    episode += [*chat.encode(text), eos]
    turn = parser.parse(text)
    results = box.run([turn])[0]
    assert [r.content for r in results] == ["408"]
    history = [USER, assistant_message(turn, turn_index=0)]
    injected = tool_messages(turn, results, turn_index=0)
    episode += chat.injected_ids(history, injected)
    episode += [*chat.encode("It is 408."), eos]  # the second sampled turn

    conversation = [*history, *injected, {"role": "assistant", "content": "It is 408."}]
    whole = chat.encode(chat.render(conversation, add_generation_prompt=False))
    assert episode + chat.encode(chat.turn_tail) == whole


def test_malformed_calls_answer_in_order_with_ids_of_their_own():
    tokenizer = family_tokenizer("qwen2.5")
    parser, box = detect_parser(tokenizer, "qwen2.5"), ToolBox([calculator])
    chat = ChatRenderer(tokenizer, box.schemas)
    text = '<tool_call>{"name": "calculator", "arg</tool_call>\n' + parser.format_call(
        ToolCall("calculator", {"expression": "2 + 2"})
    )
    turn = parser.parse(text)
    results = box.run([turn])[0]
    message = assistant_message(turn, turn_index=3)
    assert message["tool_calls"] == [
        {
            "type": "function",
            "id": "000300001",
            "function": {"name": "calculator", "arguments": {"expression": "2 + 2"}},
        }
    ]
    tools = tool_messages(turn, results, turn_index=3)
    assert [(m["tool_call_id"], m["name"]) for m in tools] == [
        ("000300000", "invalid_tool_call"),
        ("000300001", "calculator"),
    ]
    injected = tokenizer.decode(chat.injected_ids([USER, message], tools))
    assert injected == (
        "\n<|im_start|>user\n<tool_response>\n"
        "tool call 1 is not valid JSON: Unterminated string starting at (char 23); "
        'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n'
        "</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_call_ids_are_nine_characters_and_the_models_own_are_kept():
    assert call_id(0, 0) == "000000000" and call_id(12, 345) == "001200345"
    with pytest.raises(ValueError, match="turn < 10000"):
        call_id(10_000, 0)
    turn = detect_parser(family_tokenizer("mistral-small-3.2"), "m").parse(
        '[TOOL_CALLS]calculator[CALL_ID]abc123XYZ[ARGS]{"expression": "1"}'
        "[TOOL_CALLS]calculator[CALL_ID]x[ARGS]{}"
    )
    assert [c["id"] for c in assistant_message(turn, 1)["tool_calls"]] == ["abc123XYZ", "000100001"]
