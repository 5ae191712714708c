"""Where names become objects: `load("pkg.module:name")` for every import path a user or a registry gives,
and `Registry` for every set of named variants (engines, sources, losses, environment forms, ...).

One resolver, so every bad path fails the same way: a `PluginError` (a ConfigError, so the CLI prints it as
one line) that names the setting (`what`), the path, what is wrong and how to write it. Its subclasses are
also the built-in error a caller would expect: `PluginImportError` is an ImportError (the module would not
import), `PluginAttributeError` a ValueError (no such name in it), `PluginTypeError` a TypeError (it is not
callable where a callable is needed).

    load("my_pkg.rewards:score", what="algorithm.reward_funcs entry", call=True)
    load("agents/mine.py:run", what="env.agent")       # a file path works as the module part too
    ENGINES = Registry("generation.engine", {"native": "grpo.rollout.native:build", ...})
    ENGINES["natve"]   # PluginError: unknown generation.engine 'natve'; did you mean 'native'? ...

A registry entry may itself be an import path (a string with ':'): it is loaded on first lookup, so listing a
registry's names (config choices, `--help`) imports none of the code behind them.

This module sits on the lowest floor beside records and config (it imports nothing of grpo but the error).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from grpo.config.errors import ConfigError

T = TypeVar("T")

SYNTAX = "package.module:name (or path/to/file.py:name)"


class PluginError(ConfigError):
    """An import path or a registered name that does not resolve; the message says how to fix it."""


class PluginImportError(PluginError, ImportError):
    """The module of an import path does not import."""


class PluginAttributeError(PluginError):
    """The module imports but has no such attribute."""


class PluginTypeError(PluginError, TypeError):
    """The object is not what the setting needs (a callable)."""


def is_import_path(spec: object) -> bool:
    """`pkg.module:name`: a string with a module part and a name part around one ':'."""
    if not isinstance(spec, str):
        return False
    module, sep, name = spec.partition(":")
    return bool(sep and module and name and ":" not in name)


def load(spec: str, what: str = "import path", *, call: bool = False) -> Any:
    """`pkg.module:name` (or `pkg.module:Class.attribute`, or `path/to/file.py:name`) → the object. `what`
    names the setting in the error; `call=True` requires a callable."""
    if not is_import_path(spec):
        raise PluginError(f"{what} {spec!r} is not an import path; write it as {SYNTAX}.")
    module_name, _, attribute_path = spec.partition(":")
    try:
        target = _import(module_name)
    except FileNotFoundError:
        raise PluginImportError(f"{what} {spec!r}: there is no file {module_name}.") from None
    except Exception as error:  # any failure while importing user code is the user's to see
        raise PluginImportError(
            f"{what} {spec!r}: cannot import module {module_name!r} ({type(error).__name__}: {error}). "
            "Check the spelling, and that its package is installed or on PYTHONPATH."
        ) from error
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise PluginAttributeError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attribute_path!r}."
            )
        target = getattr(target, attribute)
    if call and not callable(target):
        raise PluginTypeError(f"{what} {spec!r} is a {type(target).__name__}, which is not callable.")
    return target


def _import(module_name: str) -> Any:
    if not (module_name.endswith(".py") or "/" in module_name):
        return importlib.import_module(module_name)
    path = Path(module_name).resolve()
    if not path.is_file():
        raise FileNotFoundError(path)
    # Registered under a name of its own, so loading the same file again reuses it (and pickle finds it).
    name = f"grpo_user_file_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


class Registry(Generic[T]):
    """Named variants of one kind: name → object (or the object's import path, loaded on first lookup).

    `registry[name]` gives the object; an unknown name raises a PluginError listing the registered names
    with the nearest ones first. `register` adds an entry, as a call or a decorator:

        POLICY_LOSSES = Registry[Callable]("algorithm.loss_type")
        @POLICY_LOSSES.register("grpo")
        def grpo_loss(...): ...
    """

    def __init__(self, what: str, entries: dict[str, T | str] | None = None) -> None:
        self.what = what
        self._entries: dict[str, T | str] = dict(entries or {})

    def register(self, name: str, obj: T | str | None = None) -> Any:
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered twice.")
        if obj is not None:
            self._entries[name] = obj
            return obj

        def decorate(fn: T) -> T:
            self._entries[name] = fn
            return fn

        return decorate

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise PluginError(self.unknown(name))
        entry = self._entries[name]
        if isinstance(entry, str) and is_import_path(entry):
            entry = self._entries[name] = load(entry, f"{self.what} {name!r}")
        return entry

    def get(self, name: str, default: T | None = None) -> T | None:
        return self[name] if name in self._entries else default

    def unknown(self, name: str) -> str:
        """The message for a name that is not registered: the nearest names, then all of them."""
        nearest = difflib.get_close_matches(str(name), list(self._entries), n=3)
        hint = f" Did you mean {' or '.join(map(repr, nearest))}?" if nearest else ""
        return f"Unknown {self.what} {name!r}.{hint} Registered: {', '.join(self._entries)}."

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        return ((name, self[name]) for name in self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._entries)})"


def resolve(spec: T | str, registry: Registry[T] | None = None, what: str = "import path") -> T | Callable:
    """A user's choice: an object as it is, a registered name, or an import path."""
    if not isinstance(spec, str):
        return spec
    if registry is not None and spec in registry:
        return registry[spec]
    if is_import_path(spec) or registry is None:
        return load(spec, what)
    raise PluginError(registry.unknown(spec) + f" Or give your own as an import path {SYNTAX}.")
