"""The chat template and the tokenizer on a gateway call's path, without transformers' per-call Python.

Most of the server's CPU per call (issue 31 §2) went to `apply_chat_template` (its deep copies and checks of
the messages, tools and special tokens around the template's own rendering) and to the tokenizer's `__call__`
(argument handling and BatchEncoding around the Rust encode). `FastTemplate` does what those do for the
gateway's inputs, which are plain JSON (parsed from a request, or the session's own stored messages):

- `render`: the compiled template (transformers' own compiler and cache, the same sandboxed environment)
  with the tools and the special-token variables converted once per renderer, not per call; each message
  has its None-valued keys dropped and reasoning fields aliased, as `apply_chat_template` does.
- `encode`: the fast tokenizer's Rust backend (`backend_tokenizer.encode`), where transformers' call would
  reach the same backend with the same settings (no special tokens added, special-token strings not split,
  no truncation or padding set).

Neither is trusted alone: the gateway's renderer (service.py, `_Renderer`) computes its first VERIFY calls
both ways and uses transformers' path for good on any difference; anything missing here (a slow tokenizer,
a transformers without these internals, a template that raises) is served by transformers' path too.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("grpo")


class FastTemplate:
    """The rendering and tokenizing of one tool set (see the module docstring). Built by `build`, which
    answers None where a part it needs is not there."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None, template_kwargs: dict[str, Any]) -> None:
        from transformers.utils import chat_template_utils as ctu

        self.tokenizer = tokenizer
        self._compiled = ctu._compile_jinja_template(tokenizer.get_chat_template(None, tools))
        self._alias = ctu._alias_reasoning_fields
        plain = ctu._plain_template_data
        self._tools = plain(tools) if tools is not None else None
        # as apply_chat_template passes them: the special tokens, then the caller's template arguments
        self._kwargs = plain({**tokenizer.special_tokens_map, **template_kwargs})
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    @classmethod
    def build(cls, tokenizer: Any, tools: list[dict] | None, template_kwargs: dict[str, Any]):
        try:
            return cls(tokenizer, tools, template_kwargs)
        except Exception as err:  # noqa: BLE001 - no template, another transformers: its own path serves
            log.debug("Gateway: chat templates render through apply_chat_template (%s).", err)
            return None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """`messages` (already masked: LiteralText) rendered as apply_chat_template(tokenize=False) renders
        them. The template runs in transformers' immutable sandbox, so the messages are not copied for it."""
        chat = self._alias([{k: v for k, v in m.items() if v is not None} for m in messages])
        return self._compiled.render(
            messages=chat,
            tools=self._tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._kwargs,
        )

    def encode(self, text: str) -> list[int] | None:
        """The ids `tokenizer(text, add_special_tokens=False)` gives, from the Rust backend; None where that
        call would set the backend up differently (then it is the one to make)."""
        backend = self._backend
        if (
            backend is None
            or backend.truncation is not None
            or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(self.tokenizer, "split_special_tokens", False))
        ):
            return None
        return backend.encode(text, add_special_tokens=False).ids
