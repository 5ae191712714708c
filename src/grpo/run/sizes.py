"""Sizes checked against the model and the machine before the model loads (issue 24, §5).

Two checks, each stopping with the numbers:
- context: the longest prompt plus the longest completion must fit the model's positions
  (`max_position_embeddings`); a model asked for positions it does not have trains on garbage silently.
  The caps (data.max_prompt_length + the completion limit) are compared first; when they exceed the
  context the prompts themselves are measured, so a generous cap over short prompts still runs.
  The completion limit is RunSettings.completion_limit: for a multi-turn run the whole episode's
  (env.max_tokens, else env.max_turns × max_new_tokens), not one turn's.
- memory: one step's records (ids, masks, log-probs, advantages: about BYTES_PER_POSITION per token
  position of every completion) and one generation batch's KV cache and logits must fit in the memory
  the machine has free now. This is a floor, not a forecast (activations come on top): it catches the
  absurd (1e8 completions a step), not the tight.
"""

from __future__ import annotations

import logging
from typing import Any

from grpo.config import ConfigError
from grpo.config.settings import RunSettings
from grpo.model.memory import available_bytes

log = logging.getLogger("grpo")

# int64 prompt+completion ids and attention mask, float32 completion mask, sampling, old and reference
# log-probs, per-token advantages: 2·8 + 5·4 = 36 bytes, rounded up for the copies a step makes.
BYTES_PER_POSITION = 48
_LENGTH_KEYS = frozenset(
    {
        "generation.max_new_tokens",
        "generation.max_total_length",
        "data.max_prompt_length",
        "env.max_turns",
        "env.max_tokens",
    }
)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context(model_config: Any) -> int | None:
    """The number of positions a model has, from its config (None when it does not say)."""
    for key in _CONTEXT_KEYS:
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _completion_words(settings: RunSettings) -> str:
    """The completion limit and where it comes from, for messages."""
    cfg, n = settings.config, settings.completion_limit
    cap = cfg.name_of("generation.max_new_tokens")  # max_completion_length in a TRL-style config
    if not settings.multi_turn:
        return f"{cap} ({n})"
    if cfg.env.max_tokens:
        return f"the episode's env.max_tokens ({n})"
    turns = f"{cfg.env.max_turns} × {settings.turn_limit} = {n}"
    return f"the episode's env.max_turns × {cap} ({turns})"


def _shorter_completions(settings: RunSettings, room: int) -> str:
    """How to bring the completion limit down to `room` tokens."""
    cfg = settings.config
    cap = cfg.name_of("generation.max_new_tokens")
    if not settings.multi_turn:
        return f"Lower {cap} to {room} or less"
    fewer = f"env.max_turns × {cap} (now {cfg.env.max_turns} × {settings.turn_limit})"
    return (
        f"Set env.max_tokens to {room} or less (an episode's sampled and injected tokens), or lower {fewer}"
    )


def check_context(settings: RunSettings, model_config: Any, longest_prompt: callable) -> dict[str, int]:
    """Raise when prompt + completion can exceed the model's positions. `longest_prompt()` measures the
    data (called only when the caps alone do not fit). Returns the start-up decisions it makes: an episode
    budget that only the defaults made too long is fitted to the model ({"env.max_tokens": n}), else {}."""
    context = model_context(model_config)
    if context is None:
        return {}
    cfg, completion = settings.config, settings.completion_limit
    if cfg.data.max_prompt_length + completion <= context:
        return {}
    longest = min(longest_prompt(), cfg.data.max_prompt_length)
    if longest + completion <= context:
        log.info(
            "data.max_prompt_length (%d) + %s exceed the model's %d positions, but the longest prompt has %d "
            "tokens, so every completion fits.",
            cfg.data.max_prompt_length,
            _completion_words(settings),
            context,
            longest,
        )
        return {}
    untouched = not (cfg.explicit_keys & _LENGTH_KEYS)
    if longest < context and untouched and settings.multi_turn:
        # Only the defaults overflow: an agent, tools or an environment on a preset whose per-turn cap × turn
        # cap was sized for single turns (`grpo train --agent m:run` on the default tiny model). The episode
        # budget is fitted to the model instead of refusing a run that set nothing: an episode that reaches
        # it ends with finish "length", as at any env.max_tokens.
        room = context - longest
        log.warning(
            "%s after the longest prompt (%d tokens) would need %d positions, but the model has %d "
            "(max_position_embeddings): env.max_tokens is set to %d so every episode fits. Set "
            "env.max_tokens (or env.max_turns, generation.max_new_tokens) to choose another budget.",
            _completion_words(settings)[0].upper() + _completion_words(settings)[1:],
            longest,
            longest + completion,
            context,
            room,
        )
        return {"env.max_tokens": room}
    if longest < context and untouched and not settings.multi_turn:
        # Only the defaults overflow (the seed's max_new_tokens=256 on a 256-position model): say so, as a
        # run that set none of these could not know; a completion that reaches the cap is the rare case.
        log.warning(
            "The longest prompt (%d tokens) plus the default generation.max_new_tokens (%d) is %d positions, "
            "more than the model's %d (max_position_embeddings): a completion that long would run past the "
            "positions the model was trained on. Set generation.max_new_tokens to %d or less.",
            longest,
            completion,
            longest + completion,
            context,
            context - longest,
        )
        return {}
    prompt_room = context - completion
    shorter_prompts = (
        f", or data.max_prompt_length (now {cfg.data.max_prompt_length}) to {prompt_room} with "
        "data.long_prompt_policy=truncate_left (keeps the end of longer prompts)"
        if prompt_room > 0
        else ""
    )
    raise ConfigError(
        f"The longest prompt ({longest} tokens) plus {_completion_words(settings)} is "
        f"{longest + completion} positions, but the model has {context} (max_position_embeddings). "
        f"{_shorter_completions(settings, max(context - longest, 1))}{shorter_prompts}, or use a model "
        "with a longer context."
    )


def step_bytes(settings: RunSettings, model_config: Any, dtype_bytes: int) -> tuple[int, int]:
    """(bytes of one step's records, bytes of one generation batch's KV cache and logits)."""
    cfg = settings.config
    n = cfg.completions_per_step
    positions = cfg.data.max_prompt_length + settings.completion_limit
    records = n * positions * BYTES_PER_POSITION
    layers = getattr(model_config, "num_hidden_layers", 0) or 0
    heads = getattr(model_config, "num_attention_heads", 0) or 0
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    hidden = getattr(model_config, "hidden_size", 0) or 0
    head_dim = getattr(model_config, "head_dim", None) or (hidden // heads if heads else 0)
    vocab = getattr(model_config, "vocab_size", 0) or 0
    batch = min(cfg.generation.batch_size or n, n)
    kv_cache = batch * positions * layers * 2 * kv_heads * head_dim * dtype_bytes
    logits = batch * vocab * 4  # float32 sampling distribution
    return records, kv_cache + logits


def check_memory(
    settings: RunSettings, model_config: Any, dtype_bytes: int, device_memory: int | None = None
) -> None:
    """Raise when one step's records (host memory) plus one generation batch (host memory, or the GPU's
    `device_memory` when the model runs on one) cannot fit."""
    free = available_bytes()
    if free is None:
        return
    cfg = settings.config
    records, generation = step_bytes(settings, model_config, dtype_bytes)
    on_host = records + (generation if device_memory is None else 0)
    if on_host <= free and (device_memory is None or generation <= device_memory):
        return
    where = (
        "is free"
        if device_memory is None
        else f"is free on the host and {device_memory / (1 << 30):,.1f} GiB on the GPU"
    )
    gib, n = 1 << 30, cfg.completions_per_step
    batch = min(cfg.generation.batch_size or n, n)
    raise ConfigError(
        f"One step of train.prompts_per_step × generation.num_generations = {cfg.train.prompts_per_step} × "
        f"{cfg.generation.num_generations} = {n:,} completions of up to {cfg.data.max_prompt_length} + "
        f"{settings.completion_limit} tokens needs at least {records / gib:,.1f} GiB for its records and "
        f"{generation / gib:,.1f} GiB to generate (KV cache and logits of {batch:,} completions at once), "
        f"before any activation; {free / gib:,.1f} GiB {where}. Lower "
        "train.prompts_per_step or generation.num_generations (or generation.batch_size, which generates "
        "in smaller batches)."
    )
