"""The environment protocol: the one interface an episode runner talks to, and the user forms adapted to it.

An episode runner (the turn loop in rollout/multi_turn.py, or any other runner registered in
rollout/episodes.py's RUNNERS, e.g. the OpenAI-compatible gateway) drives one `Environment` per episode
through these calls only:

    env.start(messages, row)      → the conversation the episode begins with. `messages`: the prompt as chat
                                    messages; `row`: the dataset row (prompt included). Once per episode; the
                                    G episodes of one prompt must start from the same conversation.
    env.step(conversation, turn)  after every assistant turn. `conversation`: the whole chat so far, the turn
                                    included as an assistant message; `turn`: the parsed turn
                                    (agents/parsing.ParsedTurn: its tool calls and malformed-call errors).
                                    → StepResult(messages, reward, done): the messages to inject next (never
                                    trained on), a step reward (summed into reward()), whether it is over.
                                    `run_calls=True` instead says "run this turn's tool calls with env.tools
                                    and inject their results" (the tool forms): the runner runs every
                                    episode's calls of a turn concurrently, each within its time limit.
    env.reward()                  → the episode's own reward, or None when it gives none. It is data on
                                    the scored rollouts, weighted by env.reward_weight, logged as
                                    reward/<env.name>.
    env.close()                   end of life, once per instance: when the run ends (however it ends) or the
                                    instance is discarded. Calls the user's close() (else cleanup()); what it
                                    raises is logged.
    env.tools                     {name: callable}: what the model may call in this episode.
    env.name                      the reward's metric name (the user's class name); None for plain tools.
    env.instance                  the user's object: what TRL reward functions receive as `environments`.

Environment methods may raise EnvironmentContractError (one line: which method, what is wrong); everything a
user's method raises is turned into one.

The user forms, each an adapter in ENVIRONMENTS that says whether it `accepts` a class (a new form is one
adapter class and one registry line; EnvironmentFactory in agents/factory.py picks the first that accepts):

    tools=[fn, ...]                ToolEnvironment: stateless tools; a turn without a tool call ends it
    environment_factory=Cls (TRL)  TRLEnvironment: `reset(**row)` may return text appended to the prompt;
                                   its public methods are the tools; an optional `get_reward()` scores it
    {name: Cls, ...} (TRL)         the same, one class per row, chosen by the row's `environment` column
    a factory function (TRL)       `environment_factory=make_env`: the instance it returns is described
    reset(row) / step(messages)    StepEnvironment: `reset` gives the conversation to start from, `step`
                                   gets the conversation after each assistant turn and answers (new
                                   messages, reward, done)
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from grpo.agents.tools import encodable
from grpo.config import ConfigError
from grpo.ranges import REWARD_LIMIT

log = logging.getLogger("grpo")

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentContractError",
    "StepEnvironment",
    "StepResult",
    "TRLEnvironment",
    "ToolEnvironment",
    "adapter_for",
    "close_instance",
]

# TRL 1.16: every public method of an environment class is a tool, except reset and get_reward; close and
# cleanup are lifecycle hooks here, not tools.
_NOT_TOOLS = {"reset", "get_reward", "close", "cleanup"}


class EnvironmentContractError(TypeError, ValueError):
    """A user's environment broke its contract (what reset/step/get_reward may return); one line, the fix."""


@dataclass
class StepResult:
    """What an environment answers after an assistant turn."""

    messages: list[dict]  # to show the model next (injected, never trained on)
    reward: float | None = None
    done: bool = False
    run_calls: bool = False  # run the turn's tool calls with env.tools, inject their results
    ended_by: str = "done"  # the Episode.ended_by to record when done


class Environment(Protocol):
    """One episode's environment (see the module docstring for the contract)."""

    tools: dict[str, Callable]
    name: str | None
    instance: Any

    def start(self, messages: list[dict], row: dict) -> list[dict]: ...

    def step(self, conversation: list[dict], turn) -> StepResult: ...

    def reward(self) -> float | None: ...

    def close(self) -> None: ...


def _tool_turn(turn) -> StepResult:
    """The tool forms' step: a turn with tool calls (or malformed attempts) runs them; one without answers."""
    if not turn.calls and not turn.errors:
        return StepResult([], done=True, ended_by="answer")
    return StepResult([], run_calls=True)


class ToolEnvironment:
    """Stateless tools (TRL's `tools=[fn]`): the same functions for every episode."""

    name = None
    instance = None

    def __init__(self, instance=None, tools: dict[str, Callable] | None = None):
        del instance
        self.tools = dict(tools or {})

    @classmethod
    def accepts(cls, target) -> bool:
        return target is None

    def start(self, messages: list[dict], row: dict) -> list[dict]:
        del row
        return messages

    def step(self, conversation: list[dict], turn) -> StepResult:
        del conversation
        return _tool_turn(turn)

    def reward(self) -> float | None:
        return None

    def close(self) -> None:
        pass


class StepEnvironment:
    """`reset(row) -> messages` and `step(messages) -> (messages, reward, done)`: the environment owns the
    conversation's next messages and its reward (summed over steps)."""

    def __init__(self, instance, tools: dict[str, Callable] | None = None):
        del tools  # the turn's tool calls are the environment's to act on
        self.instance, self.tools, self.total = instance, {}, None
        self.name = type(instance).__name__

    @classmethod
    def accepts(cls, target) -> bool:
        """The plain step form: `reset` and a `step` taking the conversation (one parameter besides self)."""
        step = getattr(target, "step", None)
        if not inspect.isfunction(step) or not callable(getattr(target, "reset", None)):
            return False
        params = [p for p in inspect.signature(step).parameters.values() if p.name != "self"]
        return len(params) == 1 and params[0].name in ("messages", "conversation")

    @staticmethod
    def tool_names(target) -> list[str]:
        del target  # the turn's tool calls are the environment's to read
        return []

    @staticmethod
    def gives_reward(target) -> bool:
        del target  # step rewards, summed
        return True

    @classmethod
    def check(cls, target, has_tools: bool) -> None:
        del has_tools
        _check_reset(target, "reset(self, row)", lambda ps: len(ps) >= 1 or _var(ps))

    @staticmethod
    def reset_arguments(row: dict) -> tuple[tuple, dict]:
        return (row,), {}

    def start(self, messages: list[dict], row: dict) -> list[dict]:
        name = self.name
        start = _call(self.instance.reset, f"{name}.reset(row)", row)
        if start is None:
            return messages
        if isinstance(start, str):
            return [
                *messages[:-1],
                {**messages[-1], "content": str(messages[-1].get("content") or "") + start},
            ]
        if not isinstance(start, list) or not all(isinstance(m, dict) and "role" in m for m in start):
            raise EnvironmentContractError(
                f"{name}.reset(row) returned {type(start).__name__}; it must return a list of messages "
                '([{"role": ..., "content": ...}]), a string or None.'
            )
        return [_coerced(m) for m in start]

    def step(self, conversation: list[dict], turn) -> StepResult:
        del turn
        name = self.name
        out = _call(self.instance.step, f"{name}.step(messages)", [dict(m) for m in conversation])
        if not isinstance(out, tuple) or len(out) != 3:
            raise EnvironmentContractError(
                f"{name}.step(messages) returned {type(out).__name__}; it must return "
                "(messages, reward, done)."
            )
        messages, reward, done = out
        if messages is None:
            messages = []
        if isinstance(messages, dict):
            messages = [messages]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise EnvironmentContractError(
                f"{name}.step(messages) returned new messages that are not role/content dicts: "
                f"{messages!r:.80}."
            )
        reward = _as_reward(reward, f"{name}.step(messages)")
        if reward is not None:
            self.total = reward if self.total is None else self.total + reward
        return StepResult([_coerced(m) for m in messages], reward, bool(done))

    def reward(self) -> float | None:
        return self.total

    def close(self) -> None:
        close_instance(self.instance)


class TRLEnvironment:
    """A TRL `environment_factory` instance: `reset(**row)`, public methods as tools, optional `get_reward()`
    (sync or async)."""

    def __init__(self, instance, tools: dict[str, Callable] | None = None):
        self.instance, self.name = instance, type(instance).__name__
        own = {name: getattr(instance, name) for name in self.tool_names(type(instance))}
        self.tools = {**(tools or {}), **own}  # a name in both is refused at start-up (EnvironmentFactory)

    @classmethod
    def accepts(cls, target) -> bool:
        return inspect.isclass(target) and callable(getattr(target, "reset", None))

    @classmethod
    def tool_names(cls, target) -> list[str]:
        """TRL's rule: public methods (not `_`-prefixed), except reset and get_reward."""
        return [
            name
            for name, member in inspect.getmembers(target, inspect.isfunction)
            if not name.startswith("_") and name not in _NOT_TOOLS
        ]

    @classmethod
    def gives_reward(cls, target) -> bool:
        return callable(getattr(target, "get_reward", None))

    @classmethod
    def check(cls, target, has_tools: bool) -> None:
        _check_reset(target, "reset(self, **kwargs)", lambda ps: bool(ps))
        if not cls.tool_names(target) and not has_tools:
            raise ConfigError(
                f"{target.__name__} has no public methods to offer as tools and no step() method: give it "
                "tool methods (TRL's environment_factory) or reset(row)/step(messages)."
            )

    @staticmethod
    def reset_arguments(row: dict) -> tuple[tuple, dict]:
        return (), row

    def start(self, messages: list[dict], row: dict) -> list[dict]:
        observation = _call(self.instance.reset, f"{self.name}.reset(**row)", **row)
        if observation is None or observation == "":
            return messages
        if not isinstance(observation, str):
            raise EnvironmentContractError(
                f"{self.name}.reset() returned {type(observation).__name__}; TRL's contract is None or a "
                "string (appended to the last user message)."
            )
        messages = [dict(m) for m in messages]
        messages[-1]["content"] = str(messages[-1].get("content") or "") + encodable(observation)
        return messages

    def step(self, conversation: list[dict], turn) -> StepResult:
        del conversation
        return _tool_turn(turn)

    def reward(self) -> float | None:
        method = getattr(self.instance, "get_reward", None)
        if not callable(method):
            return None
        value = _call(method, f"{self.name}.get_reward()")
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return _as_reward(value, f"{self.name}.get_reward()")

    def close(self) -> None:
        close_instance(self.instance)


class ProtocolEnvironment:
    """A class that implements this protocol itself (start, step, reward, close; its tools named in
    `tool_methods`, `gives_reward` if reward() scores), e.g. agents/code_exec.PythonSandbox."""

    def __init__(self, instance, tools: dict[str, Callable] | None = None):
        self.instance, self.name = instance, type(instance).__name__
        own = {name: getattr(instance, name) for name in self.tool_names(type(instance))}
        self.tools = {**(tools or {}), **own}
        self.start, self.step = instance.start, instance.step
        self.reward, self.close = instance.reward, instance.close

    @classmethod
    def accepts(cls, target) -> bool:
        return inspect.isclass(target) and all(
            callable(getattr(target, m, None)) for m in ("start", "step", "reward", "close")
        )

    @staticmethod
    def tool_names(target) -> list[str]:
        return list(getattr(target, "tool_methods", ()))

    @staticmethod
    def gives_reward(target) -> bool:
        return bool(getattr(target, "gives_reward", False))

    @classmethod
    def check(cls, target, has_tools: bool) -> None:
        del target, has_tools

    @staticmethod
    def reset_arguments(row: dict) -> tuple[tuple, dict]:
        return (), row


# The adapters, most specific first: the first whose `accepts` takes the class (or None: tools only) wins.
ENVIRONMENTS: dict[str, type] = {
    "tools": ToolEnvironment,
    "protocol": ProtocolEnvironment,
    "step": StepEnvironment,
    "trl": TRLEnvironment,
}


def adapter_for(target) -> type | None:
    return next((a for a in ENVIRONMENTS.values() if a.accepts(target)), None)


def close_instance(instance) -> None:
    """The user's own end of life (close(), else cleanup()); one that raises is logged, never fatal."""
    for hook in ("close", "cleanup"):
        # Looked up on the class: an instance living in a worker process forwards every attribute read to
        # its worker, which may be gone (killed at a deadline) by the time the run closes it.
        own = getattr(instance, "__dict__", {})
        if not callable(getattr(type(instance), hook, None)) and hook not in own:
            continue
        try:
            value = getattr(instance, hook)()
            if inspect.isawaitable(value):
                asyncio.run(_awaited(value))
        except Exception as err:  # noqa: BLE001 - closing must not end a run that is ending anyway
            log.warning("%s.%s() raised %s: %s", type(instance).__name__, hook, type(err).__name__, err)
        return


def _var(params: list[inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _check_reset(target, form: str, ok) -> None:
    reset = getattr(target, "reset", None)
    try:
        params = list(inspect.signature(reset).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin or C method: nothing to read
    if inspect.isfunction(reset) and params and params[0].name == "self":
        params = params[1:]
    if not ok(params):
        shown = ", ".join(["self", *(str(p) for p in params)])
        raise ConfigError(
            f"{target.__name__}.reset({shown}) cannot take the dataset row: this form's contract is {form} "
            f"(the row's columns, prompt included); define it as {form}."
        )


def _call(fn, where: str, /, *args, **kwargs):
    """A user's environment method; what it raises becomes one line naming the method."""
    try:
        return fn(*args, **kwargs)
    except EnvironmentContractError:
        raise
    except Exception as err:  # user code: say where it failed, in one line
        raise EnvironmentContractError(
            f"{where} raised {type(err).__name__}: {encodable(str(err))[:300]}"
        ) from err


def _coerced(message: dict) -> dict:
    """A message the chat template can render: its content as text (str() of anything else)."""
    content = message.get("content")
    if content is None or isinstance(content, list):
        return dict(message)
    return {**message, "content": encodable(content)}


async def _awaited(value):
    return await value


def _as_reward(value, where: str) -> float | None:
    if value is None:
        return None
    try:
        reward = float(value)
    except OverflowError:
        reward = math.inf
    except (TypeError, ValueError):
        raise EnvironmentContractError(
            f"{where} gave the reward {value!r:.80}; a reward is a number or None."
        ) from None
    if not math.isfinite(reward) or abs(reward) > REWARD_LIMIT:
        raise EnvironmentContractError(
            f"{where} gave the reward {str(value)[:40]}; a reward must be finite and within "
            f"±{REWARD_LIMIT:g}."
        )
    return reward
