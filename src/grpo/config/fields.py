"""How a config field is declared: `setting(default, help, choices=...)`, and `Registry` for choices that
are the keys of a registry dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo import plugins


def setting(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class Registry:
    """`choices=` that are the keys of a registry dict, so a new variant is one dict entry and no edit here.
    The dict is looked up when a config is validated, not when this module is imported: the registries
    live with the code they register, which imports torch."""

    path: str  # "module:NAME"
    also: tuple[str, ...] = ()  # choices that are not entries (e.g. "auto", resolved elsewhere)

    def keys(self) -> tuple[str, ...]:
        return (*self.also, *plugins.load(self.path, "registry"))
