"""A plain agent for grpo's bundled `tiny_tools` task: an agent you already have, trained as it is.

It asks the model the row's question with one tool, a calculator, runs the calculator itself when the model
calls it, sends the result back, and stops at the model's answer (at most MAX_TURNS model calls). Nothing in
it knows about training: pointed at OpenAI or any compatible server, it runs the same.

    grpo train --config tiny_tools_agent                        # `run` in grpo's process (the preset)
    grpo train --config tiny_tools_agent --agent examples/tiny_tools_agent.py:run_responses
    grpo train --config tiny_tools_agent --agent-command "python examples/tiny_tools_agent.py"

In process, grpo calls `run(client, row)` (or `run_responses`) with an `openai.OpenAI` client whose base URL
and key address this episode's session. As a command, it reads the row as JSON on stdin and talks to
OPENAI_BASE_URL with OPENAI_API_KEY: by default over plain HTTP with the standard library, because importing
the `openai` package costs a process about 1.5 s of CPU, which at 128 episodes a step would outweigh the
training; `--openai` (chat completions) or `--responses` (the Responses API) use the `openai` client instead,
and `--offline` is the control (the calculator never answers, as in `run_offline`).
Either way it gives no reward (returns None, prints nothing): the run's reward functions (gsm8k_correctness,
gsm8k_format) score the conversation it had, as they score the `tools=` episodes of the `tiny_tools` preset.

What the model sees is what those episodes show it: the same calculator schema (TOOLS is what transformers'
`get_json_schema` makes of grpo.agents.calculator, tested), the question as the user message, the result
(or the error as "calculator raised ...") as the tool message.
"""

from __future__ import annotations

import ast
import http.client
import json
import operator
import os
import sys
import urllib.parse
from collections.abc import Callable
from fractions import Fraction

MAX_TURNS = 4  # model calls per episode, as env.max_turns of the tiny_tools preset
MODEL = "policy"  # grpo's gateway serves the policy being trained under any name
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return "
            "its value.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'The arithmetic expression to evaluate, e.g. "347*28" or "(12+5)*3".',
                    }
                },
                "required": ["expression"],
            },
            "return": {
                "type": "string",
                "description": 'The value of the expression as a string, e.g. "9716".',
            },
        },
    }
]

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % ** and parentheses, nothing else."""

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError(f"exponent {right} too large (at most 100)")
            return Fraction(_OPERATORS[type(node.op)](left, right))
        raise ValueError(f"only numbers, + - * / // % ** and ( ) are allowed, not {type(node).__name__}")

    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression.strip()!r}") from None
    result = value(tree.body)
    if result.denominator == 1:
        return str(result.numerator)
    return f"{float(result):.10f}".rstrip("0")


def use_tool(name: str, arguments: str, offline: bool = False) -> str:
    """The tool message for one call: the calculator's value, or what went wrong, for the model to read.
    `offline`: the demo's control, a calculator that never answers (as grpo.agents.calculator's
    offline_calculator words it)."""
    if name != "calculator":
        return f"unknown tool '{name}'; the tools are: calculator."
    try:
        args = json.loads(arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict) or set(args) != {"expression"}:
        return "bad arguments for calculator: call it as calculator(expression: string)."
    if offline:
        expression = args["expression"]
        return f"calculator raised RuntimeError: the calculator is offline; {expression!r} was not evaluated"
    try:
        return calculator(args["expression"])
    except (ValueError, ArithmeticError) as err:
        return f"calculator raised {type(err).__name__}: {err}"


def opening(row: dict) -> list[dict]:
    """The row's prompt as the first messages (a dataset gives text or chat messages)."""
    prompt = row.get("prompt", row.get("question"))
    if isinstance(prompt, list):
        return [dict(m) for m in prompt]
    return [{"role": "user", "content": str(prompt)}]


def episode(ask: Callable[[list[dict]], dict], row: dict, offline: bool = False) -> list[dict]:
    """The agent's loop over chat messages; `ask(messages)` is one model call, the assistant message back."""
    messages = opening(row)
    for _ in range(MAX_TURNS):
        message = ask(messages)
        messages.append(message)  # the assistant turn exactly as the server returned it
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            content = use_tool(call["function"]["name"], call["function"]["arguments"], offline)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return messages


def run(client, row: dict, offline: bool = False) -> None:
    """One episode with an `openai.OpenAI` client (chat completions); the run's reward functions score it."""

    def ask(messages: list[dict]) -> dict:
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        return reply.choices[0].message.model_dump(exclude_none=True)

    episode(ask, row, offline)


def run_offline(client, row: dict) -> None:
    """The control: the same agent and tool schema, but the calculator never answers
    (`--agent examples/tiny_tools_agent.py:run_offline`). What a model learns with it, it learns without."""
    run(client, row, offline=True)


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's flat tool shape


def run_responses(client, row: dict) -> None:
    """The same episode over the Responses API (what agent SDKs use by default)."""
    items: list = opening(row)
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


def http_ask(base_url: str, api_key: str, timeout_s: float = 300.0) -> Callable[[list[dict]], dict]:
    """`ask` over plain HTTP (http.client: the lightest import): POST {base_url}/chat/completions, as any
    OpenAI-compatible client does, on one kept-alive connection for the episode."""
    url = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}

    def ask(messages: list[dict]) -> dict:
        body = json.dumps({"model": MODEL, "messages": messages, "tools": TOOLS})
        connection.request("POST", f"{url.path.rstrip('/')}/chat/completions", body, headers)
        reply = connection.getresponse()
        data = json.loads(reply.read())
        if reply.status != 200:
            raise RuntimeError(f"the server answered {reply.status}: {data.get('error', data)}")
        return data["choices"][0]["message"]

    return ask


def main(argv: list[str]) -> None:
    """The `--agent-command` form: the row on stdin, the session from OPENAI_BASE_URL / OPENAI_API_KEY."""
    row = json.load(sys.stdin)
    if "--openai" in argv or "--responses" in argv:
        from openai import OpenAI

        with OpenAI(max_retries=0) as client:
            (run_responses if "--responses" in argv else run)(client, row)
    else:
        ask = http_ask(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
        episode(ask, row, offline="--offline" in argv)


if __name__ == "__main__":
    main(sys.argv[1:])
