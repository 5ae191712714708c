"""The agent workers' `openai` clients reach the gateway over gateway/transport.py's plain socket: the same
replies, streams and errors as over httpx's own transport, other URLs through httpx's transport."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from grpo.agents import HermesParser
from grpo.gateway.agent_pool import _Host
from grpo.gateway.server import GatewayServer
from grpo.gateway.service import Gateway
from grpo.gateway.sessions import Session
from grpo.gateway.transport import GatewayTransport, agent_http_client
from tests import gateway_agents as agents
from tests.chat_templates import family_tokenizer
from tests.unit.test_episodes import ScriptedEngine, calls_then_answers
from tests.unit.test_gateway import LIMITS, SAMPLING

QUESTION = [{"role": "user", "content": "What is 12 * 34?"}]


@pytest.fixture(scope="module")
def served():
    qwen = family_tokenizer("qwen2.5")
    gateway = Gateway(qwen, HermesParser(), LIMITS, ScriptedEngine(qwen, calls_then_answers), SAMPLING)
    server = GatewayServer(gateway, max_body=10_000)
    yield gateway, server
    server.close()
    gateway.batcher.close()


def _episode(gateway, server, http: httpx.Client, stream: bool) -> list:
    """A calculator episode's two calls; what the client read of each."""
    s = gateway.sessions.add(Session(0, 0, {}))
    client = openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)
    messages, out = list(QUESTION), []
    for _ in range(2):
        if stream:
            chunks = client.chat.completions.create(
                model="m",
                messages=messages,
                tools=agents.TOOLS,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c.model_dump(exclude={"id", "created"}) for c in chunks]
            out.append(chunks)
            calls = [
                tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []
            ]
        else:
            r = client.chat.completions.create(model="m", messages=messages, tools=agents.TOOLS)
            out.append(r.model_dump(exclude={"id", "created"}))
            calls = [tc.model_dump() for tc in r.choices[0].message.tool_calls or []]
        if not calls:
            break
        call = calls[0]
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": "calculator", "arguments": call["function"]["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "408"},
        ]
    s.end("answer")
    gateway.sessions.remove([s])
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_replies_over_the_gateway_transport_are_httpxs(served, stream):
    gateway, server = served
    with agent_http_client(server.base_url) as ours, httpx.Client(timeout=None) as theirs:
        assert isinstance(ours._transport, GatewayTransport)
        got, expected = _episode(gateway, server, ours, stream), _episode(gateway, server, theirs, stream)
    assert got == expected and len(got) == 2  # a tool call, then the answer


def test_errors_over_the_gateway_transport_are_the_clients_usual_ones(served):
    gateway, server = served
    with agent_http_client(server.base_url) as http:
        client = openai.OpenAI(
            base_url=server.base_url, api_key="sk-not-a-session", max_retries=0, http_client=http
        )
        with pytest.raises(openai.AuthenticationError, match="episode's own key"):
            client.chat.completions.create(model="m", messages=QUESTION)
        s = gateway.sessions.add(Session(0, 0, {}))
        s.end("timeout")
        client = openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)
        with pytest.raises(openai.ConflictError):
            client.chat.completions.create(model="m", messages=QUESTION)
        gateway.sessions.remove([s])
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with agent_http_client(f"http://127.0.0.1:{port}/v1") as http:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, http_client=http
        )
        with pytest.raises(openai.APIConnectionError):
            client.models.list()


def test_other_urls_go_through_httpxs_transport():
    seen = []

    class Fallback(httpx.BaseTransport):
        def handle_request(self, request):
            seen.append(str(request.url))
            return httpx.Response(200, json={"ok": True})

    transport = GatewayTransport("127.0.0.1", 9, fallback=Fallback())
    with httpx.Client(transport=transport) as http:
        for url in ("https://127.0.0.1:9/v1/models", "http://localhost:9/v1/models", "http://127.0.0.1:10/x"):
            assert http.get(url).json() == {"ok": True}
    assert len(seen) == 3


def test_an_agent_workers_clients_use_the_gateway_transport(served, monkeypatch):
    _, server = served
    monkeypatch.setattr("grpo.gateway.agent_pool.gc.freeze", lambda: None)  # a worker's, not this process's
    host = _Host(lambda client, row: None, False, 60.0, ())
    host.start(server.base_url, [], float("inf"))
    assert isinstance(host._http._transport, GatewayTransport)
    first = host._http
    host.start(server.base_url, [], float("inf"))
    assert host._http is first  # kept across steps
    host._http.close()
