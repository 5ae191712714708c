"""One episode's session: its key, its token rows, and how a request becomes the ids to sample from.

Token in, token out. A request whose messages extend the row's conversation (its earlier messages as sent,
the assistant turns exactly as the gateway returned them, then only new non-assistant messages) continues
that row: the sampled ids stay as sampled, and the new messages' ids are the chat template's difference
(ChatRenderer.injected_ids, loss_mask 0), as the in-process episodes do. Any other request (the agent
rewrote, truncated or summarised its history, or changed its tools) starts a new row of the same episode
from the template's rendering of its messages: a fork. The rows share the episode's reward. With
`strict_history` a fork ends the episode instead.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading

from grpo.agents.chat import ChatRenderer
from grpo.gateway.wire import GatewayError


@dataclasses.dataclass
class Row:
    """One token row of an episode: the prompt its first request rendered to, then turns and injections."""

    prompt_len: int
    ids: list[int]
    sampled: list[float]  # per id: 1 sampled by the policy, 0 prompt or injected
    logprobs: list[float]  # per id: the sampler's log-prob (0 where not sampled)
    messages: list[dict]  # the conversation as it stands (normalized), ending with the last reply
    tools_key: str
    first_messages: int  # how many messages the row's first request had (its prompt)
    # (start, end, turn): the ids[start:end] that the episode's assistant turn `turn` (1 = its first) sampled
    turn_spans: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    busy: bool = False  # a turn is being sampled from it: a concurrent request starts a row of its own
    # per id: the weight version that sampled it (-1: not sampled, or the engine does not say); a Ray
    # rollout actor's weights may change between two turns of one row (rollout/weight_versions.py)
    versions: list[int] = dataclasses.field(default_factory=list)
    # the rendering (text) of the row's last request with the generation prompt, where the renderer gives it:
    # the next continuation renders once instead of twice (gateway/service.py, _Renderer.continued_ids)
    rendered: str | None = None

    def add(self, ids: list[int], logprobs: list[float] | None, version: int | None = None) -> None:
        self.ids += ids
        self.sampled += [1.0 if logprobs is not None else 0.0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        stamp = -1 if logprobs is None or version is None else version
        self.versions += [stamp] * len(ids)

    def versions_from(self, start: int) -> list[int]:
        """The versions of ids[start:] (the prompt's ids were never sampled: -1)."""
        own = [-1] * (
            len(self.ids) - len(self.versions)
        ) + self.versions  # the prompt came in by the constructor
        return own[start:]

    @property
    def completion_tokens(self) -> int:
        return len(self.ids) - self.prompt_len

    def mark_turn(self, turn: int, sampled: int) -> None:
        """The last `sampled` ids are the episode's assistant turn `turn` (per-turn rewards credit them)."""
        self.turn_spans.append((len(self.ids) - sampled, len(self.ids), turn))

    def turns_from(self, start: int) -> list[int]:
        """Per id of ids[start:]: the turn that sampled it, 0 for prompt and injected ids."""
        turns = [0] * len(self.ids)
        for begin, end, turn in self.turn_spans:
            turns[begin:end] = [turn] * (end - begin)
        return turns[start:]


@dataclasses.dataclass
class Session:
    """One episode: group `group` of the step, dataset row `row`."""

    index: int
    group: int
    row: dict
    key: str = dataclasses.field(default_factory=lambda: "sk-grpo-" + secrets.token_urlsafe(24))
    rows: list[Row] = dataclasses.field(default_factory=list)
    ended: str | None = None  # why it ended, once it has
    calls: int = 0  # model calls answered
    turns: int = 0  # assistant turns sampled
    tool_calls: int = 0  # tool calls returned to the agent
    forks: int = 0
    drift_tokens: int = 0  # prompt tokens of forked rows that differ from the row they left
    bad_requests: int = 0
    reward: float | None = None  # posted to /v1/reward, or returned by the agent
    turn_rewards: dict[int, float] = dataclasses.field(default_factory=dict)
    last_finish: str | None = None
    answered: bool = False  # its last reply was final: no tool calls in it
    recalls: int = 0  # calls made after a final reply: the agent went on after an answer
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why

    @property
    def budget_used(self) -> int:
        return sum(r.completion_tokens for r in self.rows)

    def prepare(self, messages: list[dict], tools_key: str, renderer: ChatRenderer, strict: bool) -> Row:
        """The row this request samples from, with the request's new messages' ids appended (see the module
        docstring). Raises GatewayError (409) for a fork under strict history."""
        cur = self.rows[-1] if self.rows else None
        if cur is not None and _extends(cur, messages, tools_key):
            new = messages[len(cur.messages) :]
            ids = []
            end = renderer.tokenizer.convert_tokens_to_ids(renderer.end_of_turn)
            if cur.ids[-1] != end:  # the turn stopped on a stop string or a cap: the template closes it
                ids.append(end)
            if hasattr(renderer, "continued_ids"):
                more, cur.rendered = renderer.continued_ids(cur.messages, new, cur.rendered)
            else:
                more = renderer.injected_ids(cur.messages, new)
            cur.add([*ids, *more], None)
            cur.messages = list(messages)
            return cur
        prompt, rendered = renderer.prompt(messages) if hasattr(renderer, "prompt") else (None, None)
        prompt = renderer.prompt_ids(messages) if prompt is None else prompt
        if cur is not None:
            self.forks += 1
            if strict:
                self.end("history")
                raise GatewayError(
                    409,
                    "This request does not extend the episode's conversation (its earlier messages or the "
                    "assistant turns as returned were changed), and env.strict_history is true: the episode "
                    "has ended.",
                    code="history_rewritten",
                )
            same = next((k for k, (a, b) in enumerate(zip(prompt, cur.ids, strict=False)) if a != b), None)
            self.drift_tokens += len(prompt) - (min(len(prompt), len(cur.ids)) if same is None else same)
        zeros = [0.0] * len(prompt)
        row = Row(len(prompt), list(prompt), zeros, list(zeros), list(messages), tools_key, len(messages))
        row.rendered = rendered
        self.rows.append(row)
        return row


def _extends(row: Row, messages: list[dict], tools_key: str) -> bool:
    n = len(row.messages)
    return (
        not row.busy
        and tools_key == row.tools_key
        and len(messages) > n
        and messages[:n] == row.messages
        and all(m["role"] != "assistant" for m in messages[n:])
    )


class SessionTable:
    """The live sessions by key; a key not in it is refused (401), an ended session's call gets 409."""

    def __init__(self) -> None:
        self._by_key: dict[str, Session] = {}
        self._lock = threading.Lock()
        # Of the sessions removed last (the step before): final replies their agents took as the end, and
        # calls made after a final reply. They tell whether a final reply ends its episode (`settling`); the
        # last step's only, so an agent that changes its ways is followed within a step.
        self._quiet_finals = self._recalls = 0

    def add(self, session: Session) -> Session:
        with self._lock:
            self._by_key[session.key] = session
        return session

    def get(self, key: str) -> Session | None:
        with self._lock:
            return self._by_key.get(key)

    def remove(self, sessions: list[Session]) -> None:
        with self._lock:
            gone = [s for s in sessions if self._by_key.pop(s.key, None) is not None]
            if gone:
                self._recalls = sum(s.recalls for s in gone)
                self._quiet_finals = sum(s.ended is not None and s.answered for s in gone)

    def live(self) -> tuple[int, int]:
        """Sessions not ended, and how many of them have not called the model yet."""
        with self._lock:
            live = [s for s in self._by_key.values() if s.ended is None]
            return len(live), sum(s.calls == 0 for s in live)

    def settling(self) -> bool:
        """Whether the run's agents end after a final reply: seen on at least 8 episodes of the step before,
        with at most one call after a final reply in 8 (this step's included)."""
        with self._lock:
            recalls = self._recalls + sum(s.recalls for s in self._by_key.values())
            return self._quiet_finals >= 8 and recalls * 8 <= self._quiet_finals

    def expected(self) -> tuple[int, int]:
        """(sessions whose next call a batch waits for, sessions yet to call): the live ones, less those whose
        last reply was final and that are not calling, when the run's agents end after a final reply."""
        settling = self.settling()
        with self._lock:
            live = [s for s in self._by_key.values() if s.ended is None]
            fresh = sum(s.calls == 0 for s in live)
            if settling:
                live = [s for s in live if not (s.answered and not any(r.busy for r in s.rows))]
            return len(live), fresh
