"""The environments an episode runs in, in the forms users already have, behind one small interface.

    tools=[fn, ...]                  ToolEnvironment: stateless tools; a turn without a tool call ends it
    environment_factory=Cls (TRL)    TRLEnvironment: `reset(**row)` may return text appended to the prompt;
                                     its public methods are the tools; an optional `get_reward()` scores it
    {name: Cls, ...} (TRL)           the same, one class per row, chosen by the row's `environment` column
    reset(row) / step(messages)      StepEnvironment: `reset` gives the conversation to start from, `step`
                                     gets the conversation after each assistant turn and answers
                                     (new messages, reward, done)

The episode runner (rollout/episodes.py) gets one environment per episode from `EnvironmentFactory.make`
and drives it; tool calls themselves run in agents/tools.py, concurrently for all episodes of a step.
As in TRL 1.16, instances are made once and reset for every episode ("construct once, reset often"): the
k-th episode of a step reuses the k-th instance of its class.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo import plugins
from grpo.agents.tools import tool_schema
from grpo.config import ConfigError

__all__ = [
    "EnvironmentFactory",
    "StepEnvironment",
    "StepResult",
    "TRLEnvironment",
    "ToolEnvironment",
    "build_factory",
    "load_object",
]

# TRL 1.16: every public method of an environment class is a tool, except these two.
_NOT_TOOLS = {"reset", "get_reward"}


@dataclass
class StepResult:
    """What a step environment answers after an assistant turn."""

    messages: list[dict]  # to show the model next (injected, never trained on)
    reward: float | None = None
    done: bool = False


@dataclass
class ToolEnvironment:
    """Stateless tools (TRL's `tools=[fn]`): the same functions for every episode."""

    tools: dict[str, Callable]
    kind = "tools"

    def start(self, messages: list[dict], row: dict) -> list[dict]:
        del row
        return messages

    def reward(self) -> float | None:
        return None


@dataclass
class TRLEnvironment:
    """A TRL `environment_factory` instance: `reset(**row)`, public methods as tools, optional
    `get_reward()` (sync or async)."""

    instance: Any
    tools: dict[str, Callable] = field(default_factory=dict)
    kind = "tools"

    def __post_init__(self):
        self.tools = {name: getattr(self.instance, name) for name in tool_method_names(type(self.instance))}

    def start(self, messages: list[dict], row: dict) -> list[dict]:
        observation = self.instance.reset(**row)
        if observation is None or observation == "":
            return messages
        if not isinstance(observation, str):
            raise TypeError(
                f"{type(self.instance).__name__}.reset() returned {type(observation).__name__}; TRL's "
                "contract is None or a string (appended to the last user message)."
            )
        messages = [dict(m) for m in messages]
        messages[-1]["content"] = str(messages[-1].get("content") or "") + observation
        return messages

    def reward(self) -> float | None:
        method = getattr(self.instance, "get_reward", None)
        if not callable(method):
            return None
        value = method()
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return _as_reward(value, f"{type(self.instance).__name__}.get_reward()")


@dataclass
class StepEnvironment:
    """`reset(row) -> messages` and `step(messages) -> (messages, reward, done)`: the environment owns the
    conversation's next messages and its reward (summed over steps)."""

    instance: Any
    tools: dict[str, Callable] = field(default_factory=dict)  # tool calls are the environment's to act on
    total: float | None = None
    kind = "step"

    def start(self, messages: list[dict], row: dict) -> list[dict]:
        start = self.instance.reset(row)
        if start is None:
            return messages
        if isinstance(start, str):
            return [
                *messages[:-1],
                {**messages[-1], "content": str(messages[-1].get("content") or "") + start},
            ]
        if not isinstance(start, list) or not all(isinstance(m, dict) and "role" in m for m in start):
            raise TypeError(
                f"{type(self.instance).__name__}.reset(row) must return a list of messages "
                '({"role": ..., "content": ...}), a string or None.'
            )
        return start

    def step(self, conversation: list[dict]) -> StepResult:
        name = type(self.instance).__name__
        out = self.instance.step([dict(m) for m in conversation])
        if not isinstance(out, tuple) or len(out) != 3:
            raise TypeError(f"{name}.step(messages) must return (messages, reward, done).")
        messages, reward, done = out
        if messages is None:
            messages = []
        if isinstance(messages, dict):
            messages = [messages]
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            raise TypeError(f"{name}.step(messages) returned new messages that are not role/content dicts.")
        reward = _as_reward(reward, name)
        if reward is not None:
            self.total = reward if self.total is None else self.total + reward
        return StepResult(list(messages), reward, bool(done))

    def reward(self) -> float | None:
        return self.total


async def _awaited(value):
    return await value


def _as_reward(value, where: str) -> float | None:
    if value is None:
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where} gave the reward {value!r}; a reward is a number or None.") from None
    if reward != reward or abs(reward) == float("inf"):
        raise ValueError(f"{where} gave the reward {reward}; a reward must be finite.")
    return reward


def tool_method_names(cls: type) -> list[str]:
    """TRL's rule: public methods (not `_`-prefixed), except reset and get_reward."""
    return [
        name
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in _NOT_TOOLS
    ]


def is_step_environment(cls: type) -> bool:
    """The plain step form: a `step` method taking the conversation (one parameter besides self)."""
    step = getattr(cls, "step", None)
    if not inspect.isfunction(step) or not callable(getattr(cls, "reset", None)):
        return False
    params = [p for p in inspect.signature(step).parameters.values() if p.name != "self"]
    return len(params) == 1 and params[0].name in ("messages", "conversation")


class EnvironmentFactory:
    """One environment per episode: stateless tools, a class (TRL or step form), or a dict of classes routed
    by the row's `environment` column. `schemas(row)` are the tool schemas the prompt declares."""

    def __init__(self, tools: list[Callable] | None = None, factory: Any = None):
        self.tool_list = list(tools or [])
        self.factories: dict[str | None, Any] = (
            dict(factory) if isinstance(factory, dict) else {None: factory} if factory is not None else {}
        )
        self._schemas: dict[str | None, list[dict]] = {}
        self._pool: dict[str | None, list] = {}  # instances by class key, reused step after step
        for name, cls in self.factories.items():
            if not callable(cls):
                raise ConfigError(f"environment_factory{_where(name)} is not a class or callable: {cls!r}.")
            self._schemas[name] = self._class_schemas(cls, name)
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

    def _class_schemas(self, cls, name: str | None) -> list[dict]:
        target = cls if inspect.isclass(cls) else None
        if target is None:  # a factory function: describe what it makes
            return []
        if is_step_environment(target):
            return []
        methods = tool_method_names(target)
        if not methods and not self.tool_list:
            raise ConfigError(
                f"{target.__name__}{_where(name)} has no public methods to offer as tools and no step() "
                "method: give it tool methods (TRL's environment_factory) or reset(row)/step(messages)."
            )
        return [tool_schema(getattr(target, m)) for m in methods]

    @property
    def gives_rewards(self) -> bool:
        """An environment class that scores episodes itself (step rewards, or a get_reward() method)."""
        return bool(self.reward_functions())

    def reward_functions(self) -> list:
        """One reward function per environment class that scores its episodes, named after the class (as TRL
        logs it): the episode's environment reward where the episode ran in that class, else None."""
        classes = {c.__name__: c for c in self.factories.values() if inspect.isclass(c)}
        return [
            _class_reward(name)
            for name, c in classes.items()
            if is_step_environment(c) or callable(getattr(c, "get_reward", None))
        ]

    @property
    def multi_factory(self) -> bool:
        return len(self.factories) > 1 or (self.factories and None not in self.factories)

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

    def make(self, row: dict, slot: int = 0):
        """The environment for an episode: instance `slot` of the row's class, made the first time it is
        asked for and reused after (reset by the episode runner)."""
        fixed = self.fixed_tools
        if not self.factories:
            return ToolEnvironment(dict(fixed))
        key = self._key(row)
        pool = self._pool.setdefault(key, [])
        while len(pool) <= slot:
            pool.append(self.factories[key]())
            if not callable(getattr(pool[-1], "reset", None)):
                raise ConfigError(
                    f"{type(pool[-1]).__name__}{_where(key)} has no reset method: an environment must define "
                    "reset (TRL's reset(**row), or reset(row) with step(messages))."
                )
        instance = pool[slot]
        if is_step_environment(type(instance)):
            return StepEnvironment(instance)
        env = TRLEnvironment(instance)
        env.tools = {**fixed, **env.tools}
        return env


def _where(name: str | None) -> str:
    return "" if name is None else f"['{name}']"


def load_object(path: str, what: str):
    """`pkg.module:name` → the object (a user's tool function or environment class)."""
    return plugins.load(path, what)


def build_factory(tools=None, environment=None) -> EnvironmentFactory | None:
    """From config strings (import paths) or Python objects; None when neither is given (single turn)."""
    tools = [load_object(t, "env.tools entry") if isinstance(t, str) else t for t in (tools or [])]
    if isinstance(environment, str):
        environment = load_object(environment, "env.environment")
    if isinstance(environment, dict):
        environment = {
            k: load_object(v, f"environment_factory['{k}']") if isinstance(v, str) else v
            for k, v in environment.items()
        }
    if not tools and environment is None:
        return None
    return EnvironmentFactory(tools, environment)


def _class_reward(class_name: str):
    def reward(prompts, completions, env_reward=None, env_class=None, **kwargs) -> list[float | None]:
        del prompts, kwargs
        if env_reward is None or env_class is None:
            return [None] * len(completions)
        return [r if c == class_name else None for r, c in zip(env_reward, env_class, strict=True)]

    reward.__name__ = reward.__qualname__ = class_name
    reward.__doc__ = f"{class_name}'s own reward for its episodes (step rewards summed, or get_reward())."
    return reward
