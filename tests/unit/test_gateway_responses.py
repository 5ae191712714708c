"""The Responses API translation (gateway/responses.py, responses_output.py): requests onto chat completions,
replies and stream events in the shapes the installed `openai` package parses, and the round trip of an
assistant turn (items sent back map to the very chat message the gateway returned)."""

from __future__ import annotations

import json

import pytest

from grpo.gateway.responses import (
    ResponsesRequestError,
    ResponseStore,
    chat_request,
    input_messages,
    respond,
    respond_stream,
)
from grpo.gateway.responses_output import ResponseEvents, from_chat_reply, sse

openai = pytest.importorskip("openai")
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

CALC = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
    "strict": False,
}
TOOL_TURN = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'},
        }
    ],
}


def chat_reply(message: dict, finish: str = "tool_calls") -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "grpo",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
    }


def chunks_of(message: dict, finish: str, pieces: int = 3) -> list[dict]:
    """A chat reply as the chunks a streaming gateway sends: text and arguments split in `pieces`."""

    def split(text: str) -> list[str]:
        step = max(1, -(-len(text) // pieces))
        return [text[i : i + step] for i in range(0, len(text), step)]

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}]
    for piece in split(message.get("content") or ""):
        chunks.append({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    for k, call in enumerate(message.get("tool_calls") or []):
        head = {
            "index": k,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["function"]["name"]},
        }
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [head]}, "finish_reason": None}]})
        for piece in split(call["function"]["arguments"]):
            delta = {"tool_calls": [{"index": k, "function": {"arguments": piece}}]}
            chunks.append({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"choices": [], "usage": chat_reply(message)["usage"]})
    return chunks


def test_string_input_instructions_tools_and_sampling_fields():
    request, conversation = chat_request(
        {
            "model": "m",
            "input": "What is 2*3?",
            "instructions": "Use the tool.",
            "tools": [CALC],
            "tool_choice": {"type": "function", "name": "calculator"},
            "max_output_tokens": 40,
            "temperature": 0.5,
            "top_p": 0.9,
            "stream": True,
            "store": False,
            "some_future_field": 1,  # ignored: fields that change nothing sampled never fail a run
        }
    )
    assert request["messages"] == [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "What is 2*3?"},
    ]
    assert conversation == [{"role": "user", "content": "What is 2*3?"}]  # instructions are not carried over
    assert request["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": CALC["description"],
                "parameters": CALC["parameters"],
            },
        }
    ]
    assert request["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
    assert request["max_completion_tokens"] == 40
    assert (request["temperature"], request["top_p"]) == (0.5, 0.9)
    assert request["stream"] is True and request["stream_options"] == {"include_usage": True}


def test_items_group_into_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "2*3"}, {"type": "input_text", "text": "?"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me compute.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "a", "name": "calculator", "arguments": '{"expression": "2*3"}'},
        {"type": "function_call", "call_id": "b", "name": "calculator", "arguments": '{"expression": "1"}'},
        {"type": "function_call_output", "call_id": "a", "output": "6"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call", "call_id": "c", "name": "calculator", "arguments": "{}"},
    ]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[1]["content"] == "2*3?"
    assert messages[2]["content"] == "Let me compute."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["a", "b"]
    assert messages[3] == {"role": "tool", "tool_call_id": "a", "content": "6", "name": "calculator"}
    assert messages[4]["content"] == "1"
    assert messages[5]["content"] is None and messages[5]["tool_calls"][0]["id"] == "c"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0]"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}},
            "text.format",
        ),
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": [{"role": "narrator", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": []}, "input"),
        ({"input": "x", "background": True}, "background"),
    ],
)
def test_unsupported_requests_are_400_with_the_field_named(body, param):
    with pytest.raises(ResponsesRequestError) as err:
        chat_request(body, ResponseStore())
    assert err.value.status == 400 and err.value.param == param
    error = err.value.body()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == str(err.value)


def test_reply_validates_as_the_openai_response_type():
    message = {**TOOL_TURN, "content": "Computing."}
    body = {"model": "m", "input": "2*3?", "tools": [CALC]}
    response = Response.model_validate(from_chat_reply(body, chat_reply(message)))
    assert response.status == "completed" and response.output_text == "Computing."
    kinds = [item.type for item in response.output]
    assert kinds == ["message", "function_call"]
    call = response.output[1]
    assert (call.call_id, call.name, call.arguments) == ("call_1", "calculator", '{"expression": "2*3"}')
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        7,
        5,
        12,
    )
    cut = Response.model_validate(
        from_chat_reply(body, chat_reply({"role": "assistant", "content": "12"}, "length"))
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    "message", [TOOL_TURN, {**TOOL_TURN, "content": "Computing."}, {"role": "assistant", "content": "#### 6"}]
)
def test_items_sent_back_map_to_the_chat_message_returned(message):
    """The client appends `response.output` (as the openai package serialises it) and the tool results: the
    chat messages the next request carries end with the gateway's own assistant message, unchanged."""
    store = ResponseStore()
    first = {"input": [{"role": "user", "content": "2*3?"}], "tools": [CALC]}
    response = Response.model_validate(respond(first, store, lambda _request: chat_reply(message)))
    sent_back = [item.model_dump(exclude_none=True) for item in response.output]
    outputs = [
        {"type": "function_call_output", "call_id": c["id"], "output": "6"}
        for c in message.get("tool_calls", [])
    ]
    follow = {"input": [*first["input"], *sent_back, *outputs], "tools": [CALC]}
    request, _ = chat_request(follow, store)
    assert request["messages"][1] is not message and request["messages"][1] == message
    # previous_response_id: the same conversation, rebuilt from the store
    by_id, _ = chat_request({"previous_response_id": response.id, "input": outputs or "thanks"}, store)
    assert by_id["messages"][:2] == request["messages"][:2]


def test_store_is_bounded():
    store = ResponseStore(capacity=2)
    for k in range(3):
        store.remember(f"resp_{k}", [], {"role": "assistant", "content": str(k)})
    assert "resp_0" not in store and "resp_2" in store


@pytest.mark.parametrize(
    ("message", "finish"),
    [
        ({**TOOL_TURN, "content": "Computing."}, "tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": TOOL_TURN["tool_calls"] * 2}, "tool_calls"),
        ({"role": "assistant", "content": "#### 6"}, "stop"),
        ({"role": "assistant", "content": "#### 6 and more"}, "length"),
    ],
)
def test_stream_events_parse_and_accumulate_to_the_unstreamed_reply(message, finish):
    if len(message.get("tool_calls") or []) == 2:
        message = {
            **message,
            "tool_calls": [dict(c, id=f"call_{k}") for k, c in enumerate(message["tool_calls"])],
        }
    body = {"model": "m", "input": "2*3?", "tools": [CALC], "stream": True}
    store = ResponseStore()
    events = list(respond_stream(body, store, lambda _request: iter(chunks_of(message, finish))))
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert parsed[0].type == "response.created" and parsed[1].type == "response.in_progress"
    assert parsed[-1].type == ("response.incomplete" if finish == "length" else "response.completed")
    assert sum(e.type.endswith(".delta") for e in parsed) >= 2  # passed on piece by piece, not in one go
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for event in parsed:
        state.handle_event(event)
    streamed = parsed[-1].response
    direct = Response.model_validate(from_chat_reply(body, chat_reply(message, finish)))
    shape = lambda r: [item.model_dump(exclude={"id"}) for item in r.output]  # noqa: E731
    assert shape(streamed) == shape(direct) and streamed.status == direct.status
    assert streamed.usage == direct.usage
    if finish != "length":  # the openai package's own accumulator agrees (a ParsedResponse: texts, calls)
        final = state._completed_response
        calls = lambda r: [(i.call_id, i.name, i.arguments) for i in r.output if i.type == "function_call"]  # noqa: E731
        assert final.output_text == direct.output_text and calls(final) == calls(direct)
    # the reply reassembled from the chunks is what the store maps sent-back items to
    restored = store.restore({**message, "content": message.get("content") or ""})
    assert restored == {**message, "content": message.get("content")}


def test_a_call_whose_name_comes_late_is_still_one_item():
    stream = ResponseEvents({"input": "x"})
    events = stream.start()
    events += stream.chunk(
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"arguments": '{"a'}}]}}]}
    )
    events += stream.chunk(
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '": 1}'}}]}}
            ]
        }
    )
    events += stream.chunk({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    events += stream.finish()
    final = events[-1]["response"]["output"]
    assert [(i["name"], i["call_id"], i["arguments"]) for i in final] == [("f", "c1", '{"a": 1}')]


def test_sse_frames_name_the_event():
    frame = sse({"type": "response.output_text.delta", "sequence_number": 3, "delta": "é"}).decode()
    head, data, *_ = frame.split("\n")
    assert head == "event: response.output_text.delta"
    assert json.loads(data.removeprefix("data: "))["delta"] == "é" and frame.endswith("\n\n")
