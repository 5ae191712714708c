"""Agents as users write them, over the real `openai` client: the gateway tests drive episodes with these
(`grpo train --agent tests/gateway_agents.py:calculator_agent` end to end)."""

from __future__ import annotations

import json
import threading

from transformers.utils import get_json_schema

from grpo.agents.calculator import calculator

TOOLS = [get_json_schema(calculator)]


def opening(row: dict) -> list[dict]:
    prompt = row["prompt"]
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def run_tools(messages: list, calls) -> None:
    for call in calls:
        result = calculator(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def calculator_agent(client, row: dict):
    """A plain tool loop: ask, run the calculator on every call, until the model answers."""
    messages = opening(row)
    for _ in range(8):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=64)
        message = reply.choices[0].message
        messages.append(message)
        if reply.choices[0].finish_reason != "tool_calls":
            return None
        run_tools(messages, message.tool_calls)
    return None


def streaming_agent(client, row: dict):
    """The same loop, every call streamed; the reply is reassembled from the chunks."""
    messages = opening(row)
    for _ in range(8):
        content, calls, finish = "", {}, None
        stream = client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(
                    tc.index, {"id": tc.id, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["function"]["name"] += tc.function.name or ""
                slot["function"]["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        messages.append(message)
        if finish != "tool_calls":
            return None
        for call in message["tool_calls"]:
            result = calculator(**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None


async def async_agent(client, row: dict):
    messages = opening(row)
    for _ in range(8):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        if reply.choices[0].finish_reason != "tool_calls":
            return 1.0
        run_tools(messages, message.tool_calls)
    return 1.0


def rewarding_agent(client, row: dict):
    calculator_agent(client, row)
    return 0.5 if "12" in str(row["prompt"]) else 0.25


def posting_agent(client, row: dict):
    import httpx

    calculator_agent(client, row)
    url = str(client.base_url).rstrip("/") + "/reward"
    httpx.post(
        url, json={"reward": 0.75}, headers={"Authorization": f"Bearer {client.api_key}"}
    ).raise_for_status()


def raising_agent(client, row: dict):
    client.chat.completions.create(model="policy", messages=opening(row))
    raise RuntimeError("the agent's own bug")


# A thread cannot be stopped: a test that runs hanging_agent sets this at its end, so the agent's thread ends
# with the test instead of 30 s later, inside whichever test runs next.
RELEASE_HANGING = threading.Event()


def hanging_agent(client, row: dict):
    client.chat.completions.create(model="policy", messages=opening(row))
    RELEASE_HANGING.wait(30)


def silent_agent(client, row: dict):
    return 1.0


def rewriting_agent(client, row: dict):
    """Summarises its history before the second call: the second call starts a new row."""
    messages = opening(row)
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    summary = [
        {"role": "user", "content": f"{messages[-1]['content']} (you said: {first.content or 'a call'})"}
    ]
    client.chat.completions.create(model="policy", messages=summary, tools=TOOLS)
    return None
