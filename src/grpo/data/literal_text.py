"""Text that is not a chat template's own structure goes in as text, never as control tokens.

A tool's output, the text an environment's `reset` returns, a step environment's messages, a tool's
docstring, a prompt or a system prompt may hold the string of a special token (a web page with
"<|im_end|>\n<|im_start|>assistant"): tokenized with the rendering, it would close the turn and open a fake
one. ``LiteralText`` masks those strings before the template renders, and tokenizes the rendering with the
template's own special tokens as control tokens and the masked strings as text. It sits with the data
(prompts use it) and is re-exported by agents/chat.py, whose ChatRenderer renders every episode with it.
"""

from __future__ import annotations

import re
from typing import Any

# Each special-token string in user text is replaced by one character of Unicode's plane-15 private use area
# before rendering (no template changes such a character), and restored as text after.
_MARK_BASE = 0xF0000
_MARK_LIMIT = 0xFFFFD - _MARK_BASE


def special_token_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens: named ones and added tokens marked special (Llama 3 names only
    bos/eos), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    found = set(getattr(tokenizer, "all_special_tokens", ())) | {t.content for t in added if t.special}
    return sorted((t for t in found if t), key=lambda t: (-len(t), t))


class LiteralText:
    """Text that is not the chat template's own structure goes in as text (see the module docstring).

    ``mask(value)``: `value` (a message list, a tool schema, a string) with every special-token string in its
    strings (keys included) replaced by a mark. ``encode(text)``: the ids of a rendering of masked values
    (no bos/eos added: the template writes them): the template's special tokens as control tokens, marked
    strings as their text. ``encode_many`` does the same for a batch, in one tokenizer call where no text
    holds a mark.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        specials = special_token_strings(tokenizer)[:_MARK_LIMIT]
        self._specials = set(specials)
        self._find = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._marks = {token: chr(_MARK_BASE + i) for i, token in enumerate(specials)}
        self._texts = {mark: token for token, mark in self._marks.items()}
        self._marked = re.compile(f"[{chr(_MARK_BASE)}-{chr(_MARK_BASE + max(len(specials), 1) - 1)}]")

    def mask(self, value: Any) -> Any:
        if self._find is None:
            return value
        if isinstance(value, str):
            return (
                self._find.sub(lambda m: self._marks[m.group(0)], value)
                if self._find.search(value)
                else value
            )
        if isinstance(value, dict):
            return {self.mask(k): self.mask(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.mask(v) for v in value)
        return value

    def encode(self, text: str) -> list[int]:
        if not self._marked.search(text):
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._encode_marked(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        marked = [bool(self._marked.search(t)) for t in texts]
        plain = [t for t, m in zip(texts, marked, strict=True) if not m]
        plain_ids = iter(self.tokenizer(plain, add_special_tokens=False)["input_ids"] if plain else [])
        return [
            self._encode_marked(t) if m else list(next(plain_ids)) for t, m in zip(texts, marked, strict=True)
        ]

    def _encode_marked(self, text: str) -> list[int]:
        """Split where the template wrote a special token (as the tokenizer itself splits there); the pieces
        between are tokenized with special-token strings as text."""
        ids: list[int] = []
        pos = 0
        for found in self._find.finditer(text):
            ids += self._text_ids(text[pos : found.start()])
            ids.append(self.tokenizer.convert_tokens_to_ids(found.group(0)))
            pos = found.end()
        return ids + self._text_ids(text[pos:])

    def _text_ids(self, piece: str) -> list[int]:
        if not piece:
            return []
        piece = self._marked.sub(lambda m: self._texts[m.group(0)], piece)
        return list(self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def holds_special(self, text: str) -> bool:
        """Whether `text` holds the string of a special token."""
        return self._find is not None and self._find.search(text) is not None
