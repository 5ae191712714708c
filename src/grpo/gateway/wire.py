"""The chat-completions wire format: a request as the `openai` package sends it, validated into a ChatRequest;
the events of one sampled turn; replies and stream chunks as the package parses them.

Messages are normalized into the form chat templates render (content a string, a tool call's arguments a
dict), and that form is also what tells whether a request extends the session's conversation: the
assistant message the gateway returned, sent back as the client serializes it (content None, `refusal`,
arguments as a JSON string), normalizes to the very dict the session stored.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class GatewayError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code=None, param=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


# -- events of one turn (Gateway.complete) ------------------------------------------------------------------
@dataclass
class TextDelta:
    text: str


@dataclass
class ToolCallDelta:
    index: int
    id: str
    name: str
    arguments: str  # JSON


@dataclass
class TurnDone:
    message: dict  # the OpenAI chat message: role, content, tool_calls (when any)
    finish_reason: str  # stop | tool_calls | length
    usage: dict  # prompt_tokens, completion_tokens, total_tokens
    logprobs: list[dict] | None = None  # the reply's sampled tokens ({token, logprob, bytes}), when asked


# -- requests -----------------------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """A message's content as one string: None → "", a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}: only text content is supported, got a {kind!r} part.", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad(f"{where}: content must be a string or a list of text parts.", "messages")


def _arguments(raw: Any, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError, RecursionError) as err:  # RecursionError: nested past the limit
        raise bad(f"{where}: function.arguments is not JSON ({err}).", "messages") from None
    if not isinstance(value, dict):
        raise bad(f"{where}: function.arguments must be a JSON object.", "messages")
    return value


def normalize_messages(messages: Any) -> list[dict]:
    """The request's messages in the form chat templates render; raises GatewayError on a malformed one."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list.", "messages")
    out: list[dict] = []
    names: dict[str, str] = {}  # tool call id → function name (some templates want it on the tool message)
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"{where}: role must be one of {', '.join(ROLES)}.", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}: each tool call needs function.name.", "messages")
                call_id = str(c.get("id") or "")
                names[call_id] = fn["name"]
                args = _arguments(fn.get("arguments"), where)
                calls.append(
                    {"type": "function", "id": call_id, "function": {"name": fn["name"], "arguments": args}}
                )
            msg["tool_calls"] = calls
        if role == "tool":
            call_id = str(m.get("tool_call_id") or "")
            msg["tool_call_id"] = call_id
            msg["name"] = str(m.get("name") or names.get(call_id, "tool"))
        out.append(msg)
    return out


# Request fields the gateway accepts but does not act on, with the values that ask for nothing (any other
# value is said once in the log): decoding is the policy's own, as training needs.
IGNORED = {
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True,),
    "top_logprobs": (0,),  # `logprobs: true` is honoured: each sampled token's own log-prob, no alternatives
    "logit_bias": ({},),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
}


def _number(body: dict, key: str, kind=float, low=None, high=None):
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)  # Python's JSON reader takes NaN and Infinity
        or (kind is int and value != int(value))
    ):
        raise bad(f"{key} must be {'an integer' if kind is int else 'a number'}.", key)
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            raise bad(f"{key} must be at least {low}, got {value}.", key)
        raise bad(f"{key} must be between {low} and {high}, got {value}.", key)
    return kind(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{key} must be true or false, got {value!r}.", key)
    return bool(value)


def _tool_choice(choice: Any, tools: list[dict] | None) -> str | None:
    """ "auto" / "none" / "required", or the name of the one function the request insists on."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise bad(
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools or []}:
        raise bad(f"tool_choice names {name!r}, which is not among the request's tools.", "tool_choice")
    return name


@dataclass
class ChatRequest:
    messages: list[dict]  # normalized (normalize_messages)
    tools: list[dict] | None = (
        None  # chat tools: {"type": "function", "function": {name, description, parameters}}
    )
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    logprobs: bool = False  # reply with each sampled token's log-prob (choices[0].logprobs.content)
    calls: bool = True  # read the reply for tool calls (tool_choice "none": no)
    tool_choice: str | None = None  # as validated; "required" or a name is asked of the model, not forced
    ignored: list[str] = field(default_factory=list)  # fields given that the gateway does not honour

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        """A chat-completions body as the openai package sends it; GatewayError (400) if malformed."""
        if not isinstance(body, dict):
            raise bad("The request body must be a JSON object.")
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or any(
                not isinstance(t, dict) or not isinstance((t.get("function") or {}).get("name"), str)
                for t in tools
            ):
                raise bad("tools must be a list of {'type': 'function', 'function': {'name': ...}}.", "tools")
            tools = [{"type": "function", "function": t["function"]} for t in tools] or None
        tool_choice = _tool_choice(body.get("tool_choice"), tools)
        if tool_choice == "none":
            tools = None  # the model is not shown the tools, and its reply is not read for calls
        if body.get("n") not in (None, 1):
            # one choice: a group's episodes are the agent's own calls, one sample each
            raise bad(f"n must be 1 (each episode is one sample of its group), got {body.get('n')!r}.", "n")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [stop] if stop else []
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop must be a string or a list of non-empty strings.", "stop")
        cap = _number(body, "max_completion_tokens", int, 1) or _number(body, "max_tokens", int, 1)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad("stream_options must be an object.", "stream_options")
        ignored = [k for k in IGNORED if body.get(k) not in (None, *IGNORED[k])]
        _number(body, "top_logprobs", int, 0, 20)  # OpenAI's range; alternatives are not given (said once)
        return cls(
            messages=normalize_messages(body.get("messages")),
            tools=tools,
            stop=stop,
            max_tokens=cap,
            temperature=_number(body, "temperature", float, 0.0, 2.0),
            top_p=_number(body, "top_p", float, 0.0, 1.0),
            seed=_number(body, "seed", int),
            stream=_flag(body, "stream"),
            logprobs=_flag(body, "logprobs"),
            include_usage=_flag(options, "include_usage"),
            model=str(body.get("model") or ""),
            calls=tool_choice != "none",
            tool_choice=tool_choice,
            ignored=ignored,
        )


# -- replies ------------------------------------------------------------------------------------------------
def chat_completion(done: TurnDone, request_id: str, model: str) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": done.message,
                "finish_reason": done.finish_reason,
                "logprobs": _logprobs(done.logprobs),
            }
        ],
        "usage": done.usage,
    }


def _logprobs(tokens: list[dict] | None) -> dict | None:
    return None if tokens is None else {"content": tokens, "refusal": None}


def chunk(
    request_id: str,
    model: str,
    delta: dict | None,
    finish_reason: str | None = None,
    usage=None,
    logprobs: list[dict] | None = None,
) -> dict:
    """One `chat.completion.chunk`; delta None: the usage chunk (no choices)."""
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": _logprobs(logprobs)}]
    )
    out = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    out["choices"] = choices
    if usage is not None:
        out["usage"] = usage
    return out


def stream_chunks(events, request_id: str, model: str, include_usage: bool):
    """The SSE data of a streamed reply, from Gateway.complete's events."""
    yield chunk(request_id, model, {"role": "assistant", "content": ""})
    for ev in events:
        if isinstance(ev, TextDelta):
            yield chunk(request_id, model, {"content": ev.text})
        elif isinstance(ev, ToolCallDelta):
            call = {"index": ev.index, "id": ev.id, "type": "function"}
            call["function"] = {"name": ev.name, "arguments": ev.arguments}
            yield chunk(request_id, model, {"tool_calls": [call]})
        else:
            # Asked-for log-probs come whole with the last chunk: a client joins the chunks' lists, so the
            # reassembled reply carries the same list as the non-streamed one.
            yield chunk(request_id, model, {}, ev.finish_reason, logprobs=ev.logprobs)
            if include_usage:
                yield chunk(request_id, model, None, usage=ev.usage)
    yield "[DONE]"


def finite_reward(value) -> float | None:
    """An agent's returned reward as a float: a finite real number, from Python, numpy (np.float32
    included) or a 0-d array or tensor (`scores.mean()`); None for anything else (a bool, a string, NaN)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy 0-d array, a torch scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None
