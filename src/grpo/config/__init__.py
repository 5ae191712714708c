"""One typed configuration tree for a GRPO run.

Every field has a docstring (its `help`), a default and, where a seed project names it differently,
an alias. Values arrive in three layers, later ones winning: the dataclass defaults, a YAML file (a
shipped preset such as `tiny_math` or a user file), then overrides (`key=value`, `--key value`, or
keyword arguments to `GRPOConfig`). Everything is validated before any model is loaded: an unknown key
names the closest valid one, a bad value names the violated constraint.

    schema.py    the section dataclasses: fields, defaults, help text, choices
    keys.py      aliases (seed projects' and TRL's names), key resolution, value coercion
    trl.py       TRL's GRPOConfig defaults and the settings that need more than a rename
    validate.py  the checks, one function per concern, device roles included
    root.py      ConfigTree: the sections, key access, origins, YAML, derived sizes (what validate reads)
    tree.py      GRPOConfig (a ConfigTree built from keyword arguments), presets and YAML files, load_config
"""

from grpo.config.errors import ConfigError, TRLConfigError
from grpo.config.keys import ALIASES, all_paths, hint_of, resolve_key
from grpo.config.schema import (
    BUNDLED_MODEL,
    BUNDLED_MODELS,
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
from grpo.config.tree import GRPOConfig, flatten, load_config, preset_names, read_config_file

__all__ = [
    "ALIASES",
    "BUNDLED_MODEL",
    "BUNDLED_MODELS",
    "EVAL_HOLDOUT",
    "SECTIONS",
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EnvConfig",
    "GRPOConfig",
    "GenerationConfig",
    "LoraSettings",
    "ModelConfig",
    "OptimConfig",
    "TRLConfigError",
    "TrainConfig",
    "all_paths",
    "flatten",
    "hint_of",
    "load_config",
    "preset_names",
    "read_config_file",
    "resolve_key",
]
