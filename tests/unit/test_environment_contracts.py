"""Environment contracts: checked at start-up where they can be (before a model loads), one-line errors where
they can only be seen in a rollout, and coercion of what can be coerced (issue 32 §4); the protocol's
lifecycle (close)."""

from __future__ import annotations

import functools
import json
import logging
import typing

import pytest

from grpo.agents.environments import ENVIRONMENTS, EnvironmentContractError, StepResult, adapter_for
from grpo.agents.factory import EnvironmentFactory
from grpo.config import ConfigError
from tests.unit.test_episodes import SAMPLING, ScriptedEngine, batch, calculator, call_text, runner


@pytest.fixture(scope="module")
def qwen():
    from tests.chat_templates import family_tokenizer

    return family_tokenizer("qwen2.5")


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and len(text) < 600, text
    return text


class NoRow:
    """TRL's early examples: reset(self), no row."""

    def reset(self):
        self.n = 0

    def add(self, amount: int) -> str:
        """Add.

        Args:
            amount: How much.
        """
        return str(amount)


def test_reset_without_the_row_is_refused_at_start_up_saying_trls_contract():
    with pytest.raises(
        ConfigError, match=r"NoRow\.reset\(self\) cannot take the dataset row.*\*\*kwargs"
    ) as e:
        EnvironmentFactory(None, NoRow)
    one_line(e.value)


class Named:
    def reset(self, prompt):
        self.prompt = prompt

    def add(self, amount: int) -> str:
        """Add.

        Args:
            amount: How much.
        """
        return str(amount)


def test_reset_that_cannot_take_the_rows_columns_is_refused_before_the_model_loads():
    factory = EnvironmentFactory(None, Named)
    factory.check_rows([{"prompt": "p"}])  # exactly its columns: fine
    with pytest.raises(ConfigError, match=r"Named\.reset cannot take the dataset row's columns .*\*\*kwargs"):
        factory.check_rows([{"prompt": "p", "answer": "4"}])


class Calc:
    def reset(self, **row):
        pass

    def calculator(self, expression: str) -> str:
        """Evaluate.

        Args:
            expression: The expression.
        """
        return "1"


def test_a_tool_defined_twice_is_refused_naming_both():
    with pytest.raises(
        ConfigError, match=r"'calculator' is defined twice: Calc\.calculator .*test_episodes:calculator"
    ):
        EnvironmentFactory([calculator], Calc)


def test_a_factory_returning_one_shared_instance_is_refused():
    shared = Calc()
    with pytest.raises(ConfigError, match="returned the same Calc instance twice"):
        EnvironmentFactory(None, lambda: shared)


class Scored:
    def reset(self, **row):
        self.total = 0

    def add(self, amount: int) -> str:
        """Add.

        Args:
            amount: How much.
        """
        self.total += amount
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)


def test_a_factory_function_is_described_by_the_instance_it_returns(qwen):
    def make_env():
        return Scored()

    run = runner(qwen, environment=make_env)
    assert run.reward_names == ["Scored"]
    assert [s["function"]["name"] for s in run.factory.schemas({})] == ["add"]
    script = lambda text: call_text("add", {"amount": 3}) if "<tool_response>" not in text else "ok"  # noqa: E731
    _, r = run.run(ScriptedEngine(qwen, script), batch(["q"]), 2, SAMPLING)
    assert [e.env_reward for e in r.episodes] == [3.0, 3.0] and r.episodes[0].env_class == "Scored"


def test_callable_objects_and_partials_are_refused_as_tools():
    class Tool:
        def __call__(self, expression: str) -> str:
            return expression

    for tool, kind in ((functools.partial(calculator), "functools.partial"), (Tool(), "Tool object")):
        with pytest.raises(ConfigError, match=f"is a {kind}, not a function") as e:
            EnvironmentFactory([tool], None)
        one_line(e.value)


class Raises:
    def reset(self, **row):
        raise KeyError("no such task")

    def noop(self) -> str:
        """Nothing."""
        return ""


class GivesDict:
    def reset(self, **row):
        return {"observation": "x"}

    def noop(self) -> str:
        """Nothing."""
        return ""


class BadReward(Scored):
    value: object = float("nan")

    def get_reward(self):
        return self.value


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (Raises, r"Raises\.reset\(\*\*row\) raised KeyError: 'no such task'"),
        (GivesDict, r"GivesDict\.reset\(\) returned dict; TRL's contract is None or a string"),
        (type("NaNReward", (BadReward,), {"value": float("nan")}), r"get_reward\(\) gave the reward nan"),
        (type("HugeReward", (BadReward,), {"value": 10**400}), r"get_reward\(\) gave the reward 1000"),
    ],
)
def test_environment_methods_breaking_their_contract_stop_with_one_line(qwen, env, says):
    run = runner(qwen, environment=env)
    script = lambda text: "done"  # noqa: E731
    with pytest.raises(EnvironmentContractError, match=says) as e:
        run.run(ScriptedEngine(qwen, script), batch(["q"]), 2, SAMPLING)
    one_line(e.value)


def test_episodes_of_one_prompt_from_different_conversations_stop_with_one_line(qwen):
    class Drifts(Scored):
        count = 0

        def reset(self, **row):
            Drifts.count += 1
            return f" #{Drifts.count}"

    with pytest.raises(EnvironmentContractError, match="different conversations") as e:
        runner(qwen, environment=Drifts).run(ScriptedEngine(qwen, lambda t: "x"), batch(["q"]), 2, SAMPLING)
    one_line(e.value)


class Surrogate:
    def reset(self, **row):
        pass

    def read(self) -> str:
        """Read a file."""
        return "bad \udcff byte"


def test_a_tool_returning_a_lone_surrogate_is_coerced_and_the_episode_goes_on(qwen):
    script = lambda text: call_text("read", {}) if "<tool_response>" not in text else "ok"  # noqa: E731
    _, r = runner(qwen, environment=Surrogate).run(ScriptedEngine(qwen, script), batch(["q"]), 1, SAMPLING)
    episode = r.episodes[0]
    assert episode.ended_by == "answer" and episode.messages[1]["content"] == "bad ? byte"


class Numbers:
    """The step form answering with non-text content (coerced with str())."""

    def reset(self, row):
        return None

    def step(self, messages):
        return [{"role": "user", "content": 42}], 0.0, len(messages) > 3


def test_step_messages_that_are_not_text_are_coerced(qwen):
    _, r = runner(qwen, environment=Numbers).run(
        ScriptedEngine(qwen, lambda t: "x"), batch(["q"]), 1, SAMPLING
    )
    assert r.episodes[0].messages[1] == {"role": "user", "content": "42"}
    assert r.episodes[0].ended_by == "done"


class Unrenderable:
    """Messages of a role the template cannot render, every time."""

    def reset(self, row):
        return None

    def step(self, messages):
        return [{"role": "critic", "content": "no"}], 0.0, False


def test_a_step_environment_the_template_cannot_render_stops_the_run_with_the_cause(qwen, monkeypatch):
    from grpo.agents import chat

    def refuse(self, history, messages):
        raise ValueError(f"role {messages[0]['role']} is not supported")

    monkeypatch.setattr(chat.ChatRenderer, "injected_ids", refuse)
    with pytest.raises(EnvironmentContractError, match=r"cannot render it \(ValueError: role critic") as e:
        runner(qwen, environment=Unrenderable).run(
            ScriptedEngine(qwen, lambda t: "x"), batch(["q"]), 2, SAMPLING
        )
    one_line(e.value)


# -- lifecycle ---------------------------------------------------------------------------------------------
class Closes(Scored):
    closed: typing.ClassVar[list] = []

    def close(self):
        Closes.closed.append(id(self))
        if len(Closes.closed) == 1:
            raise OSError("the first close fails")


def test_close_closes_every_instance_once_and_a_raising_close_is_logged(qwen, caplog):
    Closes.closed = []
    run = runner(qwen, environment=Closes)
    script = lambda text: "done"  # noqa: E731
    _, r = run.run(ScriptedEngine(qwen, script), batch(["a", "b"]), 2, SAMPLING)
    made = {id(e.environment) for e in r.episodes}
    with caplog.at_level(logging.WARNING, logger="grpo"):
        run.close()
    assert set(Closes.closed) == made and len(Closes.closed) == 4
    assert "Closes.close() raised OSError: the first close fails" in caplog.text
    run.close()
    assert len(Closes.closed) == 4  # closed once
    run.run(ScriptedEngine(qwen, script), batch(["a"]), 2, SAMPLING)  # still usable: fresh instances


def test_a_discarded_factory_closes_its_instances():
    import gc

    Closes.closed = []
    factory = EnvironmentFactory(None, Closes)
    del factory
    gc.collect()
    assert len(Closes.closed) == 2  # the two start-up instances


def test_each_user_form_has_one_adapter():
    assert adapter_for(None) is ENVIRONMENTS["tools"]
    assert adapter_for(Numbers) is ENVIRONMENTS["step"]
    assert adapter_for(Scored) is ENVIRONMENTS["trl"]
    assert adapter_for(int) is None


def test_a_new_environment_form_is_one_adapter_and_one_registry_line(qwen, monkeypatch):
    """A form the loop has never seen: `respond(text) -> str | None` (None ends the episode)."""

    class Respond:
        name, tools = "Echoer", {}

        def __init__(self, instance, tools=None):
            self.instance = instance

        @classmethod
        def accepts(cls, target):
            return hasattr(target, "respond")

        @staticmethod
        def tool_names(target):
            return []

        @staticmethod
        def gives_reward(target):
            return False

        @classmethod
        def check(cls, target, has_tools):
            pass

        @staticmethod
        def reset_arguments(row):
            return (), {}

        def start(self, messages, row):
            return messages

        def step(self, conversation, turn):
            answer = self.instance.respond(conversation[-1]["content"])
            return StepResult(
                [] if answer is None else [{"role": "user", "content": answer}], done=answer is None
            )

        def reward(self):
            return None

        def close(self):
            pass

    class Parrot:
        heard = 0

        def respond(self, text):
            self.heard += 1
            return None if self.heard > 1 else json.dumps(text)

    monkeypatch.setitem(ENVIRONMENTS, "respond", Respond)
    _, r = runner(qwen, environment=Parrot).run(
        ScriptedEngine(qwen, lambda t: "x"), batch(["q"]), 1, SAMPLING
    )
    assert [m["role"] for m in r.episodes[0].messages] == ["assistant", "user", "assistant"]


class Unpicklable(Scored):
    def __init__(self):
        self.lock = __import__("threading").Lock()


def test_under_ray_a_reward_reading_environments_that_cannot_travel_is_refused_saying_why(qwen):
    from grpo.rollout.ray import environments_travel

    def reads(completions, environments, **_):
        return [0.0] * len(completions)

    def ignores(completions, **_):
        return [0.0] * len(completions)

    assert environments_travel(runner(qwen, environment=Scored), [reads]) is True  # they pickle: they travel
    assert environments_travel(runner(qwen, environment=Unpicklable), [ignores]) is False
    with pytest.raises(
        ConfigError, match=r"reads `environments`.*Unpicklable instances cannot be sent back"
    ) as e:
        environments_travel(runner(qwen, environment=Unpicklable), [reads])
    one_line(e.value)
