"""`GRPOConfig`, the whole tree of sections, and how a run's config is assembled: defaults, then a
shipped preset or a YAML file, then the user's overrides, which win (also over a competing key a preset
set), then validation.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from grpo import plugins
from grpo.config.errors import ConfigError, clause
from grpo.config.keys import field_of, get_path, set_path
from grpo.config.root import ConfigTree
from grpo.config.schema import (
    EVAL_HOLDOUT,
    SECTIONS,
)
from grpo.config.trl import is_trl_style, trl_settings
from grpo.config.validate import validate
from grpo.config.yaml_limits import load_yaml
from grpo.redact import REDACTED

log = logging.getLogger("grpo")


@dataclass(init=False)
class GRPOConfig(ConfigTree):
    """The whole run configuration: eight sections. Accepts sections (objects or dicts) and any flat
    key `resolve_key` understands, so the seed's `GRPOConfig(batch_size=4, learning_rate=1e-6, ...)`
    works as written; reading or assigning a seed name (`config.learning_rate`) also works."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        if is_trl_style(kwargs):  # TRL's field names and defaults (docs/trl.md)
            implied, kwargs, names = trl_settings(kwargs)
            self.update(implied, explicit=False, origin="TRL's defaults")  # not "given" by the user
            object.__setattr__(self, "_trl_names", names)  # messages name settings as the user did
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

    def name_of(self, path: str) -> str:
        """What the user calls `path`: the TRL name they wrote in a TRL-style config, else the path."""
        return getattr(self, "_trl_names", {}).get(path, path)

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
            raise ConfigError(
                f"Cannot read config file {spec}: {clause(e)}. A config is UTF-8 YAML text."
            ) from e
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
    ("env.agent_command", "env.agent"),  # --agent-command on the tiny_tools_agent preset runs the command
    # --agent on a preset with tools (tiny_tools): the agent runs its own tools, the preset's are not used
    ("env.agent", "env.tools"),
    ("env.agent_command", "env.tools"),
    ("env.agent", "env.environment"),
    ("env.agent_command", "env.environment"),
)
# Pairs that may not both be given by the user: validation refuses them, naming both.
_REFUSED_TOGETHER = {pair for pair in COMPETING_KEYS if pair[1] in ("env.tools", "env.environment")}
# Pairs of COMPETING_KEYS that compete only with a preset's value: given both, the user's weights are the
# weights of the user's functions, and both are used.
_USED_TOGETHER = {("algorithm.reward_funcs", "algorithm.reward_weights")}


def apply_user_precedence(cfg: GRPOConfig) -> list[str]:
    """Make the user's values take effect over a preset's; returns (and logs) what changed and why.

    * Competing keys: `--num-epochs 3` under a preset with `train.steps: 80` would run 80 steps (steps win
      over epochs), so the preset's steps are dropped. When the user gives both, the winner is named.
    * Task switch: a dataset set to a registered task (`data.dataset=ifeval`, TorchRL's `env.dataset=ifeval`)
      brings that task's rewards, evaluation split and system prompt, except where the user set those too
      (grpo.data.tasks)."""
    task_settings = plugins.load("grpo.data.tasks:task_settings")  # by path: tasks sit above config

    notes = []
    explicit = cfg.explicit_keys
    for given, rival in COMPETING_KEYS:
        rival_value = get_path(cfg, rival)
        # a key given as null (`--agent-command ""`) asks for nothing: it must not drop the preset's rival
        if given not in explicit or rival_value in (None, []) or get_path(cfg, given) is None:
            continue
        if rival in explicit:
            if (given, rival) in _USED_TOGETHER | _REFUSED_TOGETHER:
                continue
            mine, theirs = cfg.name_of(given), cfg.name_of(rival)  # as the user wrote them
            notes.append(
                f"both {mine} = {get_path(cfg, given)} and {theirs} = {rival_value} were given; "
                f"{theirs} wins, {mine} is not used."
            )
            continue
        spec = field_of(rival)  # a list's default comes from its factory (`.default` is MISSING there)
        set_path(cfg, rival, spec.default_factory() if spec.default is dataclasses.MISSING else spec.default)
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
    find_task = plugins.load("grpo.data.tasks:find_task")

    spec, current = get_path(cfg, key), cfg.data.eval_dataset
    if find_task(spec) or "data.eval_dataset" in cfg.explicit_keys or current in (None, EVAL_HOLDOUT):
        return []
    cfg.data.eval_dataset = EVAL_HOLDOUT
    return [
        f"{key} = {spec} replaces the training data: evaluating on a held-out 10% of it (not trained on) "
        f"instead of the preset's data.eval_dataset = {current!r}; set data.eval_dataset to choose."
    ]
