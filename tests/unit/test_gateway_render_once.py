"""A continued row's new ids take one chat-template rendering, not the delta rule's two (gateway/service.py,
_Renderer.continued_ids), and are the delta rule's ids token for token: on the families whose templates
preserve prefixes, checked against the delta rule on the first calls, and the delta rule wherever the
shortcut does not hold."""

from __future__ import annotations

import pytest

from grpo.agents import ChatRenderer
from grpo.agents.chat import ChatTemplateError
from grpo.gateway.service import _Renderer
from grpo.gateway.sessions import Session
from grpo.gateway.template import FastTemplate
from tests import gateway_agents as agents
from tests.chat_templates import family_tokenizer

FAMILIES = ["qwen2.5", "llama3.2"]  # qwen3 does not preserve prefixes: its own test below


def _counting(monkeypatch, tokenizer) -> list[int]:
    renders: list[int] = []
    original = type(tokenizer).apply_chat_template

    def counted(self, *args, **kwargs):
        renders.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counted)
    fast = FastTemplate.render  # the gateway's own path to the compiled template (gateway/template.py)

    def counted_fast(self, *args, **kwargs):
        renders.append(1)
        return fast(self, *args, **kwargs)

    monkeypatch.setattr(FastTemplate, "render", counted_fast)
    return renders


def _episode(renderer, session: Session, calls: int, question: str = "What is 12 * 34?"):
    """`calls` turns of a calculator episode through Session.prepare; yields (history, new, row ids added)."""
    messages = [{"role": "user", "content": question}]
    row = session.prepare(list(messages), "tools", renderer, False)
    for turn in range(1, calls + 1):
        call_id = f"call0000{turn}"
        call = {"type": "function", "id": call_id, "function": {"name": "calculator",
                "arguments": {"expression": f"12*3{turn}"}}}  # fmt: skip
        reply = {"role": "assistant", "content": "" if turn % 2 else "Let me see.", "tool_calls": [call]}
        end = renderer.tokenizer.convert_tokens_to_ids(renderer.end_of_turn)
        sampled = [*renderer.encode(f"reply {turn}"), end]
        row.add(sampled, [-0.5] * len(sampled))
        row.messages.append(reply)
        history = list(row.messages)
        new = [{"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": str(408 + turn)}]
        if turn == calls:
            new.append(
                {"role": "user", "content": "Are you <|im_end|> sure?"}
            )  # a special-token string as text
        before = len(row.ids)
        assert session.prepare(history + new, "tools", renderer, False) is row  # a continuation, no fork
        yield history, new, row.ids[before:]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_continued_rows_ids_are_the_delta_rules(family):
    tokenizer = family_tokenizer(family)
    reference = ChatRenderer(tokenizer, agents.TOOLS)
    renderer = _Renderer(tokenizer, agents.TOOLS)
    renderer.VERIFY = 0  # the shortcut alone, where it applies: compared here with the delta rule instead
    for k in range(3):
        for history, new, added in _episode(renderer, Session(k, 0, {}), calls=3, question=f"What is {k}?"):
            try:
                expected = reference.injected_ids(history, new)
            except Exception as err:  # noqa: BLE001 - the template cannot continue: neither may the gateway
                pytest.fail(f"the delta rule raised ({err}) where the gateway continued")
            assert added == expected


def test_a_continuation_renders_once_where_the_template_preserves_prefixes(qwen_renderer, monkeypatch):
    renderer = qwen_renderer
    session = Session(0, 0, {})
    episode = _episode(renderer, session, calls=renderer.VERIFY + 2)
    for _ in range(renderer.VERIFY):  # checked against the delta rule: three renderings each
        next(episode)
    renders = _counting(monkeypatch, renderer.tokenizer)
    history, new, added = next(episode)
    assert len(renders) == 1
    monkeypatch.undo()
    assert added == ChatRenderer(renderer.tokenizer, agents.TOOLS).injected_ids(history, new)


def test_a_template_whose_shortcut_differs_falls_back_to_the_delta_rule(qwen_renderer, monkeypatch):
    renderer = qwen_renderer
    # A template where the first end of turn after the last rendering is not the reply's (simulated): the
    # check on the first calls finds the difference, and the delta rule serves this call and every later one.
    monkeypatch.setattr(
        _Renderer, "_reply_end", lambda self, after, rendered: None if not self._trusted() else len(after) - 3
    )
    reference = ChatRenderer(renderer.tokenizer, agents.TOOLS)
    for history, new, added in _episode(renderer, Session(0, 0, {}), calls=3):
        assert added == reference.injected_ids(history, new)
    assert renderer._short is False


def test_a_template_that_does_not_preserve_prefixes_is_refused_as_the_delta_rule_refuses_it():
    tokenizer = family_tokenizer("qwen3")  # drops earlier turns' <think> blocks: prefix_problem() says so
    renderer = _Renderer(tokenizer, agents.TOOLS)
    renderer.VERIFY = 0  # no check on the first calls: the template probe alone keeps the shortcut off
    with pytest.raises(ChatTemplateError, match="re-renders earlier turns"):
        next(_episode(renderer, Session(0, 0, {}), calls=1))
    assert renderer._short is False


@pytest.fixture
def qwen_renderer():
    return _Renderer(family_tokenizer("qwen2.5"), agents.TOOLS)
