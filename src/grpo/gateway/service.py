"""The gateway's one operation: a chat turn of a session (`Gateway.complete`), and the sessions it serves.

A turn: the request's messages become the ids to continue (sessions.Session.prepare), the batcher samples
them with the other live episodes' calls, the tokens stream back as text while they are sampled, and the
finished turn is parsed by the model family's tool-call parser (every turn: its calls come back as OpenAI
`tool_calls`). The run's sampling settings win: temperature and top-p are the run's (a request's other
values are said once in the log), a turn samples at most generation.max_new_tokens and the episode at most
env.max_tokens (sampled and injected); past that a request gets finish_reason "length" at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator

from grpo.agents.chat import ChatRenderer, ChatTemplateError
from grpo.agents.messages import call_id
from grpo.agents.parsing import ParsedTurn, ToolCallParser, parse_turn
from grpo.gateway.batching import Batcher, Job
from grpo.gateway.sessions import Session, SessionTable
from grpo.gateway.template import FastTemplate
from grpo.gateway.wire import ChatRequest, GatewayError, TextDelta, ToolCallDelta, TurnDone
from grpo.records import SamplingParams

log = logging.getLogger("grpo")

# Where a tool call may start, per parser: streamed content stops there (the call comes as tool_calls).
_CALL_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",)}


@dataclasses.dataclass
class Limits:
    max_tokens: int  # completion tokens per episode, sampled and injected (env.max_tokens)
    turn_tokens: int  # sampled tokens per turn (generation.max_new_tokens)
    max_prompt_tokens: int  # longest rendering a request may start a row from


class Gateway:
    def __init__(
        self,
        tokenizer,
        parser: ToolCallParser,
        limits: Limits,
        engine,
        sampling: SamplingParams,
        *,
        strict_history: bool = False,
        template_kwargs: dict | None = None,
        model_name: str = "grpo-policy",
        window_s: float = 0.2,
    ):
        self.tokenizer, self.parser, self.limits = tokenizer, parser, limits
        self.strict_history, self.model_name = strict_history, model_name
        self.template_kwargs = dict(template_kwargs or {})
        self.sessions = SessionTable()
        self.batcher = Batcher(engine, sampling, self.sessions.expected, window_s)
        self.special_ids = set(tokenizer.all_special_ids)
        self._renderers: dict[str, ChatRenderer] = {}
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def renderer(self, tools: list[dict] | None) -> tuple[str, ChatRenderer]:
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            if key not in self._renderers:
                self._renderers[key] = _Renderer(self.tokenizer, tools, **self.template_kwargs)
            return key, self._renderers[key]

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.info(message)

    def _overrides(self, req: ChatRequest) -> None:
        run = self.batcher.sampling
        if req.temperature is not None and req.temperature != run.temperature:
            self._say_once(
                "temperature",
                f"Gateway: requests ask for temperature {req.temperature}; the run samples at "
                f"{run.temperature} (training needs the group's own distribution).",
            )
        if req.top_p is not None and req.top_p != run.top_p:
            self._say_once(
                "top_p", f"Gateway: requests ask for top_p {req.top_p}; the run samples at {run.top_p}."
            )
        if req.seed is not None:
            self._say_once("seed", "Gateway: requests' seed is ignored (the run's seed drives sampling).")
        if req.tool_choice not in (None, "auto", "none"):
            self._say_once(
                "tool_choice",
                f"Gateway: requests set tool_choice {req.tool_choice!r}; the model is shown the tools and "
                "asked, not forced (no constrained decoding: the reply may not call a tool).",
            )
        if req.logprobs:
            self._say_once(
                "logprobs",
                "Gateway: requests ask for logprobs; replies carry each sampled token's log-prob under the "
                "distribution it was sampled from (the run's temperature and top-p), without alternatives.",
            )
        for key in req.ignored:
            said = "which the gateway does not act on (the policy's own decoding is what training needs)"
            self._say_once(key, f"Gateway: requests set {key}, {said}; replies come without it.")

    # -- one turn --------------------------------------------------------------------------------------------
    def complete(self, session: Session, req: ChatRequest) -> Iterator[TextDelta | ToolCallDelta | TurnDone]:
        """One chat turn of `session` (see the package docstring). Raises GatewayError before the first event
        when the request cannot be served."""
        job, row, cap = self._start(session, req)
        if job is None:
            yield TurnDone(
                {"role": "assistant", "content": ""}, "length", _usage(len(row.ids) if row else 0, 0)
            )
            return
        markers = _CALL_MARKERS.get(self.parser.name, ()) if req.calls else ()
        stream = _TextStream(self.tokenizer, self.special_ids, markers, calls=req.calls)
        sampled: list[int] = []
        event = None
        try:
            while (event := job.events.get())[0] == "token":
                if len(sampled) < cap:
                    sampled.append(event[1])
                    if text := stream.feed(sampled):
                        yield TextDelta(text)
        finally:
            if event is not None and event[0] == "token":  # the client left mid-stream: the turn counts
                while (event := job.events.get())[0] == "token":
                    pass
                if event[0] == "done":
                    self._finish(session, row, req, *event[1:], cap)
                else:
                    with session.lock:
                        row.busy = False
        if event[0] == "error":
            with session.lock:
                row.busy = False
            raise GatewayError(500, f"The engine failed: {event[1]}", "server_error")
        done = self._finish(session, row, req, *event[1:], cap)
        rest = done.message.get("content") or ""
        if rest.startswith(stream.sent):
            if rest[len(stream.sent) :]:
                yield TextDelta(rest[len(stream.sent) :])
        else:  # cannot happen with the known parsers (content is the text outside calls, stripped)
            log.warning("Gateway: a streamed reply's text was not a prefix of its content.")
        for k, call in enumerate(done.message.get("tool_calls") or []):
            yield ToolCallDelta(k, call["id"], call["function"]["name"], call["function"]["arguments"])
        yield done

    def _start(self, session: Session, req: ChatRequest):
        """Under the session's lock: the row to continue and its job submitted (None: the budget is spent)."""
        self._overrides(req)
        if req.tools and self.parser.name == "none":
            raise GatewayError(
                400,
                f"This run's model ({self.model_name}) has no tool-call format: its chat template declares "
                "none, so a reply could not be read for calls. Send no tools, or start the run with "
                "env.tool_parser=hermes|llama3_json|mistral (the format the model writes).",
                param="tools",
            )
        key, renderer = self.renderer(req.tools)
        # A final reply may wait for the next batch to start (batching.py) where the agents end after one;
        # never a streamed one (its client reads it as it is sampled).
        final = None if req.stream or not self.sessions.settling() else self._final if req.calls else _always
        with session.lock:
            if session.ended is not None:
                raise ended_error(session)
            if session.budget_used >= self.limits.max_tokens:
                session.last_finish, session.answered = "length", True
                return None, (session.rows[-1] if session.rows else None), 0
            try:
                row = session.prepare(req.messages, key, renderer, self.strict_history)
            except ChatTemplateError as err:
                raise GatewayError(
                    400, f"The model's chat template cannot render these messages: {err}"
                ) from None
            if row.prompt_len > self.limits.max_prompt_tokens:
                session.rows.remove(row)
                raise GatewayError(
                    400,
                    f"The conversation renders to {row.prompt_len} tokens, more than the "
                    f"{self.limits.max_prompt_tokens} a row may start from "
                    "(data.max_prompt_length + env.max_tokens).",
                    code="context_length_exceeded",
                    param="messages",
                )
            left = self.limits.max_tokens - session.budget_used
            if left <= 0:
                session.last_finish, session.answered = "length", True
                return None, row, 0
            cap = min(self.limits.turn_tokens, left, req.max_tokens or left)
            row.busy = True
            session.calls += 1
            session.recalls += session.answered
            job = Job(
                list(row.ids), cap, stream=req.stream, key=session.key, final=final, order=session.index
            )
        self.batcher.submit(job)
        return job, row, cap

    def _final(self, ids: list[int]) -> bool:
        """The sampled ids hold no tool call (what `_finish` would parse as a final reply); False where the
        format is unknown or a call may begin."""
        markers = _CALL_MARKERS.get(self.parser.name)
        if not markers:
            return False
        body = ids[:-1] if ids and ids[-1] in self.special_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        bare_json = self.parser.name == "llama3_json" and text.lstrip().startswith("{")
        return not bare_json and not any(m in text for m in markers)

    def _finish(self, session, row, req, ids, logprobs, truncated, version, cap) -> TurnDone:
        cut = min(len(ids), cap)
        length = cut < len(ids) or (truncated and cut == len(ids))
        new, lps = ids[:cut], logprobs[:cut]
        body = new[:-1] if new and new[-1] in self.special_ids else new
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        if (
            req.stop
        ):  # the request's own stop strings: the turn ends at the first (the run's stop in the engine)
            text, new, lps, stopped = self._cut_at_stop(text, new, lps, req.stop)
            length = length and not stopped
        # nothing a model writes raises (agents/parsing.py); tool_choice "none": the text is the reply
        parsed = parse_turn(self.parser, text) if req.calls else ParsedTurn(text.strip(), [], [])
        with session.lock:
            session.turns += 1
            turn = session.turns
            row.add(new, lps, version)
            stored, reply = _assistant(parsed, turn)
            row.messages.append(stored)
            row.mark_turn(turn, len(new))
            row.busy = False
            session.tool_calls += len(parsed.calls)
            finish = "length" if length else "tool_calls" if parsed.calls else "stop"
            session.last_finish, session.answered = finish, not parsed.calls
        tokens = None
        if req.logprobs:  # the reply's own tokens, like OpenAI's list: not the end-of-turn token
            own = len(new) - 1 if new and new[-1] in self.special_ids else len(new)
            tokens = self._token_logprobs(new[:own], lps[:own])
        return TurnDone(reply, finish, _usage(len(row.ids) - len(new), len(new)), tokens)

    def _token_logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict]:
        """OpenAI's `logprobs.content` of a reply: each sampled token with the log-prob it had under the
        distribution it was drawn from (the run's temperature and top-p: the policy being trained)."""
        out = []
        for token, logprob in zip(ids, logprobs, strict=True):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            out.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    def _cut_at_stop(self, text, new, lps, stops):
        at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if at < 0:
            return text, new, lps, False
        # Keep the sampled ids up to the token that completes the stop string (ids are never re-tokenized).
        for k in range(1, len(new) + 1):
            if len(self.tokenizer.decode(new[:k], skip_special_tokens=False)) >= at + 1:
                return text[:at], new[:k], lps[:k], True
        return text[:at], new, lps, True


class _Renderer(ChatRenderer):
    """The renderer of one tool set, keeping the ids of the conversations it rendered last: a group's
    episodes open with the same messages, so one rendering (the chat template and the tokenizer, most of a
    request's cost on the server) serves the whole group. The same messages and tools render to the same
    ids, so a kept rendering is exact.

    A continued row's new ids (`continued_ids`) take one rendering instead of the delta rule's two: the
    rendering before the new messages is the row's last one (its request's, with the generation prompt) and
    the reply that followed it, which ends at the first end-of-turn string after it (the reply's own text is
    masked: it holds no special-token string). Only for a template that preserves prefixes
    (`prefix_problem()`), and checked against the delta rule on the first VERIFY continuations: on any
    difference the delta rule serves every later call.

    Each rendering and tokenizing goes through `FastTemplate` (gateway/template.py: the compiled template and
    the Rust tokenizer without transformers' per-call Python); its first VERIFY renderings and encodings are
    also computed by transformers' calls, and on any difference those serve every later call."""

    KEEP = 256  # conversations: a step's distinct first requests, with room for evaluation's
    VERIFY = 8  # continuations computed both ways before the one-rendering path is trusted alone

    def __init__(self, *args, **kwargs):
        self._fast: FastTemplate | None = None  # set after ChatRenderer's own probes, which render
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)
        self._kept: OrderedDict[str, tuple[tuple[int, ...], str]] = OrderedDict()
        self._short: bool | None = None  # None: the template not probed yet
        self._checked = 0
        self._fast_checked = {"render": 0, "encode": 0}
        self._fast = FastTemplate.build(self.tokenizer, self.tools, self.template_kwargs)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        fast = self._fast
        if fast is None:
            return super().render(messages, add_generation_prompt)
        try:
            text = fast.render(self.literal.mask(messages), add_generation_prompt)
        except Exception:  # noqa: BLE001 - a template that raises: transformers' call says why (ChatTemplateError)
            text = None
        return self._checked_fast(
            "render", text, lambda: super(_Renderer, self).render(messages, add_generation_prompt)
        )

    def encode(self, text: str) -> list[int]:
        fast = self._fast
        # a rendering holding masked special-token strings is tokenized piecewise by LiteralText
        ids = fast.encode(text) if fast is not None and not self.literal._marked.search(text) else None
        if ids is None:
            return super().encode(text)
        return self._checked_fast("encode", ids, lambda: super(_Renderer, self).encode(text))

    def _checked_fast(self, kind: str, value, slow):
        """`value` (the fast path's; None: it failed), compared with `slow()` on the first VERIFY calls of
        `kind`; on a difference transformers' path serves every later call."""
        if value is None:
            return slow()
        with self._lock:
            check = self._fast_checked[kind] < self.VERIFY
            self._fast_checked[kind] += check
        if not check:
            return value
        expected = slow()
        if expected != value:
            self._fast = None
            log.info(
                "Gateway: the fast %s differs from transformers'; transformers' serves from now on.", kind
            )
        return expected

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.prompt(messages)[0]

    def prompt(self, messages: list[dict]) -> tuple[list[int], str]:
        """The ids of `messages` with the generation prompt, and the text they encode."""
        try:
            key = json.dumps(messages, sort_keys=True)
        except (TypeError, ValueError):  # not JSON (cannot come from the wire): render it
            key = None
        if key is not None:
            with self._lock:
                kept = self._kept.get(key)
                if kept is not None:
                    self._kept.move_to_end(key)
                    return list(kept[0]), kept[1]
        text = self.render(messages, add_generation_prompt=True)
        ids = self.encode(text)
        if key is not None:
            with self._lock:
                self._kept[key] = (tuple(ids), text)
                if len(self._kept) > self.KEEP:
                    self._kept.popitem(last=False)
        return ids, text

    def continued_ids(
        self, history: list[dict], new: list[dict], rendered: str | None
    ) -> tuple[list[int], str]:
        """`injected_ids(history, new)`, and the rendering of history + new with the generation prompt (the
        next call's `rendered`). `rendered`: the rendering of `history` less its last message (the reply)
        with the generation prompt, as this returned it or `prompt` gave it; None: not known."""
        after = self.render(history + new, add_generation_prompt=True)
        cut = self._reply_end(after, rendered)
        if cut is None:
            return self.injected_ids(history, new), after
        ids = self.encode(self.turn_tail + after[cut:])
        with self._lock:
            check = self._checked < self.VERIFY
            self._checked += check
        if check:
            full = self.injected_ids(history, new)
            if full != ids:
                self._short = False
                log.info(
                    "Gateway: the chat template's continuations need the full delta rule (two renderings)."
                )
                return full, after
        return ids, after

    def _reply_end(self, after: str, rendered: str | None) -> int | None:
        """Where the rendering of the history (up to the reply's end of turn) ends in `after`; None where the
        one-rendering path does not hold."""
        if rendered is None or not after.startswith(rendered) or not self._trusted():
            return None
        end = self.end_of_turn + self.turn_tail
        at = after.find(end, len(rendered))
        return None if at < 0 else at + len(end)

    def _trusted(self) -> bool:
        if self._short is None:
            try:
                self._short = self.prefix_problem() is None
            except Exception:  # noqa: BLE001 - a template the probe cannot render: the delta rule decides
                self._short = False
        return self._short


def _always(ids: list[int]) -> bool:
    del ids
    return True  # tool_choice "none": the reply is read for no calls


def ended_error(session: Session) -> GatewayError:
    return GatewayError(
        409,
        f"This episode's session has ended ({session.ended}); its calls are no longer served.",
        code="session_ended",
    )


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _assistant(parsed: ParsedTurn, turn: int) -> tuple[dict, dict]:
    """The assistant message as the session stores it (normalized, arguments a dict) and as the reply gives
    it (OpenAI's: arguments a JSON string, content None beside tool calls)."""
    stored: dict = {"role": "assistant", "content": parsed.content}
    reply: dict = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        ids = [call_id(turn, k) for k in range(len(parsed.calls))]
        stored["tool_calls"] = [
            {"type": "function", "id": i, "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in zip(ids, parsed.calls, strict=True)
        ]
        reply["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in zip(ids, parsed.calls, strict=True)
        ]
        reply["content"] = parsed.content or None
    return stored, reply


class _TextStream:
    """Content text as tokens arrive: what is safe to send before the turn is parsed. It stops where a tool
    call may begin, holds trailing whitespace and a partial character (the parsed content is stripped)."""

    def __init__(self, tokenizer, special_ids: set[int], markers: tuple[str, ...], calls: bool = True):
        self.tokenizer, self.special_ids, self.markers = tokenizer, special_ids, markers
        self.sent = ""
        self.stopped = calls and not markers  # an unknown format: nothing is safe before the parse

    def feed(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        body = ids[:-1] if ids[-1] in self.special_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False).lstrip()
        cut = len(text)
        for marker in self.markers:
            at = text.find(marker)
            if at >= 0:
                cut, self.stopped = min(cut, at), True
            else:  # a marker may be starting at the end
                for k in range(min(len(marker) - 1, len(text)), 0, -1):
                    if marker.startswith(text[-k:]):
                        cut = min(cut, len(text) - k)
                        break
        if self.tokenizer_name_json(text):
            cut, self.stopped = 0, True
        safe = text[:cut].rstrip().rstrip("\ufffd")
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        new, self.sent = safe[len(self.sent) :], safe
        return new

    def tokenizer_name_json(self, text: str) -> bool:
        # Llama 3 calls without <|python_tag|> are a bare JSON object: hold a reply that opens with "{".
        return "<|python_tag|>" in self.markers and text.startswith("{")
