"""User code in an episode runs in worker processes with the guarantees rewards have (issue 32 §1): a time
limit that holds in C code holding the GIL, a stop signal honoured within the grace, a clean error for
os._exit, and answers read as soon as they are complete."""

from __future__ import annotations

import os
import re
import time

import pytest

from grpo.agents.tools import tool_schema
from grpo.agents.workers import CallTimedOut, WorkerDied, remote_class, remote_tools
from grpo.rewards import isolation
from grpo.rewards.isolation import RewardInterrupted, call_in_child, can_fork

pytestmark = pytest.mark.skipif(not can_fork(), reason="worker processes need fork (Linux)")

CATASTROPHIC = re.compile(r"(a+)+$")


class Counter:
    """A TRL-style environment."""

    def __init__(self):
        self.total = 0

    def reset(self, **row):
        self.total = int(row.get("start", 0))
        return f" Start at {self.total}."

    def add(self, amount: int) -> str:
        """Add to the running total.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return str(self.total)

    def grep(self, text: str) -> str:
        """Match a pattern.

        Args:
            text: The text.
        """
        return str(bool(CATASTROPHIC.match(text)))

    def leave(self) -> str:
        """Exit at once."""
        os._exit(7)

    def pid(self) -> int:
        """The process it runs in."""
        return os.getpid()


def test_an_environment_instance_keeps_its_state_in_its_own_process():
    remote = remote_class(Counter, timeout=10)
    env = remote()
    assert remote.__name__ == "Counter" and env.reset(start=3) == " Start at 3."
    assert env.add(amount=4) == "7" and env.add(5) == "12" and env.total == 12
    assert env.pid() != os.getpid()
    # The tool schema the model reads is the user's method's.
    assert tool_schema(env.add) == tool_schema(Counter().add)
    with pytest.raises(TypeError):  # what the method raises comes back as it was raised
        env.add(amount="x")
    assert env.total == 12
    env._end()


def test_a_tool_stuck_in_c_holding_the_gil_is_killed_at_its_limit():
    env = remote_class(Counter, timeout=1.0)()
    env.reset()
    started = time.monotonic()
    with pytest.raises(CallTimedOut, match="grep did not finish within 1 s"):
        env.grep("a" * 40 + "b")
    assert time.monotonic() - started < 10  # the limit is 1 s; a loaded machine is slow to fork
    with pytest.raises(WorkerDied, match="state is gone until the next episode's reset"):
        env.add(1)
    assert env.reset(start=1) == " Start at 1." and env.add(1) == "2"  # a fresh process and instance
    env._end()


def test_os_exit_in_a_tool_is_a_clean_error_naming_the_exit_code():
    env = remote_class(Counter, timeout=5)()
    env.reset()
    with pytest.raises(WorkerDied, match="exited with code 7"):
        env.leave()


def test_a_stop_signal_ends_a_long_call_within_the_grace(monkeypatch):
    monkeypatch.setattr(isolation, "STOP_GRACE_S", 0.3)
    env = remote_class(Counter, timeout=600)()
    env.reset()
    isolation.request_stop()
    try:
        started = time.monotonic()
        with pytest.raises(RewardInterrupted):
            env.grep("a" * 60 + "b")
        assert time.monotonic() - started < 10  # the grace is 0.3 s, the limit 600 s
    finally:
        isolation.clear_stop()


def test_a_factory_that_raises_is_reported_at_once():
    def broken():
        raise RuntimeError("no database")

    with pytest.raises(RuntimeError, match="no database"):
        remote_class(Counter, make=broken, timeout=5)()


def calculator(expression: str) -> str:
    """Evaluate.

    Args:
        expression: The expression.
    """
    if expression == "exit":
        os._exit(3)
    if expression == "regex":
        return str(bool(CATASTROPHIC.match("a" * 40 + "b")))
    return f"{eval(expression, {'__builtins__': {}})}:{os.getpid()}"


def test_stateless_tools_run_in_a_reused_pool_of_workers():
    tools = remote_tools({"calculator": calculator}, timeout=1.0)
    calc = tools["calculator"]
    assert tool_schema(calc) == tool_schema(calculator)
    first, pid = calc(expression="2+3").split(":")
    assert first == "5" and int(pid) != os.getpid()
    assert calc(expression="1+1").split(":")[1] == pid  # the same worker, no new fork
    with pytest.raises(ZeroDivisionError):
        calc(expression="1/0")
    with pytest.raises(WorkerDied, match="exited with code 3"):
        calc(expression="exit")
    with pytest.raises(CallTimedOut):
        calc(expression="regex")
    assert calc(expression="4*4").startswith("16:")


def quick_reward_leaving_a_grandchild(prompts, completions, **kwargs):
    if os.fork() == 0:  # a grandchild that keeps the result pipe open for 30 s
        time.sleep(30)
        os._exit(0)
    return [1.0] * len(completions)


def test_a_reward_answer_is_read_as_soon_as_it_is_complete():
    started = time.monotonic()
    args = {"prompts": ["p"], "completions": ["c"]}
    kind, value = call_in_child(quick_reward_leaving_a_grandchild, args, 20)
    assert (kind, value) == ("value", [1.0]) and time.monotonic() - started < 10


# -- through the episode loop ----------------------------------------------------------------------------
def hanging_regex(text: str) -> str:
    """Match a pattern.

    Args:
        text: The text.
    """
    return str(bool(CATASTROPHIC.match("a" * 40 + "b")))


def exiting(text: str) -> str:
    """Exit at once.

    Args:
        text: The text.
    """
    os._exit(7)


def episodes(factory, script, questions, n=1, **columns):
    from grpo.agents import HermesParser
    from grpo.config import DataConfig
    from grpo.data import PromptFormatter
    from grpo.rollout.multi_turn import EpisodeLimits, MultiTurn
    from tests.chat_templates import family_tokenizer
    from tests.unit.test_episodes import SAMPLING, ScriptedEngine, batch

    qwen = family_tokenizer("qwen2.5")
    formatter = PromptFormatter(qwen, DataConfig(max_prompt_length=4096))
    run = MultiTurn(factory, formatter, HermesParser(), EpisodeLimits(3, 2000, 200), tool_timeout_s=1.0)
    return run.run(ScriptedEngine(qwen, script), batch(questions, **columns), n, SAMPLING)[1]


def call_once(name, arguments):
    from tests.unit.test_episodes import call_text

    return lambda seen: call_text(name, arguments) if "<tool_response>" not in seen else "Done."


@pytest.mark.parametrize(
    ("tool", "says"),
    [
        (hanging_regex, "did not finish within 1 s"),
        (exiting, "raised WorkerDied: exiting: its process exited with code 7"),
    ],
)
def test_a_hanging_or_exiting_tool_is_a_message_and_the_episode_goes_on(tool, says):
    from grpo.agents.factory import EnvironmentFactory
    from grpo.agents.workers import isolate_factory

    factory = EnvironmentFactory([tool])
    isolate_factory(factory, ["by.path:tool"], None, "auto", 1.0)
    started = time.monotonic()
    r = episodes(factory, call_once(tool.__name__, {"text": "x"}), ["Go."], n=2)
    assert time.monotonic() - started < 20
    assert all(e.ended_by == "answer" for e in r.episodes)
    assert says in r.episodes[0].messages[1]["content"]


def test_an_isolated_environment_gives_the_rewards_the_in_process_one_gives():
    from grpo.agents.factory import EnvironmentFactory
    from grpo.agents.workers import isolate_factory
    from tests.unit.test_episodes import Counter as TrlCounter
    from tests.unit.test_episodes import call_text

    def script(seen):
        return call_text("add", {"amount": 5}) if "<tool_response>" not in seen else "Done."

    plain = episodes(EnvironmentFactory(None, TrlCounter), script, ["Count.", "Count."], 2, target=[5, 7])
    factory = EnvironmentFactory(None, TrlCounter)
    isolate_factory(factory, [], "tests.unit.test_episodes:Counter", "auto", 5.0)
    isolated = episodes(factory, script, ["Count.", "Count."], 2, target=[5, 7])
    assert [e.env_reward for e in isolated.episodes] == [e.env_reward for e in plain.episodes] == [1, 1, 0, 0]
    assert [e.messages for e in isolated.episodes] == [e.messages for e in plain.episodes]
    assert isolated.episodes[0].environment.total == 5  # reward functions read the instance's state


def test_python_objects_stay_in_process_under_auto():
    from grpo.agents.factory import EnvironmentFactory
    from grpo.agents.workers import isolate_factory

    factory = EnvironmentFactory([calculator])
    isolate_factory(factory, [calculator], None, "auto", 1.0)
    assert factory.fixed_tools["calculator"] is calculator


def test_an_isolated_factory_travels_to_a_ray_actor_and_forks_its_own_workers_there():
    cloudpickle = pytest.importorskip("cloudpickle")
    from grpo.agents.calculator import calculator as calc
    from grpo.agents.factory import EnvironmentFactory
    from grpo.agents.workers import isolate_factory
    from tests.unit.test_episodes import Counter as TrlCounter

    factory = EnvironmentFactory([calc], TrlCounter)
    isolate_factory(
        factory, ["grpo.agents.calculator:calculator"], "tests.unit.test_episodes:Counter", "auto", 5
    )
    assert factory.fixed_tools["calculator"](expression="2*3") == "6"
    copy = cloudpickle.loads(cloudpickle.dumps(factory))
    assert copy.fixed_tools["calculator"](expression="2*4") == "8"
    env = copy.make({"prompt": "Count.", "target": 3}, 0)
    assert env.start([{"role": "user", "content": "Count."}], {"prompt": "Count.", "target": 3})[-1][
        "content"
    ].endswith("Reach 3.")


def test_a_pool_worker_outlives_the_thread_whose_call_forked_it():
    import threading

    calc = remote_tools({"calculator": calculator}, timeout=5.0)["calculator"]
    answers = []
    first = threading.Thread(target=lambda: answers.append(calc(expression="1+1")))
    first.start()
    first.join()
    time.sleep(0.3)  # a parent-death signal tied to that thread would have killed the worker by now
    second = threading.Thread(target=lambda: answers.append(calc(expression="2+2")))
    second.start()
    second.join()
    assert [a.split(":")[0] for a in answers] == ["2", "4"]
    assert answers[0].split(":")[1] == answers[1].split(":")[1]  # the same worker answered both
