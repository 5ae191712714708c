"""Running tools safely: a step's calls all at once, each with a time limit, every failure a message.

A tool is a typed Python function with a Google-style docstring (TRL's contract): transformers'
``get_json_schema`` describes it to the model, and the same schema checks the model's arguments before the
call. Whatever goes wrong (a malformed call, an unknown tool, bad arguments, a tool that raises, hangs or
returns megabytes) becomes a ``ToolResult`` whose ``content`` tells the model what happened, and the episode
goes on; nothing here raises for what a model writes or a tool does.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from grpo.agents.parsing import ParsedTurn, ToolCall
from grpo.config.errors import ConfigError
from grpo.rewards.isolation import stop_overdue

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
_STOP_POLL_S = 0.25  # how often a wait for tool answers looks for a stop signal


# Schemas by function, and by the function under a bound method: an environment's tools are the methods of a
# fresh instance per episode, and get_json_schema parses the docstring and hints each time (0.15-0.3 ms a tool
# here, so ~50 ms a step for 64 episodes with 3 tools; a cached copy takes 0.03 ms).
_SCHEMAS = {True: weakref.WeakKeyDictionary(), False: weakref.WeakKeyDictionary()}


def tool_schema(fn: Callable) -> dict:
    """The ``{"type": "function", "function": {...}}`` schema transformers writes for `fn`."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    if not callable(fn):
        raise ConfigError(
            f"tool {label} is not callable; give a function with typed arguments and a docstring."
        )
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        # The model sees a tool's name, summary and arguments, read from a def's name, docstring and hints: a
        # functools.partial or a callable object has none of its own.
        kind = "a functools.partial" if isinstance(fn, functools.partial) else f"a {type(fn).__name__} object"
        raise ConfigError(
            f"tool {label[:80]} is {kind}, not a function: a tool is a def (its name, docstring and type "
            "hints describe it to the model); wrap the call in one."
        )
    bound = inspect.ismethod(fn)
    cache, key = _SCHEMAS[bound], fn.__func__ if bound else fn
    try:
        schema = cache.get(key)
    except TypeError:  # not weak-referenceable (a builtin, a partial): described each time
        schema, cache = None, {}
    if schema is None:
        try:
            schema = get_json_schema(fn)
        except (DocstringParsingException, TypeHintParsingException) as err:
            raise ConfigError(
                f"tool {label} cannot be described to the model ({err}); give it a type hint for every "
                "argument and a Google-style docstring with a summary line and an 'Args:' entry per argument."
            ) from None
        cache[key] = schema
    return copy.deepcopy(schema)  # callers may rename it


@dataclass
class ToolResult:
    call: ToolCall | None  # None for a malformed call (then error == "malformed")
    content: str  # what the model reads in the tool message
    error: str | None  # None, or one of ERROR_KINDS
    truncated: bool = False
    seconds: float = 0.0


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


_ARTICLES = {"integer": "an integer", "array": "an array", "object": "an object", "null": "null"}


def _a(json_type: str) -> str:
    return _ARTICLES.get(json_type, f"a {json_type}")


def _json_type(value: Any) -> str:
    for name, types in _JSON_TYPES.items():
        if isinstance(value, types) and not (isinstance(value, bool) and name in ("integer", "number")):
            return name
    return type(value).__name__


def _type_problem(spec: dict, value: Any) -> str | None:
    """Why `value` does not fit the JSON-schema `spec` (as get_json_schema writes them), or None."""
    if value is None and spec.get("nullable"):
        return None
    wanted = spec.get("type")
    if wanted is not None:
        wanted = [wanted] if isinstance(wanted, str) else list(wanted)
        # JSON has one number type: an integer is a number, a boolean is neither.
        got = _json_type(value)
        if not (got in wanted or (got == "integer" and "number" in wanted)):
            return f"must be {' or '.join(_a(w) for w in wanted)}, not {_a(got)}"
    if "enum" in spec and value not in spec["enum"]:
        return f"must be one of {json.dumps(spec['enum'], ensure_ascii=False)}"
    if isinstance(value, list) and isinstance(spec.get("items"), dict):
        for i, item in enumerate(value):
            if problem := _type_problem(spec["items"], item):
                return f"item {i} {problem}"
    if isinstance(value, dict) and isinstance(spec.get("additionalProperties"), dict):
        for key, item in value.items():
            if problem := _type_problem(spec["additionalProperties"], item):
                return f"entry {key!r} {problem}"
    return None


def encodable(value: Any) -> str:
    """Text a tokenizer can encode: str() of anything, unencodable characters (lone surrogates) replaced."""
    text = value if isinstance(value, str) else str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, (dict, list, tuple)):
        try:
            return encodable(json.dumps(value, ensure_ascii=False, default=str))
        except ValueError:  # a circular structure
            return encodable(str(value))
    return encodable(str(value))


def _truncate(text: str, max_chars: int) -> tuple[str, bool]:
    if len(text) <= max_chars:
        return text, False
    return f"{text[:max_chars]}…[truncated {len(text) - max_chars:,} chars]", True


class _Tool:
    def __init__(self, name: str, fn: Callable) -> None:
        self.name, self.fn = name, fn
        self.schema = tool_schema(fn)
        self.schema["function"]["name"] = name
        params = self.schema["function"].get("parameters", {})
        self.properties: dict[str, dict] = params.get("properties", {})
        self.required: list[str] = list(params.get("required", []))

    def signature(self) -> str:
        def kind(spec: dict) -> str:
            wanted = spec.get("type", "any")
            return wanted if isinstance(wanted, str) else "|".join(wanted)

        args = ", ".join(f"{k}: {kind(spec)}" for k, spec in self.properties.items())
        return f"{self.name}({args})"

    def argument_problem(self, arguments: dict) -> str | None:
        for key in self.required:
            if key not in arguments:
                return f"missing required argument '{key}'"
        for key, value in arguments.items():
            if key not in self.properties:
                return f"unexpected argument '{key}'"
            if problem := _type_problem(self.properties[key], value):
                return f"argument '{key}' {problem}"
        return None


def call_slots(turn: ParsedTurn) -> list[ToolCall | str]:
    """The turn's call attempts in the order the model wrote them: calls, and the malformed ones' messages."""
    total = len(turn.calls) + len(turn.errors)
    where = set(turn.error_positions)
    if len(where) != len(turn.errors) or not where <= set(
        range(total)
    ):  # absent or inconsistent: errors last
        where = set(range(len(turn.calls), total))
    errors, calls = iter(turn.errors), iter(turn.calls)
    return [next(errors) if k in where else next(calls) for k in range(total)]


# Calls past their time limit whose threads still run, across every ToolBox of the process (see ToolBox.run).
_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


def _still_abandoned() -> int:
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return len(_abandoned)


@dataclass
class _Job:
    slot: tuple[int, int]  # (episode, call attempt)
    tool: _Tool
    call: ToolCall
    chain: int = 0  # the chain (one episode's calls, or a single call) it belongs to
    thread: threading.Thread | None = None
    started: float = 0.0


class ToolBox:
    """Named tools, described to the model (``schemas``) and run for a batch of parsed turns (``run``).

    `tools`: functions (named by ``__name__``) or ``{name: function}``; sync or async (coroutine functions, or
    functions returning an awaitable). `timeout_s`: each call's limit, counted from its start. `max_chars`:
    longer output is cut, with a marker saying how much. `max_workers`: calls running at once (the rest wait
    for a free place, their limit not yet counting). `in_episode_order`: run one episode's calls one after
    another, in the order written (for stateful tools such as an environment's methods); episodes still run
    concurrently.
    """

    def __init__(
        self,
        tools: list[Callable] | dict[str, Callable],
        timeout_s: float = 10.0,
        max_chars: int = 4000,
        max_workers: int = 64,
        in_episode_order: bool = False,
    ) -> None:
        named = (
            tools.items() if isinstance(tools, dict) else [(getattr(fn, "__name__", ""), fn) for fn in tools]
        )
        self._tools: dict[str, _Tool] = {}
        for name, fn in named:
            if name in self._tools:
                raise ConfigError(
                    f"two tools are named {name!r}; give them distinct names (a dict of name: fn)."
                )
            self._tools[name] = _Tool(name, fn)
        if timeout_s <= 0 or max_chars <= 0 or max_workers <= 0:
            raise ConfigError(
                "ToolBox needs timeout_s > 0, max_chars > 0 and max_workers > 0; got "
                f"{timeout_s}, {max_chars}, {max_workers}."
            )
        self.timeout_s, self.max_chars, self.max_workers = timeout_s, max_chars, max_workers
        self.in_episode_order = in_episode_order
        self.names: list[str] = list(self._tools)
        self.schemas: list[dict] = [tool.schema for tool in self._tools.values()]

    def run(
        self, batch: list[ParsedTurn], episode_tools: list[ToolBox] | None = None
    ) -> list[list[ToolResult]]:
        """One list of results per turn, one result per call attempt, in the order the model wrote them.

        Every call of every episode runs concurrently, each in its own daemon thread. A thread cannot be
        killed: a call past `timeout_s` gets a "timeout" result at once and the batch goes on, while its
        thread runs on until the tool returns, and what it returns is dropped (a coroutine tool is cancelled
        at the limit instead). So that a tool that never returns cannot pile up threads: while `max_workers`
        such abandoned threads are alive in the process, further calls are not started and get a "timeout"
        result saying why. Daemon threads do not keep the process from exiting.

        `episode_tools[i]`, if given, answers episode i's calls (e.g. the bound methods of episode i's
        environment instance); this box's limits apply to all.
        """
        boxes = episode_tools or [self] * len(batch)
        if len(boxes) != len(batch):
            raise ValueError(
                f"episode_tools has {len(boxes)} boxes for {len(batch)} turns; give one per turn."
            )
        results: list[list[ToolResult | None]] = []
        chains: list[deque[_Job]] = []
        for i, (turn, box) in enumerate(zip(batch, boxes, strict=True)):
            slots = call_slots(turn)
            results.append([None] * len(slots))
            jobs: list[_Job] = []
            for j, item in enumerate(slots):
                if isinstance(item, str):
                    results[i][j] = ToolResult(None, item, "malformed")
                elif early := box._refuse(item):
                    results[i][j] = early
                else:
                    jobs.append(_Job((i, j), box._tools[item.name], item))
            chains += [deque(jobs)] if self.in_episode_order and jobs else [deque([job]) for job in jobs]
        for (i, j), result in self._execute(chains):
            results[i][j] = result
        return results  # type: ignore[return-value]  # every slot is filled above or by _execute

    def _refuse(self, call: ToolCall) -> ToolResult | None:
        """The result for a call that must not run (unknown tool, bad arguments), or None."""
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self.names) or "none"
            return ToolResult(call, f"unknown tool '{call.name}'; the tools are: {known}.", "unknown_tool")
        if problem := tool.argument_problem(call.arguments):
            text = f"bad arguments for {call.name}: {problem}; call it as {tool.signature()}."
            return ToolResult(call, text, "bad_arguments")
        return None

    def _execute(self, chains: list[deque[_Job]]) -> list[tuple[tuple[int, int], ToolResult]]:
        """Run the chains' jobs (a chain's jobs one after another, chains concurrently) within the limits."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        ready, running, out = deque(range(len(chains))), {}, []
        stop_seen: list[float | None] = [None]
        while ready or running:
            while ready and len(running) < self.max_workers:
                chain = ready.popleft()
                job = chains[chain][0]
                if _still_abandoned() >= self.max_workers:
                    out.append((job.slot, self._not_started(job.call)))
                    self._next(chains, chain, ready)
                    continue
                job.chain = chain
                self._start(job, done)
                running[chain] = job
            if not running:
                break
            deadline = min(job.started for job in running.values()) + self.timeout_s
            # A stop signal ends the wait within the grace, however long the calls' limit (the loop saves).
            stop_overdue(stop_seen, "a tool call")
            for job, value, ok, seconds in _answers(done, min(deadline, time.monotonic() + _STOP_POLL_S)):
                if running.get(job.chain) is job:  # else a late answer from a call that already timed out
                    out.append((job.slot, self._finish(job.call, value, ok, seconds)))
                    del running[job.chain]
                    self._next(chains, job.chain, ready)
            now = time.monotonic()
            for chain, job in list(running.items()):
                if now - job.started >= self.timeout_s:
                    with _abandoned_lock:
                        _abandoned.append(job.thread)
                    out.append((job.slot, self._timed_out(job.call, now - job.started)))
                    del running[chain]
                    self._next(chains, chain, ready)
        return out

    @staticmethod
    def _next(chains: list[deque[_Job]], chain: int, ready: deque[int]) -> None:
        chains[chain].popleft()
        if chains[chain]:
            ready.append(chain)

    def _start(self, job: _Job, done: queue.SimpleQueue) -> None:
        fn, arguments, limit = job.tool.fn, job.call.arguments, self.timeout_s

        def work() -> None:
            start = time.monotonic()
            try:
                value = fn(**arguments)
                if inspect.isawaitable(value):
                    # A little past the limit: the caller reports the timeout; this only frees the thread.
                    value = asyncio.run(asyncio.wait_for(_awaited(value), limit + 0.05))
                done.put((job, _as_text(value), True, time.monotonic() - start))
            except BaseException as err:  # noqa: BLE001 - whatever a tool raises (even SystemExit) is its result
                done.put((job, err, False, time.monotonic() - start))

        job.thread = threading.Thread(target=work, name=f"grpo-tool-{job.tool.name}", daemon=True)
        job.started = time.monotonic()
        job.thread.start()

    def _finish(self, call: ToolCall, value: Any, ok: bool, seconds: float) -> ToolResult:
        if ok:
            content, truncated = _truncate(value, self.max_chars)
            return ToolResult(call, content, None, truncated, seconds)
        if isinstance(value, TimeoutError) and seconds >= self.timeout_s:
            # A coroutine cancelled at the limit, whose answer came in before the sweep marked it.
            return self._timed_out(call, seconds)
        message, _ = _truncate(
            encodable(f"{call.name} raised {type(value).__name__}: {value}"), self.max_chars
        )
        return ToolResult(call, message, "raised", seconds=seconds)

    def _timed_out(self, call: ToolCall, seconds: float) -> ToolResult:
        text = f"{call.name} did not finish within {self.timeout_s:g} s; its result, if any, is lost."
        return ToolResult(call, text, "timeout", seconds=seconds)

    def _not_started(self, call: ToolCall) -> ToolResult:
        text = (
            f"{call.name} was not run: {self.max_workers} earlier tool calls are still running past their "
            f"{self.timeout_s:g} s limit."
        )
        return ToolResult(call, text, "timeout")


def _answers(done: queue.SimpleQueue, deadline: float) -> list[tuple]:
    """The answers that arrive by `deadline` (waiting for the first), with all others already there, so that a
    call that finished in time is never counted as timed out for waiting behind another's answer."""
    answers = []
    try:
        answers.append(done.get(timeout=max(0.0, deadline - time.monotonic())))
        while True:
            answers.append(done.get_nowait())
    except queue.Empty:
        return answers


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
