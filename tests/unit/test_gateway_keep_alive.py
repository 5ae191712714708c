"""Keep-alive between an agent's calls: the server leaves a JSON reply's connection open, so a pooled client
(an agent worker's httpx pool, the openai client's own) sends its next call on it instead of connecting anew;
a reply after which the server cannot go on reading the connection says `Connection: close`, so no client
reuses it; GatewayServer.close() ends the connections kept open. Set by env.agent_keep_alive (on by default;
the runner's server; GatewayServer alone defaults to off); off, every reply closes its connection."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from grpo.agents import HermesParser
from grpo.gateway.server import GatewayServer
from grpo.gateway.service import Gateway
from grpo.gateway.sessions import Session
from tests import gateway_agents as agents
from tests.unit.test_episodes import ScriptedEngine, calls_then_answers
from tests.unit.test_gateway import LIMITS, SAMPLING, qwen  # noqa: F401 - the fixture
from tests.unit.test_gateway import served as served_plain  # noqa: F401 - the fixture


@pytest.fixture
def served(qwen):  # noqa: F811 - the fixture
    """The gateway with keep-alive on, as test_gateway's `served` otherwise."""
    gateway = Gateway(qwen, HermesParser(), LIMITS, ScriptedEngine(qwen, calls_then_answers), SAMPLING)
    server = GatewayServer(gateway, max_body=10_000, keep_alive=True)
    yield gateway, server
    server.close()
    gateway.batcher.close()


GOOD = {"model": "m", "messages": [{"role": "user", "content": "What is 12 * 34?"}]}


def _open_connections(server) -> int:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # a thread ending its connection removes it just after the reply
        with server.httpd._connections_lock:
            n = len(server.httpd.connections)
        if n <= 1:
            return n
        time.sleep(0.01)
    return n


def test_an_agents_calls_share_one_kept_connection(served):
    gateway, server = served
    with httpx.Client(timeout=30) as http:
        for _ in range(3):  # three episodes' clients on one pool, as in an agent worker
            s = gateway.sessions.add(Session(0, 0, {}))
            client = openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)
            raw = client.chat.completions.with_raw_response.create(**GOOD, tools=agents.TOOLS)
            assert raw.headers.get("connection", "").lower() != "close"
            assert raw.parse().choices[0].message.tool_calls
        assert _open_connections(server) == 1  # the one connection, still open: reused, not reconnected


def test_a_reply_that_ends_its_connection_says_so_and_the_next_call_connects_anew(served):
    gateway, server = served  # max_body=10_000: a larger body is refused unread (413)
    with httpx.Client(timeout=30) as http:
        s = gateway.sessions.add(Session(0, 0, {}))
        url, auth = f"{server.base_url}/chat/completions", {"Authorization": f"Bearer {s.key}"}
        big = json.dumps({**GOOD, "user": "x" * 20_000})
        refused = http.post(url, content=big, headers=auth)
        assert refused.status_code == 413 and refused.headers["connection"].lower() == "close"
        s = gateway.sessions.add(Session(0, 0, {}))
        ok = http.post(url, json=GOOD, headers={"Authorization": f"Bearer {s.key}"})
        assert ok.status_code == 200 and ok.headers.get("connection", "").lower() != "close"


def test_closing_the_server_ends_the_kept_connections(served):
    gateway, server = served
    with httpx.Client(timeout=30) as http:
        s = gateway.sessions.add(Session(0, 0, {}))
        client = openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)
        client.chat.completions.create(**GOOD)
        serving = [t for t in threading.enumerate() if "process_request" in t.name]
        assert _open_connections(server) == 1 and serving
        server.close()
        for t in serving:
            t.join(timeout=10)
        assert not [t for t in serving if t.is_alive()] and not server.httpd.connections


def test_without_the_switch_every_reply_closes_its_connection(served_plain):  # noqa: F811
    gateway, server = served_plain
    s = gateway.sessions.add(Session(0, 0, {}))
    with httpx.Client(timeout=30) as http:
        reply = http.post(
            f"{server.base_url}/chat/completions", json=GOOD, headers={"Authorization": f"Bearer {s.key}"}
        )
        assert reply.status_code == 200 and reply.headers["connection"].lower() == "close"
