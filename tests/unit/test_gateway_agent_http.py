"""The agents' shared HTTP client (gateway/agent_http.py): connections kept in a stack, so a step of many
concurrent agents reuses them, one closed by the server is replaced without an error, a reply that closes its
connection leaves none kept, and no cookie is kept."""

from __future__ import annotations

import threading

import httpx
import openai

from grpo.gateway.agent_http import agent_http_client
from grpo.gateway.sessions import Session
from tests import gateway_agents as agents
from tests.unit.test_gateway import qwen  # noqa: F401 - the fixture
from tests.unit.test_gateway import served as served_plain  # noqa: F401 - the fixture
from tests.unit.test_gateway_keep_alive import GOOD, served  # noqa: F401 - the fixture

AGENTS = 32  # concurrent agents in one worker, as 64 episodes on 2 workers


def _connections_opened(server) -> list[int]:
    """A counter of the connections the server accepts from now on."""
    count, original = [0], server.httpd.process_request

    def counted(request, client_address):
        count[0] += 1
        original(request, client_address)

    server.httpd.process_request = counted
    return count


def _wave(gateway, server, http, n: int) -> None:
    """`n` agents' first calls at once, each on its own episode's openai client over `http`."""
    sessions = [gateway.sessions.add(Session(k, k, {})) for k in range(n)]
    barrier = threading.Barrier(n)
    failures = []

    def one(s: Session) -> None:
        client = openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)
        barrier.wait()
        try:
            client.chat.completions.create(**GOOD, tools=agents.TOOLS)
        except Exception as err:  # noqa: BLE001 - reported below
            failures.append(err)

    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    for s in sessions:
        s.end("answer")
    gateway.sessions.remove(sessions)


def test_a_second_wave_of_concurrent_agents_reuses_the_first_waves_connections(served):  # noqa: F811
    gateway, server = served
    opened = _connections_opened(server)
    with agent_http_client() as http:
        _wave(gateway, server, http, AGENTS)
        first = opened[0]
        assert 1 <= first <= AGENTS
        _wave(gateway, server, http, AGENTS)
        _wave(gateway, server, http, AGENTS)
        assert opened[0] == first  # every later call on a connection the first wave opened
        assert len(http._transport._pool._idle) == first


def test_a_call_checks_one_kept_connection_not_all_of_them(served, monkeypatch):  # noqa: F811
    """What a call costs the client does not grow with the agents in its process: httpcore's pool checks every
    connection it holds (a poll syscall each) as each request starts and as each response closes."""
    import httpcore

    gateway, server = served
    checks, lock = [0], threading.Lock()
    has_expired = httpcore.HTTPConnection.has_expired

    def counted(self):
        with lock:
            checks[0] += 1
        return has_expired(self)

    for make in (
        agent_http_client,
        lambda: httpx.Client(timeout=None, limits=httpx.Limits(max_connections=None)),
    ):
        with make() as http:
            _wave(gateway, server, http, AGENTS)  # the connections opened
            monkeypatch.setattr(httpcore.HTTPConnection, "has_expired", counted)
            checks[0] = 0
            _wave(gateway, server, http, AGENTS)
            monkeypatch.setattr(httpcore.HTTPConnection, "has_expired", has_expired)
        if make is agent_http_client:
            assert checks[0] <= AGENTS  # the one connection each call takes
        else:  # the control: httpx's default pool
            assert checks[0] > 4 * AGENTS


def _episode_client(gateway, server, http) -> openai.OpenAI:
    """An episode's openai client on the shared `http`, with its own session key."""
    s = gateway.sessions.add(Session(0, 0, {}))
    return openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)


def test_a_connection_the_server_closed_is_replaced_without_an_error(served):  # noqa: F811
    gateway, server = served
    opened = _connections_opened(server)
    with agent_http_client() as http:
        client = _episode_client(gateway, server, http)
        client.chat.completions.create(**GOOD)
        server.httpd.close_connections()  # every kept connection ended by the server
        client.chat.completions.create(**GOOD, tools=agents.TOOLS)
        assert opened[0] == 2


def test_without_keep_alive_each_call_connects_and_nothing_is_kept(served_plain):  # noqa: F811
    gateway, server = served_plain
    opened = _connections_opened(server)
    with agent_http_client() as http:
        client = _episode_client(gateway, server, http)
        for _ in range(3):
            client.chat.completions.create(**GOOD, tools=agents.TOOLS)
        assert opened[0] == 3 and not http._transport._pool._idle


def test_no_cookie_is_kept_between_episodes():
    with agent_http_client() as http:
        request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
        reply = httpx.Response(200, headers={"Set-Cookie": "episode=1; Path=/"}, request=request)
        http.cookies.extract_cookies(reply)
        assert not list(http.cookies.jar)


def test_streamed_and_whole_replies_alternate_on_one_client(served):  # noqa: F811
    """A streamed reply ends its connection (`Connection: close`: none is kept after it); whole replies keep
    theirs; an agent mixing them on one shared client gets every reply."""
    gateway, server = served
    with agent_http_client() as http:
        for agent in (agents.streaming_agent, agents.calculator_agent, agents.streaming_agent):
            s = gateway.sessions.add(Session(0, 0, {"prompt": "What is 12 * 34?"}))
            client = openai.OpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, http_client=http)
            agent(client, s.row)
            assert s.calls == 2  # the call, then the answer after the calculator's result
            s.end("answer")
            gateway.sessions.remove([s])
        assert len(http._transport._pool._idle) <= 1
