"""Tools run concurrently with a time limit; every failure is a message for the model, never a crash."""

import asyncio
import threading
import time
from typing import Literal

import pytest

from grpo.agents import ParsedTurn, ToolBox, ToolCall, ToolResult, tool_schema
from grpo.agents import tools as tools_module
from grpo.config import ConfigError


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "12 * 34"
    """
    return str(eval(expression, {"__builtins__": {}}))  # test double: trusted input only


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "slept"


def rounded(
    value: float, digits: int, mode: Literal["half_up", "even"] = "even", tags: list[int] | None = None
):
    """Round a number.

    Args:
        value: the number
        digits: how many decimals
        mode: the rounding rule
        tags: labels
    """
    return {"value": round(value, digits), "mode": mode}


def big(n: int) -> str:
    """Write n characters.

    Args:
        n: how many
    """
    return "x" * n


RELEASE = threading.Event()  # hanging tools wait on it; the fixture below lets them go after each test


def hang(note: str) -> str:
    """Never return (until the test ends).

    Args:
        note: ignored
    """
    RELEASE.wait()
    return note


async def async_nap(seconds: float) -> dict:
    """Sleep asynchronously.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return {"slept": seconds}


@pytest.fixture(autouse=True)
def release_hung_threads():
    RELEASE.clear()
    yield
    RELEASE.set()
    for thread in list(tools_module._abandoned):
        thread.join(timeout=5)
    assert tools_module._still_abandoned() == 0


def turn(*calls: ToolCall, errors=(), positions=()) -> ParsedTurn:
    return ParsedTurn("", list(calls), list(errors), list(positions))


def test_tool_schema_is_transformers_and_undescribable_tools_are_refused():
    assert tool_schema(calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": 'the expression, e.g. "12 * 34"'}
                },
                "required": ["expression"],
            },
            "return": {"type": "string"},
        },
    }

    def undocumented(x: int) -> int:
        return x

    def untyped(x):
        """Echo.

        Args:
            x: anything
        """

    with pytest.raises(ConfigError, match=r"^tool .*undocumented cannot be described .*has no docstring"):
        tool_schema(undocumented)
    with pytest.raises(ConfigError, match=r"^tool .*untyped cannot be .*Argument x is missing a type hint"):
        tool_schema(untyped)
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        ToolBox([calculator, calculator])


def test_schemas_of_bound_methods_are_computed_once_per_function(monkeypatch):
    class Env:
        def look(self, direction: str) -> str:
            """Look around.

            Args:
                direction: where
            """
            return direction

    described = []
    real = tools_module.get_json_schema
    monkeypatch.setattr(tools_module, "get_json_schema", lambda fn: described.append(fn) or real(fn))
    boxes = [ToolBox([Env().look]) for _ in range(5)]  # one environment instance per episode
    assert len(described) == 1
    assert boxes[0].schemas == boxes[4].schemas and boxes[0].schemas[0] is not boxes[4].schemas[0]
    assert boxes[0].schemas[0]["function"]["parameters"]["required"] == ["direction"]  # no "self"


def test_schemas_in_order_and_dict_names():
    box = ToolBox({"calc": calculator, "sleep": nap})
    assert box.names == ["calc", "sleep"]
    assert [s["function"]["name"] for s in box.schemas] == ["calc", "sleep"]
    assert box.run([turn(ToolCall("calc", {"expression": "12 * 34"}))])[0][0].content == "408"


def test_results_in_call_order_with_every_error_kind():
    box = ToolBox([calculator, rounded])
    malformed = "tool call 2 is not valid JSON: Expecting value (char 0); write <tool_call>...</tool_call>"
    results = box.run(
        [
            turn(
                ToolCall("calculator", {"expression": "12 * 34"}),
                ToolCall("calculator", {"expression": "1 / 0"}),
                ToolCall("search", {"query": "x"}),
                errors=[malformed],
                positions=[1],
            ),
            turn(
                ToolCall("rounded", {"value": 2.345, "digits": 1}),
                ToolCall("rounded", {"value": 2.345}),
                ToolCall("rounded", {"value": 2.345, "digits": 1, "precision": 3}),
                ToolCall("rounded", {"value": "2.3", "digits": 1}),
                ToolCall("rounded", {"value": 2.3, "digits": True}),
                ToolCall("rounded", {"value": 2, "digits": 1, "mode": "up"}),
                ToolCall("rounded", {"value": 2, "digits": 1, "tags": [1, "a"]}),
                ToolCall("rounded", {"value": 2, "digits": 0, "tags": None}),
            ),
        ]
    )
    assert [(r.error, r.content) for r in results[0]] == [
        (None, "408"),
        ("malformed", malformed),
        ("raised", "calculator raised ZeroDivisionError: division by zero"),
        ("unknown_tool", "unknown tool 'search'; the tools are: calculator, rounded."),
    ]
    assert results[0][1].call is None and results[0][0].call == ToolCall(
        "calculator", {"expression": "12 * 34"}
    )
    usage = "; call it as rounded(value: number, digits: integer, mode: string, tags: array)."
    assert [(r.error, r.content) for r in results[1]] == [
        (None, '{"value": 2.3, "mode": "even"}'),  # a dict result is written as JSON
        ("bad_arguments", "bad arguments for rounded: missing required argument 'digits'" + usage),
        ("bad_arguments", "bad arguments for rounded: unexpected argument 'precision'" + usage),
        (
            "bad_arguments",
            "bad arguments for rounded: argument 'value' must be a number, not a string" + usage,
        ),
        (
            "bad_arguments",
            "bad arguments for rounded: argument 'digits' must be an integer, not a boolean" + usage,
        ),
        (
            "bad_arguments",
            'bad arguments for rounded: argument \'mode\' must be one of ["half_up", "even"]' + usage,
        ),
        (
            "bad_arguments",
            "bad arguments for rounded: argument 'tags' item 1 must be an integer, not a string" + usage,
        ),
        (None, '{"value": 2, "mode": "even"}'),  # an Optional argument may be null
    ]


def test_megabyte_output_is_truncated_with_a_marker():
    (result,) = ToolBox([big], max_chars=4000).run([turn(ToolCall("big", {"n": 1_000_000}))])[0]
    assert result.error is None and result.truncated
    assert result.content == "x" * 4000 + "…[truncated 996,000 chars]"


def test_concurrent_calls_finish_in_about_one_sleep():
    box = ToolBox([nap])
    start = time.monotonic()
    results = box.run([turn(ToolCall("nap", {"seconds": 0.5})) for _ in range(8)])
    elapsed = time.monotonic() - start
    assert [r[0].content for r in results] == ["slept"] * 8
    assert 0.5 <= elapsed < 2.0, elapsed  # one after another would take 4 s


def test_a_hanging_tool_times_out_while_the_rest_of_the_batch_completes():
    box = ToolBox([hang, nap, calculator], timeout_s=0.5)
    start = time.monotonic()
    results = box.run(
        [
            turn(ToolCall("hang", {"note": "never"}), ToolCall("calculator", {"expression": "2 + 2"})),
            turn(ToolCall("nap", {"seconds": 0.2})),
        ]
    )
    elapsed = time.monotonic() - start
    timed_out, four = results[0]
    assert timed_out.error == "timeout"
    assert timed_out.content == "hang did not finish within 0.5 s; its result, if any, is lost."
    assert 0.5 <= timed_out.seconds < 1.5
    assert (four.content, results[1][0].content) == ("4", "slept")
    assert elapsed < 2.0, elapsed  # the limit, not the hung call, ends the batch
    # Its thread runs on (a thread cannot be killed), counted so that hung calls cannot pile up.
    assert tools_module._still_abandoned() == 1


def test_hung_threads_are_bounded_and_the_run_never_deadlocks():
    box = ToolBox([hang, calculator], timeout_s=0.2, max_workers=2)
    first = box.run([turn(ToolCall("hang", {"note": "a"})), turn(ToolCall("hang", {"note": "b"}))])
    assert [r[0].error for r in first] == ["timeout", "timeout"]
    start = time.monotonic()
    (refused,) = box.run([turn(ToolCall("calculator", {"expression": "1 + 1"}))])[0]
    assert time.monotonic() - start < 0.2  # refused at once, not queued behind the hung calls
    assert refused.error == "timeout"
    assert (
        refused.content
        == "calculator was not run: 2 earlier tool calls are still running past their 0.2 s limit."
    )
    RELEASE.set()
    for thread in list(tools_module._abandoned):
        thread.join(timeout=5)
    assert box.run([turn(ToolCall("calculator", {"expression": "1 + 1"}))])[0][0].content == "2"


def test_async_tools_run_and_are_cancelled_at_the_limit():
    box = ToolBox([async_nap], timeout_s=0.5)
    start = time.monotonic()
    quick, slow = box.run(
        [turn(ToolCall("async_nap", {"seconds": 0.1}), ToolCall("async_nap", {"seconds": 30}))]
    )[0]
    assert (quick.error, quick.content) == (None, '{"slept": 0.1}')
    assert slow.error == "timeout"
    assert time.monotonic() - start < 1.5
    time.sleep(0.3)  # the coroutine was cancelled just past the limit: its thread is gone
    assert tools_module._still_abandoned() == 0


def test_a_coroutine_cancelled_at_the_limit_reads_as_a_timeout_even_if_its_answer_comes_first():
    box = ToolBox([async_nap], timeout_s=0.5)
    call = ToolCall("async_nap", {"seconds": 30})
    # The order a loaded machine can give: the thread's TimeoutError arrives before the scheduler's sweep.
    assert box._finish(call, TimeoutError(), False, 0.55).error == "timeout"
    # A tool's own TimeoutError inside the limit is what it raised.
    assert box._finish(call, TimeoutError("upstream"), False, 0.1).content == (
        "async_nap raised TimeoutError: upstream"
    )


class Counter:
    """A stateful environment: each episode has its own instance; its methods are the tools."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, amount: int) -> int:
        """Add to the running total and return it.

        Args:
            amount: what to add
        """
        before = self.total
        time.sleep(0.2)  # a read-modify-write that concurrent calls would interleave
        self.total = before + amount
        return self.total


def test_in_episode_order_runs_one_episodes_calls_in_turn_and_episodes_together():
    envs = [Counter(), Counter()]
    boxes = [ToolBox([env.add], in_episode_order=True) for env in envs]
    start = time.monotonic()
    results = boxes[0].run(
        [turn(*(ToolCall("add", {"amount": k}) for k in (1, 2, 3))), turn(ToolCall("add", {"amount": 10}))],
        episode_tools=boxes,
    )
    elapsed = time.monotonic() - start
    assert [[r.content for r in episode] for episode in results] == [["1", "3", "6"], ["10"]]
    assert [env.total for env in envs] == [6, 10]
    assert 0.6 <= elapsed < 1.2, elapsed  # three calls in turn; the other episode alongside them


def test_tool_result_defaults():
    assert ToolResult(None, "x", "malformed") == ToolResult(None, "x", "malformed", False, 0.0)


def pick(choice: int | str) -> str:
    """Echo a choice.

    Args:
        choice: a number or a name
    """
    return f"picked {choice}"


def test_union_arguments_and_turns_without_error_positions():
    box = ToolBox([pick])
    results = box.run(
        [
            ParsedTurn("", [ToolCall("pick", {"choice": 2}), ToolCall("pick", {"choice": 1.5})], ["bad"]),
            turn(ToolCall("pick", {"choice": "b"})),
        ]
    )
    assert [(r.error, r.content) for r in results[0]] == [
        (None, "picked 2"),
        (
            "bad_arguments",
            "bad arguments for pick: argument 'choice' must be an integer or a string, not a number; "
            "call it as pick(choice: integer|string).",
        ),
        ("malformed", "bad"),  # no positions given: the malformed calls come last
    ]
    assert results[1][0].content == "picked b"
