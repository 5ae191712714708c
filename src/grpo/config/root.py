"""The tree of sections behind `GRPOConfig`: key access by any alias, origins, YAML, derived sizes.

`ConfigTree` holds what every reader of a config needs and imports nothing that reads a config back:
`config/validate.py` and the checks type against it, while `config/tree.py` builds `GRPOConfig` on it (the
seeds' and TRL's keyword arguments, user precedence, `validate()`), so the two no longer import each other.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Self

import yaml

from grpo.config.errors import ConfigError
from grpo.config.keys import TORCHRL_ENV_ALIASES, coerce, normalise_key, resolve_key
from grpo.config.schema import (
    SECTIONS,
    AlgorithmConfig,
    DataConfig,
    DistributedConfig,
    EnvConfig,
    GenerationConfig,
    LoraSettings,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from grpo.redact import REDACTED, is_secret, remember
from grpo.redact import redact as redact_text

log = logging.getLogger("grpo")


@dataclass(init=False)
class ConfigTree:
    """The eight sections with their defaults, and what a reader does with them. Built by `GRPOConfig`."""

    model: ModelConfig
    data: DataConfig
    generation: GenerationConfig
    algorithm: AlgorithmConfig
    optim: OptimConfig
    train: TrainConfig
    distributed: DistributedConfig
    lora: LoraSettings
    env: EnvConfig

    def __init__(self) -> None:
        for section, cls in SECTIONS.items():
            object.__setattr__(self, section, cls())
        object.__setattr__(self, "_explicit", set())  # dotted paths the user set (not a preset or default)
        object.__setattr__(self, "_origins", {})  # dotted path -> where its value came from

    def update(
        self,
        overrides: Mapping[str, Any] | Iterable[tuple[str, Any]],
        explicit: bool = True,
        origin: str = "the settings given",
    ) -> Self:
        """Apply one layer of settings (a preset, a file, the command line: docs say their order), recording
        each one's `origin`. `explicit=False` marks them as a preset's or file's, which a value the user
        gives for a competing key replaces (see `apply_user_precedence`).

        One layer sets each setting once: two keys for the same field (`kl_coef` and `algorithm.beta`,
        `optimizer.lr=` and `--learning-rate`) are an error naming both, whatever their order. The one
        exception is documented: a key for one field refines an alias for several (`epsilon=0.2
        epsilon_high=0.28`)."""
        pairs = overrides.items() if isinstance(overrides, Mapping) else overrides
        given: dict[str, tuple[str, bool]] = {}  # path -> (the key that set it, whether it names several)
        for key, value in pairs:
            paths = resolve_key(key)
            broad = len(paths) > 1
            if normalise_key(key) in TORCHRL_ENV_ALIASES:
                log.info(
                    "Config: %s is TorchRL's name for %s (this package's env.* settings are the agent "
                    "environment's: env.tools, env.environment, env.max_turns, ...).",
                    key,
                    paths[0],
                )
            for path in paths:
                if path in given:
                    first, first_broad = given[path]
                    if broad and not first_broad:
                        continue  # the key naming this field alone wins over an alias naming several
                    if broad == first_broad:
                        raise ConfigError(
                            f"{path} is set twice in {origin}: by '{first}' and by '{key}'. Give it once "
                            "(settings apply in order: defaults, the preset or --config file, then the "
                            "command line; within one of them, each setting once)."
                        )
                section, name = path.split(".")
                setattr(getattr(self, section), name, coerce(path, value))
                given[path] = (str(key), broad)
                self._origins[path] = f"{origin} ({key})" if str(key) != path else origin
                if explicit:
                    self._explicit.add(path)
                if is_secret(name):
                    remember([value])
        return self

    def origin_of(self, path: str) -> str:
        """Where a setting's value came from: 'the command line (lr)', 'config file c.yaml', 'default'."""
        return self._origins.get(path, "default")

    @property
    def explicit_keys(self) -> frozenset[str]:
        """Dotted paths set by the user (keyword arguments, command-line overrides, assignments)."""
        return frozenset(self._explicit)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in SECTIONS:
            raise AttributeError(name)
        try:
            paths = resolve_key(name)
        except ConfigError as e:
            raise AttributeError(str(e)) from None
        section, leaf = paths[0].split(".")
        return getattr(object.__getattribute__(self, section), leaf)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SECTIONS:
            object.__setattr__(self, name, value)
        else:
            self.update({name: value})

    def to_dict(self, redact: bool = True) -> dict[str, dict[str, Any]]:
        out = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        if redact:
            for section in out.values():
                for k, v in section.items():
                    if is_secret(k) and v:
                        section[k] = REDACTED
                    elif isinstance(v, str):  # a secret pasted into another value (a path, a URL)
                        section[k] = redact_text(v)
                    elif isinstance(v, list):
                        section[k] = [redact_text(x) if isinstance(x, str) else x for x in v]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(redact=True), sort_keys=False)

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def completions_per_step(self) -> int:
        return self.train.prompts_per_step * self.generation.num_generations

    @property
    def resolved_micro_batch_size(self) -> int | None:
        """Most rows per micro-batch when the user's row knobs set them, else None (no row limit);
        train.micro_batch_tokens caps every micro-batch either way."""
        if self.train.micro_batch_size is not None:
            return self.train.micro_batch_size
        if self.train.gradient_accumulation_steps is not None:
            return self.completions_per_step // self.train.gradient_accumulation_steps
        return None

    @property
    def effective_max_new_tokens(self) -> int:
        cap = self.generation.max_total_length
        if cap is None:
            return self.generation.max_new_tokens
        return min(self.generation.max_new_tokens, cap - self.data.max_prompt_length)

    @property
    def episode_max_tokens(self) -> int:
        """Completion tokens a multi-turn episode may hold, sampled and injected together."""
        return self.env.max_tokens or self.env.max_turns * self.effective_max_new_tokens

    def hf_token(self) -> str | None:
        return self.model.hf_token or os.environ.get("HF_TOKEN") or None
