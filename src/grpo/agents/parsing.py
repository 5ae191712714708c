"""Tool calls in the model family's own format: parse what a model wrote, write what it would write.

Three families cover the open tool-calling models:

* ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  several a turn.
* ``llama3_json`` (Llama 3.1/3.2/3.3): the message is ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``; several are separated by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` (Nemo and earlier), or
  ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` (Mistral Small 3.2 and later).

Parse the text of one sampled turn without its end-of-turn token, decoded with ``skip_special_tokens=False``:
``[TOOL_CALLS]`` and ``<|python_tag|>`` are special tokens, and the call cannot be told from prose without
them. A malformed call is not an exception: it becomes one line in ``ParsedTurn.errors``, written for the
model to read in the tool message, and the episode goes on. ``detect_parser`` picks the family from what the
tokenizer's chat template declares.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpo.config.errors import ConfigError

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")
# Arguments deeper than this are refused: no tool schema nests so far, and the template's `tojson`, the schema
# check and samples.jsonl all walk them recursively (a model can write 100,000 brackets in one turn).
MAX_ARGUMENT_DEPTH = 64


def _decoded(text: str, pos: int = 0) -> tuple[Any, int]:
    """`raw_decode` whose every failure is a JSONDecodeError: a model's text may nest past the recursion
    limit (RecursionError) or hold an integer past Python's digit limit (a bare ValueError)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("it nests too deeply to be read", text, pos) from None
    except ValueError as err:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise json.JSONDecodeError(str(err).split(";")[0], text, pos) from None


def _loads(text: str) -> Any:
    """`json.loads` (white space around the value, nothing else) with `_decoded`'s errors."""
    start = _skip_space(text, 0)
    obj, end = _decoded(text, start)
    if _skip_space(text, end) != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return obj


def _depth(value: Any) -> int:
    """How deeply `value` nests (iteratively: it may be deep enough to overflow a recursive walk)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, level + 1) for child in children)
    return deepest


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


@dataclass
class ToolCall:
    name: str
    arguments: dict  # the parsed JSON object
    id: str | None = None


@dataclass
class ParsedTurn:
    content: str  # the assistant text outside tool-call markup, stripped
    calls: list[ToolCall]
    errors: list[str]  # one message per malformed call, written for the model
    # For each error, its 0-based place among all the call attempts of the turn, so that tool results can be
    # given back in the order the model wrote the calls (empty: the errors come after the calls).
    error_positions: list[int] = field(default_factory=list)


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedTurn: ...

    def format_call(self, call: ToolCall) -> str: ...


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    names = {dict: "object", list: "array", str: "string", int: "integer", float: "number"}
    return names.get(type(value), type(value).__name__)


def _dumps(value: Any) -> str:
    # Chat templates write JSON with `tojson` (json.dumps, ensure_ascii=False); format_call matches them.
    return json.dumps(value, ensure_ascii=False)


class _Turn:
    """Collects one turn's calls and errors in the order the model wrote them."""

    def __init__(self, usage: str) -> None:
        self.usage = usage
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.error_positions: list[int] = []
        self.content: list[str] = []

    @property
    def ordinal(self) -> int:  # 1-based number of the next call attempt, as the model reads it
        return len(self.calls) + len(self.errors) + 1

    def error(self, what: str) -> None:
        self.error_positions.append(self.ordinal - 1)
        self.errors.append(f"tool call {self.ordinal} {what}; write {self.usage}")

    def json_error(self, err: json.JSONDecodeError, extra: str = "", start: int = 0) -> None:
        """`start`: where the call's JSON begins in the decoded text, so positions count from the call."""
        self.error(f"is not valid JSON{extra}: {err.msg} (char {err.pos - start})")

    def add(self, obj: Any, name: str | None = None, call_id: str | None = None) -> None:
        """Check one decoded call object (or, with `name`, a bare arguments object) and record it."""
        if name is None:
            if not isinstance(obj, dict):
                self.error(f"is a JSON {_json_type(obj)}, not an object")
                return
            name = obj.get("name")
            if not isinstance(name, str) or not name.strip():
                self.error('has no "name" (a non-empty string)')
                return
            call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
            # Hermes and Mistral write "arguments", Llama "parameters"; models mix them up: take either.
            key = "arguments" if "arguments" in obj else "parameters"
            obj = obj.get(key)
        if obj is None:  # no arguments written, or null: a call without arguments
            obj = {}
        if isinstance(obj, str):  # OpenAI-style arguments: a JSON object encoded as a string
            try:
                obj = _loads(obj)
            except json.JSONDecodeError as err:
                self.json_error(err, " in its arguments string")
                return
        if not isinstance(obj, dict):
            self.error(f"has arguments that are a JSON {_json_type(obj)}, not an object")
            return
        if _depth(obj) > MAX_ARGUMENT_DEPTH:
            self.error(f"has arguments nested more than {MAX_ARGUMENT_DEPTH} levels deep")
            return
        self.calls.append(ToolCall(name=name.strip(), arguments=obj, id=call_id))

    def result(self) -> ParsedTurn:
        return ParsedTurn("".join(self.content).strip(), self.calls, self.errors, self.error_positions)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes 2 Pro / 3)."""

    name = "hermes"
    usage = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    _open, _close = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        turn = _Turn(self.usage)
        # Calls written while thinking are plans, not calls: scan only after the last </think>.
        think_end = text.rfind("</think>")
        pos = think_end + len("</think>") if think_end >= 0 else 0
        turn.content.append(text[:pos])
        while (start := text.find(self._open, pos)) >= 0:
            turn.content.append(text[pos:start])
            body_start = start + len(self._open)
            end = text.find(self._close, body_start)
            closed = end >= 0
            body = text[body_start : end if closed else len(text)].strip()
            pos = end + len(self._close) if closed else len(text)
            try:
                obj = _loads(body)
            except json.JSONDecodeError as err:
                turn.json_error(err, "" if closed else f" and is not closed with {self._close}")
                continue
            turn.add(obj)  # an unclosed but complete call (the model stopped at the end of the JSON) counts
        turn.content.append(text[pos:])
        return turn.result()

    def format_call(self, call: ToolCall) -> str:
        body = _dumps({"name": call.name, "arguments": call.arguments})
        return f"{self._open}\n{body}\n{self._close}"


class Llama3JsonParser:
    """Llama 3.1/3.2/3.3 JSON tool calls: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]``.

    Without ``<|python_tag|>`` a message is a call only if it starts with ``{`` and names a ``"name"`` early
    on: the template tells the model to answer with bare JSON to call, and prose rarely opens that way.
    Llama's built-in tools (``brave_search.call(...)``) are not JSON and are reported as malformed.
    """

    name = "llama3_json"
    usage = '{"name": ..., "parameters": {...}} (several separated by ";")'
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        turn = _Turn(self.usage)
        before, tagged, rest = text.partition(self._tag)
        if not tagged:
            before, rest = "", text
            head = rest.lstrip()
            if not (head.startswith("{") and '"name"' in head[:200]):
                turn.content.append(text)
                return turn.result()
        turn.content.append(before)
        pos = _skip_space(rest, 0)
        while True:
            try:
                obj, end = _decoded(rest, pos)
            except json.JSONDecodeError as err:
                turn.json_error(
                    err, start=pos
                )  # the rest of the message is the broken call: nothing left to read
                return turn.result()
            turn.add(obj)
            pos = _skip_space(rest, end)
            if not rest.startswith(";", pos):
                turn.content.append(rest[pos:])
                return turn.result()
            pos = _skip_space(rest, pos + 1)
            if pos == len(rest):  # a trailing ";"
                return turn.result()

    def format_call(self, call: ToolCall) -> str:
        # As Llama's chat template renders an assistant tool call: name first, then "parameters".
        return f'{{"name": "{call.name}", "parameters": {_dumps(call.arguments)}}}'


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")


class MistralParser:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``
    (the call id optional) as Mistral Small 3.2 and later write it."""

    name = "mistral"
    usage = '[TOOL_CALLS][{"name": ..., "arguments": {...}}]'
    _tag = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedTurn:
        turn = _Turn(self.usage)
        pos = 0
        while (start := text.find(self._tag, pos)) >= 0:
            turn.content.append(text[pos:start])
            pos = self._read_calls(text, start + len(self._tag), turn)
        turn.content.append(text[pos:])
        return turn.result()

    def _read_calls(self, text: str, pos: int, turn: _Turn) -> int:
        """Read the calls after one [TOOL_CALLS]; return where the text after them starts."""
        skip_broken = text.find(self._tag, pos)  # after a broken call, go on at the next [TOOL_CALLS]
        skip_broken = len(text) if skip_broken < 0 else skip_broken
        named = _MISTRAL_NAMED.match(text, pos)
        if named:
            try:
                args, end = _decoded(text, named.end())
            except json.JSONDecodeError as err:
                turn.json_error(err, start=named.end())
                return skip_broken
            turn.add(args, name=named.group(1), call_id=named.group(2))
            return end
        start = _skip_space(text, pos)
        try:
            calls, end = _decoded(text, start)
        except json.JSONDecodeError as err:
            turn.json_error(err, start=start)
            return skip_broken
        for obj in calls if isinstance(calls, list) else [calls]:
            turn.add(obj)
        return end

    def __init__(self, named_calls: bool = False) -> None:
        self.named_calls = named_calls  # format_call writes the name[CALL_ID]id[ARGS] form (both are parsed)

    def format_call(self, call: ToolCall) -> str:
        if self.named_calls:
            call_id = f"[CALL_ID]{call.id}" if call.id is not None else ""
            return f"{self._tag}{call.name}{call_id}[ARGS]{_dumps(call.arguments)}"
        obj: dict[str, Any] = {"name": call.name, "arguments": call.arguments}
        if call.id is not None:
            obj["id"] = call.id
        return f"{self._tag}[{_dumps(obj)}]"


def parse_turn(parser: ToolCallParser, text: str) -> ParsedTurn:
    """`parser.parse(text)`, and whatever a parser still lets escape (a bug, a custom parser's exception) is
    one error message for the model instead of the end of the run: the text is model output, not ours."""
    try:
        return parser.parse(text)
    except Exception as err:  # noqa: BLE001 - nothing a model writes may stop training
        usage = getattr(parser, "usage", "the tool-call format of the chat template")
        reason = f"{type(err).__name__}: {str(err)[:200]}"
        return ParsedTurn(
            text.strip(), [], [f"the tool calls could not be read ({reason}); write {usage}"], [0]
        )


class NoToolCalls:
    """A model whose chat template declares no tool-call format, serving an agent that sends no tools (the
    gateway): its replies are text, never read for calls. Requests that send tools are refused (400)."""

    name = "none"
    usage = "plain text (this model has no tool-call format)"

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(text.strip(), [], [])

    def format_call(self, call: ToolCall) -> str:
        raise ValueError(
            f"{call.name}: this model has no tool-call format; set env.tool_parser to the one it writes"
        )


PARSERS: dict[str, type] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
    MistralParser.name: MistralParser,
}

_CHOICES = "hermes|llama3_json|mistral"


def declared_format(template: str) -> str | None:
    """The tool-call family a chat template's text declares, or None."""
    if "[TOOL_CALLS]" in template:
        return MistralParser.name
    if "<tool_call>" in template:
        # Qwen3-Coder wraps XML (<function=name><parameter=p>...) in <tool_call>, not JSON: not hermes.
        return None if "<function=" in template else HermesParser.name
    llama_marker = "<|python_tag|>" in template or "ipython" in template
    if llama_marker and ('"parameters"' in template or "JSON for a function call" in template):
        return Llama3JsonParser.name
    return None


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(
        template, dict
    ):  # named templates ("default", "tool_use", ...): any of them may declare tools
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def detect_parser(
    tokenizer: Any, model_name: str, choice: str = "auto", optional: bool = False
) -> ToolCallParser:
    """The parser for `model_name`'s tool-call format: `choice` if given, else what its template declares.
    optional (the gateway, whose agent may send no tools): where the template declares no format, the
    NoToolCalls parser instead of an error; requests with tools are then refused, naming env.tool_parser."""
    if optional and choice == "auto":
        try:
            return detect_parser(tokenizer, model_name, choice)
        except ConfigError:
            return NoToolCalls()
    if choice != "auto":
        if choice not in PARSERS:
            raise ConfigError(
                f"env.tool_parser={choice!r} is not a known tool-call format; choose auto|{_CHOICES}."
            )
        return PARSERS[choice]()
    template = _template_text(tokenizer)
    if not template:
        raise ConfigError(
            f"{model_name} has no chat template, so its tool-call format is unknown; "
            f"set env.tool_parser={_CHOICES} to the format it was trained on."
        )
    found = declared_format(template)
    if found is None and "<function=" in template:
        raise ConfigError(
            f"{model_name}'s chat template declares XML tool calls (<tool_call><function=...>, Qwen3-Coder's "
            f"format), which grpo does not parse; set env.tool_parser={_CHOICES} only if it writes one of "
            "those."
        )
    if found is None:
        raise ConfigError(
            f"{model_name}'s chat template declares no tool-call format grpo knows (<tool_call>, Llama 3 "
            f"JSON, [TOOL_CALLS]); set env.tool_parser={_CHOICES} to the format it was trained on."
        )
    if found == MistralParser.name:
        return MistralParser(named_calls="[ARGS]" in template)
    return PARSERS[found]()
