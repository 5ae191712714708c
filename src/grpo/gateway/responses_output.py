"""The reply side of the Responses API: a chat completion as a Response object, and chat completion
chunks as the Responses stream events (gateway/responses.py translates the requests and holds the session's
responses). Shapes and event order are those the `openai` package's types and stream accumulator read.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# -- reply ------------------------------------------------------------------------------------------


def output_items(message: dict, status: str = "completed") -> list[dict]:
    """A chat reply's assistant message as Responses output items: its text, then one item per tool call."""
    items: list[dict] = []
    if message.get("content"):
        items.append(_message_item(new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or []:
        items.append(
            _call_item(
                new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"], status
            )
        )
    return items


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage.get("total_tokens", prompt + completion),
    }


def response_object(
    body: dict, response_id: str, created: float, output: list[dict], status: str, chat_usage: dict | None
) -> dict:
    """A Response as the API returns it: the request's settings echoed, the output items, status, usage."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
        "model": body.get("model") or "grpo",
        "output": output,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage(chat_usage),
    }


def status_of(finish_reason: str | None) -> str:
    # A reply cut by a token cap is "incomplete" with reason max_output_tokens, as the API reports it.
    return "incomplete" if finish_reason == "length" else "completed"


def from_chat_reply(
    body: dict, reply: dict, response_id: str | None = None, created: float | None = None
) -> dict:
    """The Response for a (non-streamed) chat completion."""
    choice = reply["choices"][0]
    status = status_of(choice.get("finish_reason"))
    items = output_items(choice["message"], status)
    return response_object(
        body, response_id or new_id("resp"), created or time.time(), items, status, reply.get("usage")
    )


# -- streaming --------------------------------------------------------------------------------------


class ResponseEvents:
    """Chat completion chunks in, Responses stream events out, in the order the `openai` package's stream
    accumulator requires: response.created, response.in_progress, then per output item `output_item.added`,
    its deltas, its `.done` events and `output_item.done`, and last response.completed (or
    response.incomplete when a token cap cut the reply). Text and arguments are passed on as they arrive:
    one chunk in, its events out, nothing held back until the turn ends."""

    def __init__(self, body: dict, response_id: str | None = None, created: float | None = None) -> None:
        self.body = body
        self.response_id, self.created = response_id or new_id("resp"), created or time.time()
        self.sequence = 0
        self.items: list[dict] = []  # output items, finished ones final, the open one growing
        self.open: dict | None = None  # the item receiving deltas
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item
        self.pending: dict[int, dict] = {}  # a call whose name has not arrived yet: id and arguments so far
        self.finish_reason: str | None = None
        self.chat_usage: dict | None = None
        self.message: dict = {"role": "assistant", "content": None}  # the reply reassembled (for the store)

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        snapshot = response_object(self.body, self.response_id, self.created, [], "in_progress", None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def chunk(self, chunk: dict) -> list[dict]:
        """The events for one chat completion chunk (its text delta, tool-call deltas, finish, usage)."""
        events: list[dict] = []
        if chunk.get("usage"):
            self.chat_usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict]:
        """Close the open item and end the response (after the last chunk)."""
        status = status_of(self.finish_reason)
        events = self._close(status) if not self.pending else self._close()
        for index in sorted(self.pending):  # a call whose name never came: shown with what it had
            events += self._open_call(index, "", self.pending.pop(index))
            events += self._close(status)
        final = response_object(
            self.body, self.response_id, self.created, self.items, status, self.chat_usage
        )
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=final)]

    def fail(self, message: str, code: str = "server_error") -> list[dict]:
        """The stream's last event when the turn fails after it began: `response.failed`, its Response
        carrying the error and the output so far (an unfinished item marked incomplete), as the API ends a
        response it could not finish. No `.done` events: the item did not finish."""
        if self.open is not None:
            self.open["status"] = "incomplete"
        for index in sorted(self.pending):  # a call whose name never came: dropped, it was never shown
            self.pending.pop(index)
        final = response_object(
            self.body, self.response_id, self.created, self.items, "failed", self.chat_usage
        )
        final["error"] = {"code": code, "message": message}
        return [self._event("response.failed", response=final)]

    def _text(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            item = _message_item(new_id("msg"), "", "in_progress")
            part = dict(item["content"][0])
            item["content"] = []
            events += self._add(item)
            item["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(),
                    content_index=0,
                    part={**part, "text": ""},
                )
            )
        self.open["content"][0]["text"] += text
        self.message["content"] = (self.message["content"] or "") + text
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=self._index(),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _call(self, delta: dict) -> list[dict]:
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        if index not in self.calls:
            pending = self.pending.setdefault(index, {"id": None, "name": None, "arguments": ""})
            pending["id"] = delta.get("id") or pending["id"]
            pending["name"] = function.get("name") or pending["name"]
            pending["arguments"] += function.get("arguments") or ""
            if pending["name"] is None:
                return []
            return self._open_call(index, pending["name"], self.pending.pop(index))
        item = self.calls[index]
        if self.open is not item:
            raise RuntimeError(f"tool call {index} continued after the next one began")
        return self._arguments(function.get("arguments") or "")

    def _open_call(self, index: int, name: str, pending: dict) -> list[dict]:
        events = self._close()
        item = _call_item(new_id("fc"), pending["id"] or new_id("call"), name, "", "in_progress")
        self.calls[index] = item
        events += self._add(item)
        self.message.setdefault("tool_calls", []).append(
            {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": ""}}
        )
        return events + self._arguments(pending["arguments"])

    def _arguments(self, text: str) -> list[dict]:
        if not text:
            return []
        self.open["arguments"] += text
        self.message["tool_calls"][-1]["function"]["arguments"] += text
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=self._index(),
                delta=text,
            )
        ]

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=self._index(), item=_copy(item))]

    def _index(self) -> int:
        return len(self.items) - 1

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = self.items.index(item), []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_copy(part),
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        return [*events, self._event("response.output_item.done", output_index=index, item=_copy(item))]


def _copy(value: dict) -> dict:
    return json.loads(json.dumps(value))


def sse(event: dict) -> bytes:
    """One server-sent event as the Responses API frames it (`event:` line, then `data:`)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
