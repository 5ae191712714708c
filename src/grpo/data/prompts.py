"""Rows → token ids → PromptBatch: the chat template and prompt-length policy (`PromptFormatter`), the
seeded per-epoch order with its resumable state (`PromptStream`), and the batch record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from typing import Any

from grpo.config import ConfigError, DataConfig
from grpo.data.literal_text import LiteralText
from grpo.data.sources import row_numbers
from grpo.records import PromptBatch

log = logging.getLogger(__name__)


class PromptFormatter:
    """Prompt text → token ids: chat template when the tokenizer has one, plus the length policy."""

    def __init__(self, tokenizer: Any, cfg: DataConfig):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.templated = cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.truncated_count = 0
        # A prompt's or system prompt's special-token strings are text, never control tokens (agents/chat.py).
        self.literal = LiteralText(tokenizer)

    def text(self, prompt: str | list[dict[str, str]]) -> str:
        if (
            isinstance(prompt, str)
            and self.templated
            and (not self.cfg.chat_template_for_text or self._already_templated(prompt))
        ):
            return (
                prompt  # TRL sends plain-text prompts as they are; a templated one is never templated twice
            )
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not self.templated:
            return "\n".join(m["content"] for m in messages)
        if self.cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
        return self._render(messages)

    def _render(self, messages: list) -> str:
        """The chat template applied; a template that refuses the messages (an unknown role, a sandbox
        violation, raise_exception) is a ConfigError naming the roles and the template's words."""
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(
                self.literal.mask(messages),
                tokenize=False,
                add_generation_prompt=True,
                **(self.cfg.chat_template_kwargs or {}),
            )
        except jinja2.TemplateError as e:
            roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in messages]
            raise ConfigError(
                f"The tokenizer's chat template failed on a prompt with roles {roles}: {type(e).__name__}: "
                f"{str(e)[:300]}. Use the roles the template knows (usually system, user, assistant), or "
                "fix the template (tokenizer_config.json / chat_template.jinja); "
                "data.use_chat_template=false sends prompts without it."
            ) from None

    def messages(self, prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
        """A prompt as the conversation a multi-turn episode starts from (with data.system_prompt)."""
        if isinstance(prompt, str) and self.templated and self._already_templated(prompt):
            raise ConfigError(
                "Multi-turn episodes need prompts as text or messages, not text already rendered with the "
                "chat template: the template must render each turn (give the raw question or messages)."
            )
        messages = (
            [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        )
        if self.cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
        return messages

    def _already_templated(self, prompt: str) -> bool:
        """The text starts as the chat template starts a conversation (a dataset templated beforehand)."""
        if not hasattr(self, "_template_head"):
            marker = "\x00prompt\x00"
            messages = [{"role": "user", "content": marker}]
            rendered = self._render(messages)
            self._template_head = rendered.partition(marker)[0]
        return bool(self._template_head.strip()) and prompt.startswith(self._template_head)

    def ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of `text()` outputs. The chat template already places any BOS token (adding special
        tokens again would double it); the template's own special tokens are control tokens, the messages'
        special-token strings are text. Without a template the text is all the prompt's: bos/eos added, no
        special token read from it."""
        if self.templated:
            return self.literal.encode_many(texts)
        if any(self.literal.holds_special(t) for t in texts):
            return self.tokenizer(texts, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        return self.tokenizer(texts, add_special_tokens=True)["input_ids"]

    def encode(self, prompts: list, indices: list[int] | None = None) -> list[list[int]]:
        ids = self.ids([self.text(p) for p in prompts])
        limit = self.cfg.max_prompt_length
        too_long = [i for i, x in enumerate(ids) if len(x) > limit]
        if too_long and self.cfg.long_prompt_policy == "error":
            where = [indices[i] for i in too_long] if indices else too_long
            raise self._too_long(where, max(len(ids[i]) for i in too_long))
        if too_long:
            self.truncated_count += len(too_long)
            log.warning(
                "Left-truncated %d prompt(s) to %d tokens (%d so far).",
                len(too_long),
                limit,
                self.truncated_count,
            )
            ids = [x[-limit:] for x in ids]
        return ids

    def longest(self, rows: list[dict[str, Any]]) -> int:
        """The most tokens any row's prompt takes, formatted as the run sends it (every row tokenized)."""
        if not rows:
            return 0
        return max(len(ids) for ids in self.ids([self.text(r["prompt"]) for r in rows]))

    def check_lengths(self, rows: list[dict[str, Any]], margin: int = 8) -> None:
        """Measure every prompt before training, so an over-long one stops the run at start-up, not hours in.

        Rendering the chat template and tokenizing row by row is slow (seconds for 10k rows), so a first pass
        pastes each prompt into the template rendered once around a marker and skips rows with fewer UTF-8
        bytes than the limit (a token covers at least one byte); rows that tokenize to within `margin`
        tokens of the limit that way are then measured exactly."""
        limit = self.cfg.max_prompt_length
        prefix, marker, suffix = self.text("\x00prompt\x00").partition("\x00prompt\x00")
        fast = [
            prefix + r["prompt"] + suffix if isinstance(r["prompt"], str) and marker else None for r in rows
        ]
        unsure = [i for i, t in enumerate(fast) if t is None or len(t.encode()) + 2 > limit]  # +2: bos/eos
        # Bytes counted as written; tokenized as the run tokenizes them (special-token strings as text).
        mask = self.literal.mask if self.templated else str
        texts = [prefix + mask(rows[i]["prompt"]) + suffix if fast[i] is not None else "" for i in unsure]
        rough = self.ids(texts) if unsure else []
        lengths = {}
        near = [
            i for i, ids in zip(unsure, rough, strict=True) if fast[i] is None or len(ids) > limit - margin
        ]
        if near:
            exact = self.ids([self.text(rows[i]["prompt"]) for i in near])
            lengths = {i: len(ids) for i, ids in zip(near, exact, strict=True)}
        too_long = sorted(i for i, n in lengths.items() if n > limit)
        if too_long and self.cfg.long_prompt_policy == "error":
            raise self._too_long(too_long, max(lengths[i] for i in too_long))
        if too_long:
            log.warning(
                "%d of %d prompts are longer than data.max_prompt_length = %d tokens; they will be "
                "left-truncated (data.long_prompt_policy=truncate_left).",
                len(too_long),
                len(rows),
                self.cfg.max_prompt_length,
            )

    def _too_long(self, rows: list[int], longest: int) -> ConfigError:
        return ConfigError(
            f"{len(rows)} prompt(s) are longer than data.max_prompt_length = "
            f"{self.cfg.max_prompt_length} tokens (dataset rows {row_numbers(rows)}, counting from 0; "
            f"longest {longest}). Raise data.max_prompt_length or set "
            "data.long_prompt_policy=truncate_left."
        )


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    """What reward functions see as the prompt: the text itself, or the last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


class PromptStream:
    """Rows in seeded, per-epoch shuffled order; state is (epoch, position) so a resume continues
    mid-epoch exactly where it stopped. The last batch of an epoch may be smaller than P."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool = True):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)
        # Same count, different rows (an edited or reordered file) would silently change the order.
        self.fingerprint = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def steps_per_epoch(self, batch: int) -> int:
        return -(-len(self.rows) // batch)

    def next_rows(self, batch: int) -> tuple[list[int], list[dict[str, Any]]]:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        picked = self._order[self.position : self.position + batch]
        self.position += len(picked)
        return picked, [self.rows[i] for i in picked]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": len(self.rows),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue where the checkpoint stopped. A different dataset is an error, or with strict=False a
        warning, and the checkpoint's epoch starts over on the new rows."""
        self.epoch, self.position = state["epoch"], state["position"]
        if (
            state["num_rows"] != len(self.rows)
            or state.get("fingerprint", self.fingerprint) != self.fingerprint
        ):
            what = (
                f"{state['num_rows']} prompts, this dataset has {len(self.rows)}"
                if state["num_rows"] != len(self.rows)
                else "prompts that differ from this dataset's"
            )
            if strict:
                raise ConfigError(
                    f"The checkpoint was trained on {what}: resume with the same dataset (or set "
                    "train.allow_config_change=true to start the epoch over on this one)."
                )
            log.warning("The checkpoint was trained on %s; starting epoch %d over.", what, self.epoch)
            self.position = 0
        self._order = self._epoch_order(self.epoch)


def make_prompt_batch(
    indices: list[int], rows: list[dict[str, Any]], formatter: PromptFormatter, tokenize: bool = True
) -> PromptBatch:
    """The rows as a PromptBatch; tokenize=False leaves prompt_token_ids empty, for an episode runner that
    renders prompts itself (with the tools they declare)."""
    columns = {
        k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r) if k != "prompt"
    }
    return PromptBatch(
        prompts=[r["prompt"] for r in rows],  # as the dataset gave them: text or a list of messages
        prompt_token_ids=formatter.encode([r["prompt"] for r in rows], indices)
        if tokenize
        else [[] for _ in rows],
        columns=columns,
        indices=indices,
    )
