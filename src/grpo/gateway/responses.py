"""The Responses API (`POST /v1/responses`) as a translation onto the chat completions the gateway serves.

Agent SDKs default to the Responses API; the gateway samples through one path, chat completions, so that
token exactness, tool-call parsing and streaming are written once. Pure: dicts in, dicts out (the reply side,
Response objects and stream events, is gateway/responses_output.py).

    request   input (a string, or items: messages, function_call, function_call_output), instructions,
              function tools, tool_choice, max_output_tokens, temperature, top_p, stream,
              previous_response_id           ──chat_request──▶  a chat completions request body
    reply     a chat completion              ──response_object──▶ a Response (message + function_call items)
    stream    chat completion chunks         ──ResponseEvents──▶  response.created … response.completed

Token exactness across turns: a reply's assistant message becomes at most one `message` item (its text)
followed by one `function_call` item per tool call (`call_id` = the tool call's id, `arguments` as sent).
Items the client sends back group the other way (a message item and the function_call items after it are
one assistant message), and when they carry what a reply of this session held, the reply's own chat message
is used verbatim (`ResponseStore.restore`), so the chat messages the core sees extend its last conversation.

Not supported (a 400 that says so): built-in tools (web search, file search, computer use, MCP, ...),
structured output (`text.format` json_schema), images and files in the input, `background`, `n`.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from grpo.gateway.responses_output import ResponseEvents, from_chat_reply, new_id
from grpo.gateway.wire import ChatRequest, GatewayError, TurnDone, chat_completion, stream_chunks

log = logging.getLogger("grpo")

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponsesRequestError(ValueError):
    """A request this translation refuses: the HTTP status and an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.param,
                "code": None,
            }
        }


# -- request ----------------------------------------------------------------------------------------


def chat_request(body: dict, store: ResponseStore | None = None) -> tuple[dict, list[dict]]:
    """The chat completions request for a Responses request, and the conversation it continues (the chat
    messages without `instructions`, which the API does not carry over to a follow-up response)."""
    if not isinstance(body, dict):
        raise ResponsesRequestError("the request body must be a JSON object")
    _refuse_unsupported(body)
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if store is None or previous not in store:
            raise ResponsesRequestError(
                f"previous response {previous!r} is not known to this session (responses are kept per "
                "session, in memory, for the episode only); send the whole conversation as `input` instead",
                "previous_response_id",
            )
        history = store.conversation(previous)
    conversation = history + input_messages(body.get("input"), store)
    if not conversation:
        raise ResponsesRequestError("`input` is empty: give a string or a list of input items", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesRequestError("`instructions` must be a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    request: dict[str, Any] = {"model": body.get("model") or "grpo", "messages": messages}
    return {**request, **_chat_settings(body)}, conversation


def _chat_settings(body: dict) -> dict:
    """The request's tools and sampling fields in chat completions' names."""
    request: dict[str, Any] = {}
    if tools := body.get("tools"):
        request["tools"] = [_chat_tool(tool, k) for k, tool in enumerate(_list(tools, "tools"))]
    if "tool_choice" in body and body["tool_choice"] is not None:
        request["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        request["parallel_tool_calls"] = bool(body["parallel_tool_calls"])
    if (cap := body.get("max_output_tokens")) is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise GatewayError(400, f"max_output_tokens must be an integer of at least 1, got {cap!r}.",
                               param="max_output_tokens")  # fmt: skip
        request["max_completion_tokens"] = cap
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            request[key] = body[key]
    if body.get("stream") not in (None, True, False):
        raise GatewayError(400, f"stream must be true or false, got {body['stream']!r}.", param="stream")
    if body.get("stream"):
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
    return request


def _refuse_unsupported(body: dict) -> None:
    # Other fields (store, metadata, include, reasoning, ...) change nothing the policy samples: ignored,
    # so that an SDK that sends a new field by default still trains.
    if body.get("background"):
        raise ResponsesRequestError(
            "background responses are not supported; send the request in the foreground (`background` false)",
            "background",
        )
    if body.get("conversation") is not None:
        raise ResponsesRequestError(
            "server-side conversations are not supported; send the whole "
            "conversation as `input`, or use previous_response_id",
            "conversation",
        )
    if body.get("prompt") is not None:
        raise ResponsesRequestError(
            "stored prompt templates are not supported; send `instructions` and `input`", "prompt"
        )
    text = body.get("text")
    kind = ((text or {}).get("format") or {}).get("type", "text") if isinstance(text, dict) else "text"
    if kind != "text":
        raise ResponsesRequestError(
            f"`text.format` {kind!r} (structured output) is not supported: the policy is sampled freely; "
            "ask for the format in the instructions and check it in your agent",
            "text.format",
        )


def _list(value: Any, param: str) -> list:
    if not isinstance(value, list):
        raise ResponsesRequestError(f"`{param}` must be a list", param)
    return value


def _chat_tool(tool: Any, k: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ResponsesRequestError(
            f"tools[{k}] is a {kind!r} tool; only function tools are supported (your agent runs its tools "
            "itself: describe each as {'type': 'function', 'name', 'description', 'parameters'})",
            f"tools[{k}]",
        )
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ResponsesRequestError(f"tools[{k}] has no `name`", f"tools[{k}].name")
    function = {"name": tool["name"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> str | dict:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesRequestError(
        f"tool_choice {choice!r} is not supported; use 'auto', 'none', 'required' or "
        "{'type': 'function', 'name': ...}",
        "tool_choice",
    )


def input_messages(items: Any, store: ResponseStore | None = None) -> list[dict]:
    """Chat messages for a Responses `input`: a string is one user message; items map one to one, except
    that an assistant message item and the function_call items right after it are one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if items is None:
        return []
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message being assembled from output items
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages that answer them

    def close() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(store.restore(turn) if store is not None else turn)
            turn = None

    for k, item in enumerate(_list(items, "input")):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise ResponsesRequestError(f"{where} must be an object, got {type(item).__name__}", where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _tool_call(item, where)
            names[call["id"]] = call["function"]["name"]
            if turn is None:
                turn = {"role": "assistant", "content": None}
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "message" and item.get("role") == "assistant":
            close()
            turn = {"role": "assistant", "content": _text(item.get("content"), where)}
        else:
            close()
            messages.append(_plain_message(item, kind, where, names))
    close()
    return messages


def _tool_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ResponsesRequestError(f"{where} (function_call) needs a string `{key}`", f"{where}.{key}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _plain_message(item: dict, kind: str, where: str, names: dict[str, str]) -> dict:
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise ResponsesRequestError(f"{where} (function_call_output) needs a string `call_id`", where)
        message = {
            "role": "tool",
            "tool_call_id": item["call_id"],
            "content": _text(item.get("output"), where),
        }
        if item["call_id"] in names:
            message["name"] = names[item["call_id"]]
        return message
    if kind != "message":
        raise ResponsesRequestError(
            f"{where} is a {kind!r} item; the gateway takes message, function_call and function_call_output "
            "items (it produces no reasoning or built-in tool items)",
            where,
        )
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise ResponsesRequestError(
            f"{where} has role {item.get('role')!r}; use user, system, developer or assistant",
            f"{where}.role",
        )
    return {"role": role, "content": _text(item.get("content"), where)}


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the text of its input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesRequestError(f"{where}.content must be a string or a list of text parts", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ResponsesRequestError(
                f"{where} has a {kind!r} content part; only text parts (input_text, output_text) are "
                "supported: the bundled and native policies read text only",
                where,
            )
        texts.append(part["text"])
    return "".join(texts)


# -- per-session memory -----------------------------------------------------------------------------


def _canonical(message: dict) -> tuple:
    """What identifies an assistant message across the round trip: its text (None and "" alike) and its
    calls (arguments compared as JSON where they parse)."""

    def arguments(text: str) -> Any:
        try:
            return json.dumps(json.loads(text), sort_keys=True)
        except (TypeError, ValueError):
            return text

    calls = tuple(
        (c.get("id"), c["function"]["name"], arguments(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    )
    return (message.get("content") or "", calls)


class ResponseStore:
    """One session's responses: the conversation each ended (for previous_response_id) and the exact chat
    messages the gateway replied with (so items sent back map to the messages the core returned). Bounded:
    the oldest entries go first."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()
        self._replies: OrderedDict[tuple, dict] = OrderedDict()

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._conversations

    def remember(self, response_id: str, conversation: list[dict], reply: dict) -> None:
        """`conversation`: the request's messages less instructions; `reply`: the chat assistant message."""
        self._conversations[response_id] = [*conversation, reply]
        self._replies[_canonical(reply)] = reply
        for table in (self._conversations, self._replies):
            while len(table) > self.capacity:
                table.popitem(last=False)

    def conversation(self, response_id: str) -> list[dict]:
        return [dict(m) for m in self._conversations[response_id]]

    def restore(self, message: dict) -> dict:
        """The gateway's own reply for an assistant message rebuilt from items, else the message as built."""
        reply = self._replies.get(_canonical(message))
        return dict(reply) if reply is not None else message


# -- one request, end to end ------------------------------------------------------------------------


def respond(body: dict, store: ResponseStore, complete: Callable[[dict], dict]) -> dict:
    """A non-streamed Responses request: `complete(chat_request)` is the gateway's chat completion."""
    request, conversation = chat_request(body, store)
    reply = complete(request)
    response = from_chat_reply(body, reply)
    store.remember(response["id"], conversation, reply["choices"][0]["message"])
    return response


def respond_stream(
    body: dict, store: ResponseStore, complete: Callable[[dict], Iterable[dict]]
) -> Iterator[dict]:
    """A streamed Responses request: `complete(chat_request)` yields the chat completion's chunks; the
    events go out as the chunks come in. The request is translated (and refused) before the first event."""
    request, conversation = chat_request(body, store)
    chunks = complete(request)

    def events() -> Iterator[dict]:
        stream = ResponseEvents(body)
        yield from stream.start()
        try:
            for chunk in chunks:
                yield from stream.chunk(chunk)
        except Exception as err:  # noqa: BLE001 - after the first event the reply is a stream: it fails in it
            log.warning("Gateway: a streamed response failed: %s: %s", type(err).__name__, err)
            message = str(err) if isinstance(err, GatewayError) else f"{type(err).__name__}: {err}"
            yield from stream.fail(message)
            return
        yield from stream.finish()
        store.remember(stream.response_id, conversation, stream.message)

    return events()


# -- the route (server.ROUTES["/v1/responses"]) -----------------------------------------------------


def responses_route(gateway: Any, session: Any, body: Any) -> dict | Iterator[tuple[str, dict]]:
    """POST /v1/responses for one session: translated onto `gateway.complete` (one chat turn), answered as
    a Response, or streamed as (event, data) pairs that the server frames as server-sent events."""
    store = getattr(session, "responses", None)
    if store is None:
        store = session.responses = ResponseStore()
    model = getattr(gateway, "model_name", "grpo")

    def complete(request: dict) -> Any:
        chat = ChatRequest.parse(request)
        events = gateway.complete(session, chat)
        first = next(events)  # a refusal surfaces here, before the first event goes out
        events = _chain(first, events)
        request_id = new_id("chatcmpl")
        if chat.stream:
            return (c for c in stream_chunks(events, request_id, model, True) if isinstance(c, dict))
        return chat_completion(next(e for e in events if isinstance(e, TurnDone)), request_id, model)

    if isinstance(body, dict) and body.get("stream") not in (None, True, False):
        raise GatewayError(400, f"stream must be true or false, got {body['stream']!r}.", param="stream")
    try:
        if isinstance(body, dict) and body.get("stream"):
            return ((event["type"], event) for event in respond_stream(body, store, complete))
        return respond(body, store, complete)
    except ResponsesRequestError as err:
        raise GatewayError(err.status, str(err), param=err.param) from None


def _chain(first: Any, rest: Iterator) -> Iterator:
    yield first
    yield from rest
