"""What a run built in Python ran with, written into its config.yaml (issue 33).

`GRPOTrainer(train_dataset=ds, reward_funcs=[fn], tools=[...], environment_factory=Cls)` trains on objects
the config never names. Without this, config.yaml (and the report's summary, read from it) would show the
preset's dataset and rewards beside plots of the real ones, and a CLI `--resume` would quietly train
another task. So the objects are recorded in the settings they stand in for:

- a function or class by its import path `module:qualname` when importing that path gives the same object
  back (a CLI resume then rebuilds it); otherwise as `<name from module, not importable>`;
- an in-memory dataset as `<in-memory train_dataset: N rows, sha256 …>` (the digest of its rows as
  given), so a resume with other rows is caught by the settings comparison (run/preflight.py).

A value in angle brackets cannot be rebuilt from a config: a run that still holds one where no object was
passed (a CLI resume of a Python run) is refused by `refuse_unrebuildable`, saying which settings and how to
resume from Python instead.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from grpo.config import ConfigError, GRPOConfig

# settings an object passed in Python stands in for (model objects are recorded by assemble.build_run)
RECORDED_KEYS = (
    "model.name_or_path",
    "model.tokenizer_path",
    "model.ref_model_path",
    "data.dataset",
    "data.eval_dataset",
    "algorithm.reward_funcs",
    "algorithm.reward_model",
    "env.tools",
    "env.environment",
)


def import_path(obj: Any) -> str | None:
    """`module:qualname` when that path leads back to `obj` itself, else None (a lambda, a function defined
    in a script or a notebook, one made inside another function, a functools.partial, an instance)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    found = sys.modules.get(module)  # already imported: it is where obj came from (no import run here)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return f"{module}:{qualname}" if found is obj else None


def describe(obj: Any) -> str:
    """An import path, or `<name from module, not importable>` (what the logs and the report show)."""
    if isinstance(obj, str):
        return obj
    path = import_path(obj)
    if path is not None:
        return path
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    name = name.strip("<>")  # <lambda>: one pair of brackets marks the value
    module = getattr(obj, "__module__", None) or "?"
    return f"<{name} from {module}, not importable>"


def dataset_record(name: str, rows: list[dict[str, Any]]) -> str:
    """`<in-memory train_dataset: 120 rows, sha256 1a2b…>`: the rows' digest, equal for equal rows."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=repr, ensure_ascii=False).encode())
        digest.update(b"\n")
    return f"<in-memory {name}: {len(rows)} rows, sha256 {digest.hexdigest()[:16]}>"


def is_recorded_object(value: Any) -> bool:
    """Whether a setting's value stands for an object passed in Python (angle brackets)."""
    if isinstance(value, list):
        return any(is_recorded_object(v) for v in value)
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")


def record_objects(
    *,
    train_rows: list[dict[str, Any]] | None = None,
    eval_rows: list[dict[str, Any]] | None = None,
    reward_funcs=None,
    reward_model=None,
    tools=None,
    environment=None,
) -> dict[str, Any]:
    """What was passed in Python, as the settings it replaces: {dotted path: value}, start-up decisions
    (config/settings.py) that config.yaml is written from."""
    decided: dict[str, Any] = {}
    if train_rows is not None:
        decided["data.dataset"] = dataset_record("train_dataset", train_rows)
        decided["data.hf_path"] = None  # not what ran: the rows did
    if eval_rows is not None:
        decided["data.eval_dataset"] = dataset_record("eval_dataset", eval_rows)
    if reward_funcs is not None:
        funcs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
        decided["algorithm.reward_funcs"] = [describe(f) for f in funcs]
    if reward_model is not None:
        decided["algorithm.reward_model"] = (
            reward_model
            if isinstance(reward_model, str)
            else getattr(getattr(reward_model, "config", None), "_name_or_path", None)
            or f"<{type(reward_model).__name__} object>"
        )
    if tools:
        decided["env.tools"] = [describe(t) for t in tools]
    if environment is not None:
        if isinstance(environment, dict):  # routed by the dataset's `environment` column: no config form
            inner = ", ".join(f"{k}={describe(v)}" for k, v in environment.items())
            decided["env.environment"] = f"<by the environment column: {inner}>"
        else:
            decided["env.environment"] = describe(environment)
    return decided


def unrebuildable(cfg: GRPOConfig) -> list[str]:
    """`key = value` for every setting that holds an object only Python can pass."""
    out = []
    for key in RECORDED_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if is_recorded_object(value):
            shown = [v for v in value if is_recorded_object(v)] if isinstance(value, list) else value
            out.append(f"{key} = {shown}")
    return out


def refuse_unrebuildable(cfg: GRPOConfig, given: dict[str, Any]) -> None:
    """A config that names objects passed in Python (the config.yaml of a Python run), with those objects not
    passed now: refused, saying which and how to resume from Python. `given`: setting → the object passed
    for it now (or None)."""
    missing = [
        item
        for item in unrebuildable(cfg)
        if given.get(item.split(" = ")[0]) is None
        and not (item.startswith("model.") and given.get("model.name_or_path") is not None)
    ]
    if not missing:
        return
    run_dir = cfg.train.output_dir or "RUN_DIR"
    raise ConfigError(
        f"This run was built in Python, and its config names objects that no config can rebuild: "
        f"{'; '.join(missing)}. A CLI --resume cannot continue it (it would train another task). Resume it "
        "from Python with the same objects: GRPOTrainer(model=..., reward_funcs=[...], train_dataset=..., "
        f"tools=..., args=GRPOConfig(output_dir={str(run_dir)!r}, ...)).train(resume_from_checkpoint=True); "
        "or override these settings (key=value) to name data and functions by name or import path."
    )
