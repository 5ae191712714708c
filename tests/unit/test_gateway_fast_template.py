"""The gateway's chat template and tokenizer without transformers' per-call Python (gateway/template.py) give
what apply_chat_template and the tokenizer's call give, character for character and id for id: over the
bundled models' tokenizers and every chat-template family the tests carry, on odd conversations (special-
token strings as text, unicode, empty content, None fields, tool calls, reasoning); and the gateway's
renderer falls back to transformers' path for good where the fast one differs."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from grpo.agents import ChatRenderer
from grpo.config import BUNDLED_MODELS
from grpo.gateway.service import _Renderer
from grpo.gateway.template import FastTemplate
from grpo.model.loading import resolve_path
from tests import gateway_agents as agents
from tests.chat_templates import FAMILIES, family_tokenizer

CALL = {"type": "function", "id": "call00001", "function": {"name": "calculator",
        "arguments": {"expression": "12*34"}}}  # fmt: skip
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 * 34?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo → 世界 🙂 \u200b\ttab"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "Are you <|im_end|> sure? <|eot_id|></s>[INST]", "name": None}],
    [
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "name": "calculator", "content": "408"},
    ],
    [
        {"role": "user", "content": "  leading and trailing  \n\n"},
        {"role": "assistant", "content": "Thinking done.", "reasoning_content": "12*34 = 408"},
        {"role": "user", "content": "again"},
    ],
]
TEXTS = [
    "",
    " ",
    "hello world",
    "héllo → 世界 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a\n\n\nb  c\t",
    "12*34=408",
]


def _tokenizers():
    out = [(name, AutoTokenizer.from_pretrained(resolve_path(name))) for name in sorted(BUNDLED_MODELS)]
    return out + [(family, family_tokenizer(family)) for family in FAMILIES]


@pytest.fixture(scope="module")
def tokenizers():
    return _tokenizers()


@pytest.mark.parametrize("tools", [None, agents.TOOLS], ids=["no-tools", "tools"])
def test_the_fast_rendering_is_apply_chat_templates(tokenizers, tools):
    for name, tokenizer in tokenizers:
        reference = ChatRenderer(tokenizer, tools)
        fast = FastTemplate.build(tokenizer, reference.tools, reference.template_kwargs)
        assert fast is not None, name
        for messages in CONVERSATIONS:
            for prompt in (True, False):
                try:
                    expected = reference.render(messages, add_generation_prompt=prompt)
                except Exception:  # noqa: BLE001 - a template that refuses this conversation refuses it fast too
                    with pytest.raises(Exception):  # noqa: B017
                        fast.render(reference.literal.mask(messages), prompt)
                    continue
                assert fast.render(reference.literal.mask(messages), prompt) == expected, (name, messages)


def test_the_fast_encoding_is_the_tokenizers(tokenizers):
    for name, tokenizer in tokenizers:
        fast = FastTemplate.build(tokenizer, None, {})
        renderer = ChatRenderer(tokenizer)
        texts = TEXTS + [renderer.render(m, add_generation_prompt=True) for m in CONVERSATIONS[:3]]
        for text in texts:
            assert fast.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"], (name, text)


def test_the_fast_encoding_steps_aside_where_the_backend_is_set_up_otherwise(tokenizers):
    tokenizer = family_tokenizer("qwen2.5")
    fast = FastTemplate.build(tokenizer, None, {})
    tokenizer(
        "<|im_end|>", add_special_tokens=False, split_special_tokens=True
    )  # leaves the backend splitting
    assert fast.encode("<|im_end|>") is None  # transformers' call sets it back: it makes this one
    tokenizer("x", add_special_tokens=False)
    assert fast.encode("<|im_end|>") == tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]


def test_the_gateways_renderer_uses_the_fast_path_and_checks_it_first(monkeypatch):
    renderer = _Renderer(family_tokenizer("qwen2.5"), agents.TOOLS)
    assert renderer._fast is not None
    slow = []
    original = ChatRenderer.render

    def counted(self, *args, **kwargs):
        slow.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChatRenderer, "render", counted)
    for k in range(renderer.VERIFY + 3):
        renderer.prompt([{"role": "user", "content": f"What is {k} * 7?"}])
    assert len(slow) == renderer.VERIFY  # the first calls both ways, then the fast path alone
    assert renderer._fast is not None


def test_a_fast_path_that_differs_is_dropped_for_transformers(monkeypatch):
    renderer = _Renderer(family_tokenizer("qwen2.5"), agents.TOOLS)
    reference = ChatRenderer(renderer.tokenizer, agents.TOOLS)
    monkeypatch.setattr(FastTemplate, "render", lambda self, messages, add_generation_prompt: "wrong")
    messages = [{"role": "user", "content": "What is 3 * 7?"}]
    assert renderer.prompt(messages)[1] == reference.render(messages, add_generation_prompt=True)
    assert renderer._fast is None
    messages = [{"role": "user", "content": "What is 4 * 7?"}]
    assert renderer.prompt(messages)[0] == reference.prompt_ids(messages)
