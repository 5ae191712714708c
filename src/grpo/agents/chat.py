"""Token-exact multi-turn rendering: the ids injected between sampled turns come from the chat template.

An episode's token sequence is ``prompt_ids(messages)``, then what the policy sampled (ending with its
end-of-turn token), then ``injected_ids(history, new_messages)``, then the next sample, and so on. Sampled ids
are never decoded and re-encoded (a round trip can change them: the policy would be trained on tokens it did
not sample). The injected ids are the text the template adds for the new messages: render(history + new, with
the generation prompt) minus render(history), plus what the template writes after the assistant's end-of-turn
token (Qwen's "\\n" after <|im_end|>), tokenized on their own. That is exact because the sampled turn ends
with a special token, where every tokenizer splits.

Text never becomes control tokens. A tool's output, the text `reset` returns, a step environment's messages,
a tool's docstring, a prompt or a system prompt may hold the string of a special token (a web page with
"<|im_end|>\n<|im_start|>assistant"): tokenized with the rendering, it would close the turn and open a fake
one. ``LiteralText`` masks every special-token string inside the messages and tool schemas before the
template renders them, and tokenizes the rendering with the template's own special tokens as control tokens
and the masked strings as text (split, as ``split_special_tokens=True`` splits them). Where no text holds a
special-token string, the ids are exactly the plain tokenization. Every path that renders messages uses it
(``ChatRenderer``, the prompt formatter); the gateway's messages go through ``ChatRenderer`` or
``LiteralText.mask`` + ``LiteralText.encode`` in the same way.

It needs the template to be prefix-preserving: rendering a longer conversation must not change how the earlier
turns render. Qwen2.5 is; Qwen3 is not (it drops the <think> blocks of assistant turns before the last user
query, and the empty one of a last assistant turn once more messages follow). ``prefix_problem()`` finds out
at start-up.
"""

from __future__ import annotations

import re
from typing import Any

from grpo.config.errors import ConfigError

_PROBE_TEXT = "PROBE-7f3a"  # an assistant reply no template would write by itself


class ChatTemplateError(ConfigError):
    """The chat template cannot give token-exact multi-turn ids; the message says what changed and why."""


def _describe_change(before: str, after: str) -> str:
    """One phrase: where `after` stops extending `before`, and what the text became."""
    at = next(
        (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
        min(len(before), len(after)),
    )
    # A <think> block where the texts part (they may part inside the tag: "<think>" vs "<tool_call>").
    around = slice(max(0, at - len("<think>") + 1), at + len("<think>"))
    if "<think>" in before[around] and "<think>" not in after[around]:
        return "it drops the <think> blocks of earlier assistant turns"
    was, now = before[max(0, at - 20) : at + 40], after[max(0, at - 20) : at + 40]
    return f"at character {at} the earlier text {was!r} became {now!r}"


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


class ChatRenderer:
    """Renders conversations with the tokenizer's chat template, as token ids (see the module docstring).

    `tool_schemas` are transformers/OpenAI-style ``{"type": "function", "function": {...}}`` dicts
    (``ToolBox.schemas``); `template_kwargs` go to every render (``enable_thinking=False`` for Qwen3's
    no-thinking mode, a fixed ``date_string`` for Llama's templates).
    """

    def __init__(
        self, tokenizer: Any, tool_schemas: list[dict] | None = None, **template_kwargs: Any
    ) -> None:
        self.tokenizer = tokenizer
        self.literal = LiteralText(tokenizer)
        self.tools = self.literal.mask(list(tool_schemas)) if tool_schemas else None
        self.template_kwargs = template_kwargs
        self.end_of_turn, self.turn_tail = self._end_of_turn()

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text for `messages`, their special-token strings masked (``encode`` reads it)."""
        try:
            return self.tokenizer.apply_chat_template(
                self.literal.mask(messages),
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as err:  # templates raise anything: jinja errors, KeyError, ...
            roles = "/".join(dict.fromkeys(str(m.get("role")) for m in messages))
            raise ChatTemplateError(
                f"the chat template cannot render {roles} messages ({type(err).__name__}: {err})."
            ) from err

    def encode(self, text: str) -> list[int]:
        # The rendered text already holds the template's special tokens (bos included): add none.
        return self.literal.encode(text)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids the policy continues from: `messages` rendered with the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def injected_ids(self, history: list[dict], new_messages: list[dict]) -> list[int]:
        """The ids after the sampled end-of-turn token, up to and including the next generation prompt.

        `history` ends with the assistant message just sampled (with its ``tool_calls``, as the template
        expects them); `new_messages` are the tool or environment messages to inject.
        """
        before = self.render(history, add_generation_prompt=False)
        after = self.render(history + new_messages, add_generation_prompt=True)
        end = self.end_of_turn + self.turn_tail
        if not history or history[-1].get("role") != "assistant" or not before.endswith(end):
            raise ChatTemplateError(
                "the history must end with the assistant message just sampled, whose rendering ends with "
                f"the end-of-turn token {self.end_of_turn!r}; it ends with {before[-40:]!r}."
            )
        if not after.startswith(before):
            roles = ", ".join(sorted({str(m.get("role")) for m in new_messages}))
            raise ChatTemplateError(
                f"the chat template re-renders earlier turns when {roles} messages are added "
                f"({_describe_change(before, after)}), so injected tokens cannot be taken as a difference; "
                "check ChatRenderer.prefix_problem() at start-up and train each turn as its own sample."
            )
        return self.encode(self.turn_tail + after[len(before) :])

    def _end_of_turn(self) -> tuple[str, str]:
        """The end-of-turn token the template writes after an assistant message, and the text after it."""
        probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": _PROBE_TEXT}]
        text = self.render(probe, add_generation_prompt=False)
        if _PROBE_TEXT not in text:
            raise ChatTemplateError("the chat template does not render an assistant message's content.")
        after = text[text.rindex(_PROBE_TEXT) + len(_PROBE_TEXT) :]
        # The first special token after the content is what the policy samples to end its turn.
        special = special_token_strings(self.tokenizer)
        found = [(after.find(tok), tok) for tok in special if after.find(tok) >= 0]
        if not found:
            raise ChatTemplateError(
                "the chat template writes no special end-of-turn token after an assistant message (it "
                f"writes {after!r}), so a sampled turn has no token boundary to inject at; register it as a "
                "special token."
            )
        at, token = min(found, key=lambda f: (f[0], -len(f[1])))
        return token, after[at + len(token) :]

    def prefix_problem(self, opening: list[dict] | None = None) -> str | None:
        """None if the template is prefix-preserving across turns, else one sentence saying what changes.

        Probes a synthetic conversation (user, assistant with a tool call, tool, assistant, user, ...; user
        and assistant only without tools), with and without <think> reasoning in the assistant turns.
        `opening` replaces its first user message with a real prompt's messages (a system message can matter:
        Mistral's templates move it), so the probe sees what the run will render.
        """
        for thinking in (True, False):
            messages = self._probe_conversation(opening, thinking)
            try:
                if thinking and self._thinking_disabled(messages[:1]):
                    continue  # the generation prompt closes an empty <think> block: the policy writes none
                problem = self._first_break(messages)
            except ChatTemplateError as err:
                return str(err)
            if problem:
                return problem
        return None

    def _thinking_disabled(self, opening: list[dict]) -> bool:
        prompt = self.render(opening, add_generation_prompt=True)
        return "</think>" in prompt[len(self.render(opening, add_generation_prompt=False)) :]

    def _probe_conversation(self, opening: list[dict] | None, thinking: bool) -> list[dict]:
        def reply(text: str) -> str:
            return f"<think>\nI work it out.\n</think>\n\n{text}" if thinking else text

        def step(question: str, call_id: str, answer: str) -> list[dict]:
            turn = [{"role": "user", "content": question}]
            if self.tools:
                name = self.tools[0].get("function", self.tools[0]).get("name", "probe_tool")
                call = {"type": "function", "id": call_id, "function": {"name": name, "arguments": {}}}
                turn += [
                    {"role": "assistant", "content": reply(""), "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call_id, "name": name, "content": "408"},
                ]
            return [*turn, {"role": "assistant", "content": reply(answer)}]

        # Call ids of 9 characters: Mistral's templates refuse others.
        first = step("What is 12 * 34?", "call00001", "It is 408.")
        if opening:
            first = list(opening) + first[1:]
        return first + step("And 408 + 1?", "call00002", "It is 409.")

    def _first_break(self, messages: list[dict]) -> str | None:
        """Check every hand-off an episode makes; describe the first one whose earlier text changes."""
        last_assistant = None
        for k in range(1, len(messages)):
            if messages[k]["role"] == "assistant":
                # Sampling: the policy continues the generation prompt; the rendered turn must start with it.
                before = self.render(messages[:k], add_generation_prompt=True)
                after = self.render(messages[: k + 1], add_generation_prompt=False)
                what = "an assistant turn is rendered after the generation prompt"
                last_assistant = k
            elif last_assistant is not None and (
                k + 1 == len(messages) or messages[k + 1]["role"] == "assistant"
            ):
                # Injection: the messages after the last assistant turn, up to the next generation prompt.
                before = self.render(messages[: last_assistant + 1], add_generation_prompt=False)
                after = self.render(messages[: k + 1], add_generation_prompt=True)
                roles = "/".join(dict.fromkeys(m["role"] for m in messages[last_assistant + 1 : k + 1]))
                what = f"a {roles} message follows an assistant turn"
            else:
                continue
            if not after.startswith(before):
                change = _describe_change(before, after)
                return f"The chat template is not prefix-preserving: when {what}, {change}."
        return None
