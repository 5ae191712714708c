"""grpo.plugins: one resolver for every `pkg.module:name`, and the Registry of named variants."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo import plugins
from grpo.config import ConfigError
from grpo.plugins import PluginError, Registry, load

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo"


def test_load_gives_the_object_and_follows_dotted_attributes():
    assert load("math:sqrt") is math.sqrt
    assert load("os.path:join") is os.path.join
    assert load("grpo.plugins:Registry.register") is Registry.register


@pytest.mark.parametrize(
    ("spec", "kind", "words"),
    [
        ("math.sqrt", PluginError, "is not an import path; write it as package.module:name"),
        ("no_such_module_xyz:fn", ImportError, "cannot import module 'no_such_module_xyz'"),
        ("math:nope", ValueError, "module 'math' has no attribute 'nope'"),
        ("math:pi", TypeError, "is a float, which is not callable"),
    ],
)
def test_every_bad_path_is_one_config_error_naming_the_setting(spec, kind, words):
    with pytest.raises(kind, match=words) as raised:
        load(spec, "env.tools entry", call=True)
    assert isinstance(raised.value, ConfigError)  # the CLI prints it as one line
    assert str(raised.value).startswith(f"env.tools entry {spec!r}")


def test_a_module_that_fails_while_importing_keeps_its_cause(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin_xyz.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="RuntimeError: boom") as raised:
        load("broken_plugin_xyz:fn")
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_registry_suggests_the_nearest_name_and_lists_all():
    engines = Registry("generation.engine", {"native": 1, "transformers": 2, "vllm": 3})
    assert (
        engines["vllm"] == 3 and "native" in engines and list(engines) == ["native", "transformers", "vllm"]
    )
    with pytest.raises(
        PluginError, match=r"Unknown generation\.engine 'natve'\. Did you mean 'native'\?"
    ) as e:
        engines["natve"]
    assert "Registered: native, transformers, vllm." in str(e.value)
    assert engines.get("nope") is None


def test_registry_loads_an_import_path_entry_only_when_it_is_looked_up(tmp_path, monkeypatch):
    (tmp_path / "lazy_plugin_xyz.py").write_text("def build():\n    return 'built'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("thing", {"lazy": "lazy_plugin_xyz:build"})
    assert list(registry) == ["lazy"] and "lazy_plugin_xyz" not in sys.modules
    assert registry["lazy"]() == "built"


def test_registry_register_as_call_and_decorator_refuses_a_second_entry():
    losses = Registry("algorithm.loss_type")

    @losses.register("a")
    def a():
        return "a"

    losses.register("b", len)
    assert losses["a"] is a and losses["b"] is len
    with pytest.raises(ValueError, match="registered twice"):
        losses.register("a", len)


def test_resolve_takes_an_object_a_registered_name_or_an_import_path():
    rewards = Registry("reward function", {"length": len})
    assert plugins.resolve(abs, rewards) is abs
    assert plugins.resolve("length", rewards) is len
    assert plugins.resolve("math:sqrt", rewards) is math.sqrt
    with pytest.raises(PluginError, match=r"Did you mean 'length'.*package\.module:name"):
        plugins.resolve("lenght", rewards)


def test_no_module_resolves_import_paths_by_itself():
    """`importlib.import_module` appears only in plugins.py, and where a module name (not a user's
    `pkg.module:name`) is imported: the package's lazy public names and the CLI's probe of broken extras."""
    allowed = {"plugins.py", "__init__.py", "cli.py"}
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "import_module":
                relative = path.relative_to(SRC).as_posix()
                if relative not in allowed:
                    found.append(relative)
    assert not found, found


def test_importing_the_reward_registry_loads_no_model_code():
    watched = ("grpo.rewards.model", "grpo.model.packed")
    code = f"import sys, grpo.rewards\nprint(sorted(m for m in {watched!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(SRC.parent)},
    )
    assert done.stdout.strip() == "[]"
    from grpo.rewards import reward_from_model
    from grpo.rewards.model import reward_from_model as home

    assert reward_from_model is home


def test_a_file_path_works_as_the_module_part_and_is_loaded_once(tmp_path):
    agent = tmp_path / "my_agent.py"
    agent.write_text("CALLS = []\nCALLS.append(1)\n\ndef run(client, row):\n    return 1.0\n")
    run = load(f"{agent}:run", "env.agent", call=True)
    assert run(None, {}) == 1.0
    assert load(f"{agent}:run") is run and load(f"{agent}:CALLS") == [1]  # executed once
    with pytest.raises(ImportError, match="there is no file"):
        load(f"{tmp_path / 'missing.py'}:run", "env.agent")
