"""A plain openai-python agent for grpo's bundled `tiny_tools` task: an agent you already have, trained as is.

It asks the model the row's question with one tool, the calculator, runs the calculator itself when the
model calls it, sends the result back, and stops at the model's answer (at most MAX_TURNS model calls).
Nothing in it knows about training: pointed at OpenAI or any compatible server, it runs the same.

Three ways to use it:

    grpo train --config tiny_tools_agent                                  # the preset: this agent, in process
    grpo train --config tiny_tools_agent --agent examples/tiny_tools_agent.py:run_responses   # Responses API
    grpo train --config tiny_tools_agent --agent-command "python examples/tiny_tools_agent.py"  # a subprocess

In process, grpo calls `run(client, row)` (or `run_responses`) with an `openai.OpenAI` client whose base URL
and key address this episode's session. As a command, it reads the row as JSON on stdin and makes its own
client from OPENAI_BASE_URL / OPENAI_API_KEY. Either way it gives no reward (returns None; as a command it
prints nothing): the run's reward functions (gsm8k_correctness, gsm8k_format) score the conversation, as
they score the in-process `tools=` episodes of the `tiny_tools` preset.

What the model sees is what those episodes show it: the same calculator schema (`tool_schema`, transformers'
`get_json_schema` of grpo.agents.calculator), the question as the user message, the calculator's result (or
its error as "calculator raised ...") as the tool message.
"""

from __future__ import annotations

import json
import sys

from openai import OpenAI

from grpo.agents.calculator import calculator
from grpo.agents.tools import tool_schema

MAX_TURNS = 4  # model calls per episode, as env.max_turns of the tiny_tools preset
MODEL = "policy"  # grpo's gateway serves the policy being trained under any name
TOOLS = [tool_schema(calculator)]  # {"type": "function", "function": {"name", "description", "parameters"}}


def use_tool(name: str, arguments: str) -> str:
    """The tool message for one call: the calculator's value, or what went wrong, for the model to read."""
    if name != "calculator":
        return f"unknown tool '{name}'; the tools are: calculator."
    try:
        args = json.loads(arguments)
    except ValueError:
        return "bad arguments for calculator: not JSON; call it as calculator(expression: string)."
    if not isinstance(args, dict) or set(args) != {"expression"}:
        return (
            "bad arguments for calculator: give 'expression' only; call it as calculator(expression: string)."
        )
    try:
        return calculator(**args)
    except Exception as err:  # noqa: BLE001 - the model reads the failure, as in grpo's own ToolBox
        return f"calculator raised {type(err).__name__}: {err}"


def question(row: dict) -> list[dict]:
    """The row's prompt as the opening messages (a dataset may give text or chat messages)."""
    prompt = row.get("prompt", row.get("question"))
    return (
        [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    )


def run(client: OpenAI, row: dict) -> None:
    """One episode over chat completions; returns None: the run's reward functions score it."""
    messages = question(row)
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the assistant turn exactly as returned
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            content = use_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return None


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's flat tool shape


def run_responses(client: OpenAI, row: dict) -> None:
    """The same episode over the Responses API (what agent SDKs use by default)."""
    items: list = question(row)
    for _ in range(MAX_TURNS):
        response = client.responses.create(model=MODEL, input=items, tools=RESPONSES_TOOLS)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        items += [
            {"type": "function_call_output", "call_id": c.call_id, "output": use_tool(c.name, c.arguments)}
            for c in calls
        ]
    return None


def main() -> None:
    """`--agent-command` form: the row on stdin, the session from OPENAI_BASE_URL / OPENAI_API_KEY."""
    row = json.load(sys.stdin)
    client = OpenAI(max_retries=0)
    try:
        (run_responses if "--responses" in sys.argv[1:] else run)(client, row)
    finally:
        client.close()


if __name__ == "__main__":
    main()
