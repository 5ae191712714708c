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
    assert time.monotonic() - started < 3
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
        assert time.monotonic() - started < 3
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
    assert (kind, value) == ("value", [1.0]) and time.monotonic() - started < 5
