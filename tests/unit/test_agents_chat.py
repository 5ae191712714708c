"""Token-exact multi-turn ids from real chat templates: Qwen2.5, Qwen3, Llama 3, Mistral Nemo, bundled."""

import pytest

from grpo.agents import ChatRenderer, ChatTemplateError, ToolCall, detect_parser
from tests.chat_templates import bundled_tokenizer, family_tokenizer

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * 34"}},
            "required": ["expression"],
        },
    },
}
USER = {"role": "user", "content": "What is 12 * 34?"}
CALL = ToolCall("calculator", {"expression": "12 * 34"}, "call00001")
TOOL = {"role": "tool", "tool_call_id": "call00001", "name": "calculator", "content": "408"}


def assistant_call(content: str = "") -> dict:
    call = {"type": "function", "id": CALL.id, "function": {"name": CALL.name, "arguments": CALL.arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def renderer(family: str) -> ChatRenderer:
    return ChatRenderer(family_tokenizer(family), [SCHEMA], date_string="26 Jul 2024")


@pytest.mark.parametrize(
    ("family", "injected_text"),
    [
        ("qwen2.5", "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n"),
        # Llama's template writes a string tool result as JSON (a string is "iterable" to Jinja): quoted.
        ("llama3.2", '<|start_header_id|>ipython<|end_header_id|>\n\n"408"<|eot_id|>'
                     '<|start_header_id|>assistant<|end_header_id|>\n\n'),
        ("mistral-nemo", '[TOOL_RESULTS]{"content": 408, "call_id": "call00001"}[/TOOL_RESULTS]'),
        ("mistral-small-3.2", "[TOOL_RESULTS]call00001[TOOL_CONTENT]408[/TOOL_RESULTS]"),
    ],
)  # fmt: skip
def test_injected_ids_are_the_difference_of_full_renders(family, injected_text):
    chat = renderer(family)
    tokenizer = chat.tokenizer
    history = [USER, assistant_call()]
    injected = chat.injected_ids(history, [TOOL])
    assert tokenizer.decode(injected) == injected_text

    # The full renders, tokenized whole: the one with the tool message is the one without it, cut right after
    # the sampled end-of-turn token, followed by exactly the injected ids.
    eos = tokenizer.convert_tokens_to_ids(chat.end_of_turn)
    without = chat.encode(chat.render(history, add_generation_prompt=False))
    with_tool = chat.encode(chat.render([*history, TOOL], add_generation_prompt=True))
    cut = len(without) - len(chat.encode(chat.turn_tail))
    assert without[cut - 1] == eos
    assert with_tool == without[:cut] + injected

    # An episode's sequence (prompt, what the policy sampled ending with eos, injected) is the full render:
    # the policy trains on the tokens the template gives the whole conversation.
    sampled = [*chat.encode(detect_parser(tokenizer, family).format_call(CALL)), eos]
    assert chat.prompt_ids([USER]) + sampled + injected == with_tool


def test_qwen25_is_prefix_preserving_and_the_end_of_turn_tail_is_a_newline():
    chat = renderer("qwen2.5")
    assert (chat.end_of_turn, chat.turn_tail) == ("<|im_end|>", "\n")
    assert chat.prefix_problem() is None
    # A user message injected after a reasoning turn keeps the <think> text: Qwen2.5 re-renders nothing.
    history = [USER, {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n408"}]
    injected = chat.injected_ids(history, [{"role": "user", "content": "And 408 + 1?"}])
    assert (
        chat.tokenizer.decode(injected)
        == "\n<|im_start|>user\nAnd 408 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_drops_earlier_think_blocks_so_it_is_not_prefix_preserving():
    chat = renderer("qwen3")
    problem = chat.prefix_problem()
    assert problem == (
        "The chat template is not prefix-preserving: when a user message follows an assistant turn, "
        "it drops the <think> blocks of earlier assistant turns."
    )
    thought = [USER, assistant_call("<think>\nuse the tool\n</think>\n\n")]
    # Tool results after a reasoning turn keep its <think> block: injection works...
    injected = chat.injected_ids(thought, [TOOL])
    text = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert chat.tokenizer.decode(injected) == text
    # ...but a new user query re-renders the earlier turn without it, and without reasoning the empty
    # <think></think> of the last turn goes as soon as anything follows.
    answered = [USER, {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\nIt is 408."}]
    with pytest.raises(
        ChatTemplateError, match=r"when user messages are added \(it drops the <think> blocks"
    ):
        chat.injected_ids(answered, [{"role": "user", "content": "And 408 + 1?"}])
    with pytest.raises(ChatTemplateError, match="when tool messages are added"):
        chat.injected_ids([USER, assistant_call()], [TOOL])
    # No-thinking mode (the generation prompt closes an empty <think>): the first tool result breaks it.
    quiet = ChatRenderer(chat.tokenizer, [SCHEMA], enable_thinking=False)
    assert quiet.tokenizer.decode(quiet.prompt_ids([USER])).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert quiet.prefix_problem() == (
        "The chat template is not prefix-preserving: when a tool message follows an assistant turn, "
        "it drops the <think> blocks of earlier assistant turns."
    )


def test_mistral_moves_its_tool_list_to_the_last_user_message():
    problem = renderer("mistral-nemo").prefix_problem()
    assert problem.startswith(
        "The chat template is not prefix-preserving: when a user message follows an assistant turn, "
        "at character 4 the earlier text '<s>[AVAILABLE_TOOLS]"
    )
    assert ChatRenderer(family_tokenizer("mistral-nemo")).prefix_problem() is None  # without tools it is


def test_llama_is_prefix_preserving():
    assert renderer("llama3.2").prefix_problem() is None
    assert renderer("llama3.3").prefix_problem() is None


def test_bundled_model_template_without_tools():
    tokenizer = bundled_tokenizer()
    chat = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "12+34"}]
    assert (
        chat.prompt_ids(messages)
        == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert (chat.end_of_turn, chat.turn_tail) == ("<|end|>", "\n")
    assert chat.prefix_problem() is None
    injected = chat.injected_ids([*messages, {"role": "assistant", "content": "46"}], [messages[0]])
    assert tokenizer.decode(injected) == "\n<|user|>\n12+34\n<|assistant|>\n"
    # It has no tool role: with tools in play the probe says so instead of failing later.
    assert ChatRenderer(tokenizer, [SCHEMA]).prefix_problem() == (
        "the chat template cannot render user/assistant/tool messages (TemplateError: unknown role: tool)."
    )


def test_history_must_end_with_the_sampled_assistant_turn():
    chat = renderer("qwen2.5")
    with pytest.raises(ChatTemplateError, match="must end with the assistant message just sampled"):
        chat.injected_ids([USER], [TOOL])
