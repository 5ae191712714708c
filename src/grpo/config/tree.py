"""`GRPOConfig`, the whole tree of sections, and how a run's config is assembled: defaults, then a
shipped preset or a YAML file, then the user's overrides, which win (also over a competing key a preset
set), then validation.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from grpo.config.errors import ConfigError
from grpo.config.keys import (
    TORCHRL_ENV_ALIASES,
    coerce,
    field_of,
    get_path,
    normalise_key,
    resolve_key,
    set_path,
)
from grpo.config.schema import (
    EVAL_HOLDOUT,
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
from grpo.config.trl import is_trl_style, translate
from grpo.config.validate import validate
from grpo.config.yaml_limits import load_yaml
from grpo.redact import REDACTED, is_secret, remember
from grpo.redact import redact as redact_text

log = logging.getLogger("grpo")


@dataclass(init=False)
class GRPOConfig:
    """The whole run configuration: eight sections. Accepts sections (objects or dicts) and any flat
    key `resolve_key` understands, so the seed's `GRPOConfig(batch_size=4, learning_rate=1e-6, ...)`
    works as written; reading or assigning a seed name (`config.learning_rate`) also works."""

    model: ModelConfig
    data: DataConfig
    generation: GenerationConfig
    algorithm: AlgorithmConfig
    optim: OptimConfig
    train: TrainConfig
    distributed: DistributedConfig
    lora: LoraSettings
    env: EnvConfig

    def __init__(self, **kwargs: Any) -> None:
        for section, cls in SECTIONS.items():
            object.__setattr__(self, section, cls())
        object.__setattr__(self, "_explicit", set())  # dotted paths the user set (not a preset or default)
        object.__setattr__(self, "_origins", {})  # dotted path -> where its value came from
        if is_trl_style(kwargs):  # TRL's field names and defaults (docs/trl.md)
            kwargs = translate(kwargs)
        flat: list[tuple[str, Any]] = []
        for key, value in kwargs.items():
            if key in SECTIONS and isinstance(value, (dict, SECTIONS[key])):
                items = dataclasses.asdict(value) if not isinstance(value, dict) else value
                flat.extend((f"{key}.{k}", v) for k, v in items.items())
            else:
                flat.append((key, value))
        self.update(flat, origin="the keyword arguments")
        if flat:
            apply_user_precedence(self)

    def update(
        self,
        overrides: Mapping[str, Any] | Iterable[tuple[str, Any]],
        explicit: bool = True,
        origin: str = "the settings given",
    ) -> GRPOConfig:
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

    def validate(self) -> GRPOConfig:
        """Check every constraint that needs no model (config/validate.py); raise ConfigError naming the
        key and the fix."""
        validate(self)
        return self


def preset_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files("grpo.configs").iterdir()
        if p.name.endswith(".yaml")
    )


def read_config_file(spec: str) -> dict[str, Any]:
    """A shipped preset by name (`tiny_math`, `gsm8k`) or a YAML file path → flat {dotted.key: value}."""
    path = Path(spec)
    is_file = path.suffix in (".yaml", ".yml") or path.exists()
    if is_file:
        if not path.is_file():
            raise ConfigError(
                f"Config file {spec} does not exist. Shipped presets: {', '.join(preset_names())}."
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:  # unreadable, or not UTF-8 text
            raise ConfigError(f"Cannot read config file {spec}: {e}. A config is UTF-8 YAML text.") from e
    else:
        name = spec.removeprefix("grpo_")  # TorchRL's `--config-name grpo_gsm8k`
        if name not in preset_names():
            close = difflib.get_close_matches(name, preset_names(), n=2)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(
                f"No preset or file named '{spec}'.{hint} Presets: {', '.join(preset_names())}; "
                "or pass a path to a .yaml file."
            )
        text = resources.files("grpo.configs").joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    raw = load_yaml(text, f"Config file {spec}") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"Config file {spec} must hold a mapping of sections to settings.")
    # A run's saved config.yaml (resumed from, or reused) holds `<redacted>` for its secrets: not a value.
    flat = flatten(raw, where=f"{'config file' if is_file else 'preset'} {spec}")
    return {k: v for k, v in flat.items() if v != REDACTED}


def flatten(tree: dict[str, Any], prefix: str = "", where: str = "the config") -> dict[str, Any]:
    """{section: {key: v}} and {"section.key": v} → {"section.key": v}; the same setting written both ways
    (`optim.learning_rate:` and `optim: {learning_rate:}`) is an error naming both."""
    flat: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted in SECTIONS:
            inner = flatten(value, dotted + ".", where)
            spellings = {k: f"'{dotted}:' > '{k.split('.', 1)[1]}'" for k in inner}
        else:
            inner, spellings = {dotted: value}, {dotted: f"'{dotted}'"}
        for k, v in inner.items():
            if k in flat:
                raise ConfigError(
                    f"{k} is set twice in {where}: as {spelled[k]} and as {spellings[k]}. Keep one."
                )
            flat[k], spelled[k] = v, spellings[k]
    return flat


def load_config(
    config: str | None = None,
    overrides: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
    origin: str = "the overrides",
) -> GRPOConfig:
    """Defaults ← preset/file ← overrides, validated. A value the user gives wins over the preset's,
    also where it competes with another key the preset set (`apply_user_precedence`). Within the file,
    and within the overrides, each setting may be given once (`GRPOConfig.update`)."""
    cfg = GRPOConfig()
    if config:
        kind = (
            "config file" if Path(config).suffix in (".yaml", ".yml") or Path(config).exists() else "preset"
        )
        cfg.update(read_config_file(config), explicit=False, origin=f"{kind} {config}")
    cfg.update(overrides or {}, origin=origin)
    apply_user_precedence(cfg)
    return cfg.validate()


# (key the user gave, key that would silently override it when only a preset set it)
COMPETING_KEYS = (
    ("train.num_epochs", "train.steps"),
    ("train.gradient_accumulation_steps", "train.micro_batch_size"),
    ("algorithm.reward_funcs", "algorithm.reward_weights"),
)


def apply_user_precedence(cfg: GRPOConfig) -> list[str]:
    """Make the user's values take effect over a preset's; returns (and logs) what changed and why.

    * Competing keys: `--num-epochs 3` under a preset with `train.steps: 80` would run 80 steps (steps win
      over epochs), so the preset's steps are dropped. When the user gives both, the winner is named.
    * Task switch: a dataset set to a registered task (`data.dataset=ifeval`, TorchRL's `env.dataset=ifeval`)
      brings that task's rewards, evaluation split and system prompt, except where the user set those too
      (grpo.data.tasks)."""
    from grpo.data.tasks import task_settings

    notes = []
    explicit = cfg.explicit_keys
    for given, rival in COMPETING_KEYS:
        rival_value = get_path(cfg, rival)
        if given not in explicit or rival_value is None:
            continue
        if rival in explicit:
            notes.append(
                f"both {given} = {get_path(cfg, given)} and {rival} = {rival_value} were given; "
                f"{rival} wins, {given} is not used."
            )
            continue
        set_path(cfg, rival, field_of(rival).default)
        notes.append(f"{given} = {get_path(cfg, given)} replaces the preset's {rival} = {rival_value}.")
    for key in ("data.hf_path", "data.dataset"):
        if key in explicit and get_path(cfg, key):
            notes += _holdout_for_new_data(cfg, key)
            for path, value in task_settings(get_path(cfg, key)).items():
                if path == "algorithm.reward_weights" and "algorithm.reward_funcs" in explicit:
                    continue  # the task's weights belong to the task's rewards, not to the user's
                if path not in explicit and get_path(cfg, path) != value:
                    set_path(cfg, path, value)
                    notes.append(
                        f"{key} = {get_path(cfg, key)} sets {path} = {value!r} "
                        "(the task's; set it to change)."
                    )
            break
    for note in notes:
        log.info("Config: %s", note)
    return notes


def _holdout_for_new_data(cfg: GRPOConfig, key: str) -> list[str]:
    """Training data the user chose that is not a task keeps no preset's evaluation set: held-out accuracy
    on the preset's problems would say nothing about the user's data. A slice of theirs is held out."""
    from grpo.data.tasks import find_task

    spec, current = get_path(cfg, key), cfg.data.eval_dataset
    if find_task(spec) or "data.eval_dataset" in cfg.explicit_keys or current in (None, EVAL_HOLDOUT):
        return []
    cfg.data.eval_dataset = EVAL_HOLDOUT
    return [
        f"{key} = {spec} replaces the training data: evaluating on a held-out 10% of it (not trained on) "
        f"instead of the preset's data.eval_dataset = {current!r}; set data.eval_dataset to choose."
    ]
