"""One environment per episode, from what the user gave: tools, a class, a factory function or a dict of them.

`EnvironmentFactory` checks the user's forms at start-up, before the model loads (each contract violation is
one line saying what to change), keeps a pool of instances (TRL 1.16: "construct once, reset often": the k-th
episode of a step reuses the k-th instance of its class), wraps each in its adapter from
agents/environments.ENVIRONMENTS, and closes every instance when the run ends or the factory is discarded.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from grpo import plugins
from grpo.agents.environments import ToolEnvironment, adapter_for, close_instance
from grpo.agents.tools import tool_schema
from grpo.config import ConfigError
from grpo.config.errors import clause

__all__ = ["EnvironmentFactory", "build_factory", "load_object"]


class EnvironmentFactory:
    """Environments for episodes: stateless tools, a class (TRL or step form) or factory function, or a dict
    of them routed by the row's `environment` column. `schemas(row)` are the tool schemas the prompt declares;
    `reward_names` the classes that score their own episodes (their reward columns, TRL's metric names)."""

    def __init__(self, tools: list[Callable] | None = None, factory: Any = None):
        self.tool_list = list(tools or [])
        self.factories: dict[str | None, Any] = (
            dict(factory) if isinstance(factory, dict) else {None: factory} if factory is not None else {}
        )
        self.fixed_schemas = [tool_schema(fn) for fn in self.tool_list]
        self.fixed_tools = {
            s["function"]["name"]: fn for s, fn in zip(self.fixed_schemas, self.tool_list, strict=True)
        }
        names = [s["function"]["name"] for s in self.fixed_schemas]
        if len(set(names)) != len(names):
            raise ConfigError(f"Two tools share a name: {', '.join(sorted(names))}; tool names must differ.")
        if not self.factories and not self.tool_list:
            raise ConfigError(
                "Multi-turn episodes need tools or an environment (env.tools / env.environment)."
            )
        self._pool: dict[str | None, list] = {}  # instances by key, reused step after step
        self.adapters: dict[str | None, type] = {}
        self.classes: dict[str | None, type] = {}
        self._schemas: dict[str | None, list[dict]] = {}
        for key, maker in self.factories.items():
            self._probe(key, maker)
        self.reward_names = list(
            dict.fromkeys(c.__name__ for k, c in self.classes.items() if self.adapters[k].gives_reward(c))
        )
        # Closed when the run ends (close()), and at the latest when this factory is collected or the
        # interpreter exits.
        self._finalizer = weakref.finalize(self, _close_pools, self._pool)

    def _probe(self, key, maker) -> None:
        """Make this key's first two instances (they seed the pool) and check the form they have."""
        where = _where(key)
        if not callable(maker):
            raise ConfigError(f"environment_factory{where} is not a class or callable: {maker!r:.80}.")
        first = self._new(key, maker, [])
        cls = type(first)
        adapter = adapter_for(cls)
        if adapter is None:
            raise ConfigError(
                f"{cls.__name__}{where} has no reset method: an environment must define reset (TRL's "
                "reset(**row), or reset(row) with step(messages))."
            )
        adapter.check(cls, has_tools=bool(self.tool_list))
        second = self._new(key, maker, [first])
        self._pool[key] = [first, second]
        self.adapters[key], self.classes[key] = adapter, cls
        methods = adapter.tool_names(cls)
        for name in methods:
            if name in self.fixed_tools:
                fn = self.fixed_tools[name]
                raise ConfigError(
                    f"The tool '{name}' is defined twice: {cls.__name__}.{name} (the environment's method) "
                    "and "
                    f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', name)} (env.tools / "
                    "tools=); rename one of them."
                )
        self._schemas[key] = [tool_schema(getattr(cls, m)) for m in methods]

    def _new(self, key, maker, pool: list):
        instance = maker()
        if any(instance is other for other in pool):
            label = getattr(maker, "__name__", type(maker).__name__)
            raise ConfigError(
                f"environment_factory{_where(key)} ({label}) returned the same {type(instance).__name__} "
                "instance twice: every episode needs its own, or the episodes overwrite each other's state. "
                "Return a new instance on each call."
            )
        return instance

    @property
    def multi_factory(self) -> bool:
        return len(self.factories) > 1 or bool(self.factories and None not in self.factories)

    @property
    def stateful(self) -> bool:
        """Environment instances hold state: one episode's calls run in the order written."""
        return bool(self.factories)

    def reset_row(self, row: dict) -> dict:
        """What reset receives: the dataset row (prompt included), without the routing column (TRL)."""
        return {k: v for k, v in row.items() if k != "environment"} if self.multi_factory else dict(row)

    def _key(self, row: dict) -> str | None:
        if not self.multi_factory:
            return None
        key = row.get("environment")
        if key not in self.factories:
            raise ValueError(
                f"Row has environment={key!r}; environment_factory has {', '.join(map(str, self.factories))}."
                " Every row needs an `environment` column naming one of them."
            )
        return key

    def schemas(self, row: dict) -> list[dict]:
        if not self.factories:
            return self.fixed_schemas
        return self.fixed_schemas + self._schemas[self._key(row)]

    def any_schemas(self) -> list[dict]:
        """Some row's tool schemas (the start-up template check renders with them)."""
        return self.fixed_schemas or next(iter(self._schemas.values()), [])

    def check_rows(self, rows: list[dict]) -> None:
        """At start-up: reset can take the first row's columns (TRL calls reset(**row))."""
        if not rows or not self.factories:
            return
        row = rows[0]
        key = self._key(row)
        cls = self.classes[key]
        reset = getattr(cls, "reset", None)
        if reset is None:  # the protocol form: start(messages, row) takes the row as one dict
            return
        try:
            signature = inspect.signature(reset)
        except (TypeError, ValueError):
            return
        args, kwargs = self.adapters[key].reset_arguments(self.reset_row(row))
        try:
            signature.bind(None, *args, **kwargs)
        except TypeError as err:
            raise ConfigError(
                f"{cls.__name__}.reset cannot take the dataset row's columns ({', '.join(map(str, row))}): "
                f"{clause(err)}. TRL calls reset(**row); add **kwargs to its parameters."
            ) from None

    def make(self, row: dict, slot: int = 0):
        """The environment for an episode: instance `slot` of the row's class, made the first time it is asked
        for and reused after (reset by the episode runner)."""
        if not self.factories:
            return ToolEnvironment(None, self.fixed_tools)
        key = self._key(row)
        pool = self._pool.setdefault(key, [])
        while len(pool) <= slot:
            pool.append(self._new(key, self.factories[key], pool))
        return self.adapters[key](pool[slot], self.fixed_tools)

    def samples(self) -> list:
        """The first instance of each key (made at start-up)."""
        return [pool[0] for pool in self._pool.values() if pool]

    def close(self) -> None:
        """Close every instance (the user's close()/cleanup()); the next episode makes fresh ones."""
        _close_pools(self._pool)

    def __getstate__(self) -> dict:
        # A copy sent to a rollout actor makes its own instances (they need not pickle).
        state = {k: v for k, v in self.__dict__.items() if k != "_finalizer"}
        state["_pool"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._finalizer = weakref.finalize(self, _close_pools, self._pool)


def _close_pools(pools: dict) -> None:
    from grpo.agents.workers import end_worker

    for key in list(pools):
        instances = pools.pop(key)
        for instance in instances:
            close_instance(instance)
            end_worker(instance)  # an instance living in a worker process (reward_isolation): its process too


def _where(name: str | None) -> str:
    return "" if name is None else f"['{name}']"


def load_object(path: str, what: str):
    """`pkg.module:name` → the object (a user's tool function or environment class)."""
    return plugins.load(path, what)


# Environments shipped with grpo, by the short name env.environment may give.
BUILTIN_ENVIRONMENTS = {
    "python": "grpo.agents.code_exec:PythonSandbox",
}


def build_factory(tools=None, environment=None) -> EnvironmentFactory | None:
    """From config strings (import paths, or a BUILTIN_ENVIRONMENTS name) or Python objects; None when neither
    is given (single turn)."""
    tools = [load_object(t, "env.tools entry") if isinstance(t, str) else t for t in (tools or [])]
    if isinstance(environment, str):
        environment = load_object(BUILTIN_ENVIRONMENTS.get(environment, environment), "env.environment")
    if isinstance(environment, dict):
        environment = {
            k: load_object(v, f"environment_factory['{k}']") if isinstance(v, str) else v
            for k, v in environment.items()
        }
    if not tools and environment is None:
        return None
    return EnvironmentFactory(tools, environment)
