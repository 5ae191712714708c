"""The gateway's HTTP surface under requests nobody should send: every answer is an OpenAI-style error object
with the right status (never a 500 or the stdlib's HTML page), the server stays up, and request fields the
gateway cannot honour are either refused (a wrong type) or said once in the log."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest

from grpo.gateway.sessions import Session
from tests import gateway_agents as agents
from tests.unit.test_gateway import post, qwen, served  # noqa: F401 - the fixtures

GOOD = {"model": "m", "messages": [{"role": "user", "content": "What is 12 * 34?"}]}
NAMED = {"type": "function", "function": {"name": "x"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**GOOD, "stop": 5}, "stop"),
        ({**GOOD, "stream": "yes"}, "stream"),
        ({**GOOD, "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
        ({**GOOD, "n": 0}, "n"),
        ({**GOOD, "n": 3}, "n"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        # NaN and Infinity are JSON to Python's reader (json.dumps writes them here): not numbers to us
        ({**GOOD, "temperature": float("nan")}, "temperature"),
        ({**GOOD, "top_p": float("nan")}, "top_p"),
        ({**GOOD, "max_tokens": float("inf")}, "max_tokens"),
        ({**GOOD, "max_completion_tokens": float("nan")}, "max_completion_tokens"),
        ({**GOOD, "seed": float("-inf")}, "seed"),
        ({**GOOD, "tools": agents.TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({**GOOD, "tools": agents.TOOLS, "tool_choice": NAMED}, "tool_choice"),
    ],
)
def test_a_field_of_the_wrong_type_or_value_is_a_400_naming_it(served, body, param):  # noqa: F811
    gateway, server = served
    s = gateway.sessions.add(Session(0, 0, {}))
    reply = post(server, s.key, body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param, error
    assert "None" not in error["message"]  # "between 1 and None" said nothing
    s = gateway.sessions.add(Session(0, 0, {}))
    assert post(server, s.key, GOOD).status_code == 200  # still serving


def test_tool_choice_none_gives_text_not_calls(served):  # noqa: F811
    gateway, server = served  # the scripted policy writes a tool call on the first turn
    s = gateway.sessions.add(Session(0, 0, {}))
    auto = post(server, s.key, {**GOOD, "tools": agents.TOOLS}).json()["choices"][0]
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["tool_calls"]
    s = gateway.sessions.add(Session(0, 0, {}))
    none = post(server, s.key, {**GOOD, "tools": agents.TOOLS, "tool_choice": "none"}).json()["choices"][0]
    assert none["finish_reason"] == "stop" and not none["message"].get("tool_calls")
    assert "<tool_call>" in none["message"]["content"]  # what the model wrote, as text


def test_unhonoured_fields_are_said_once_in_the_log(served, caplog):  # noqa: F811
    gateway, server = served
    caplog.set_level(logging.INFO, logger="grpo")
    for _ in range(2):
        s = gateway.sessions.add(Session(0, 0, {}))
        body = {**GOOD, "response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 3,
                "tools": agents.TOOLS, "tool_choice": "required"}  # fmt: skip
        assert post(server, s.key, body).status_code == 200
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Gateway: requests set")]
    assert sorted(m.split()[3] for m in said) == ["response_format,", "tool_choice", "top_logprobs,"]
    # logprobs are given (the sampled tokens'), and what they are is said once
    asked = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("Gateway: requests ask for logp")
    ]
    assert len(asked) == 1


def test_other_methods_and_unreadable_requests_get_error_objects(served):  # noqa: F811
    gateway, server = served
    s = gateway.sessions.add(Session(0, 0, {}))
    headers = {"Authorization": f"Bearer {s.key}"}
    for method, path, allow in (("PUT", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"),
                                ("OPTIONS", "/v1/responses", "POST")):  # fmt: skip
        url = f"http://{server.host}:{server.port}{path}"
        reply = httpx.request(method, url, headers=headers, content=b"{}")
        assert (
            reply.status_code == 405 and reply.headers["Allow"] == allow and reply.json()["error"]["message"]
        )
    model = httpx.get(f"{server.base_url}/models/policy", headers=headers).json()  # client.models.retrieve
    assert model == {"id": "policy", "object": "model", "created": 0, "owned_by": "grpo"}
    for raw in (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {s.key}\r\n"
        "Content-Length: -5\r\n\r\n",
        "BREW /v1/chat/completions HTTP/7.0\r\n\r\n",
        "POST /v1/chat/completions HTTP/1.1\r\n" + "X-Long: " + "a" * 70_000 + "\r\n\r\n",
    ):
        with socket.create_connection((server.host, server.port), timeout=10) as sock:
            sock.sendall(raw.encode())
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.split()[1] in (b"400", b"405", b"431", b"505"), head
        assert json.loads(payload)["error"]["message"]
    s = gateway.sessions.add(Session(0, 0, {}))
    assert post(server, s.key, GOOD).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [({"stream": "yes"}, "stream"), ({"max_output_tokens": 0}, "max_output_tokens"),
     ({"max_output_tokens": "9"}, "max_output_tokens")],
)  # fmt: skip
def test_the_responses_route_names_its_own_fields_in_its_errors(served, body, param):  # noqa: F811
    gateway, server = served
    s = gateway.sessions.add(Session(0, 0, {}))
    reply = post(server, s.key, {"model": "m", "input": "What is 12 * 34?", **body}, path="/v1/responses")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def raw_request(server, text: str) -> tuple[bytes, bytes]:
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(text.encode())
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
            head, _, payload = answer.partition(b"\r\n\r\n")
            length = [ln for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:")]
            if length and len(payload) >= int(length[0].split(b":")[1]):
                break  # the whole reply: a kept-alive connection stays open after it
    head, _, payload = answer.partition(b"\r\n\r\n")
    return head, payload


def test_usual_requests_are_read_without_the_stdlibs_email_parser(served, monkeypatch):  # noqa: F811
    import http.client

    def refused(*args, **kwargs):
        raise AssertionError("the e-mail parser read a usual request's headers")

    monkeypatch.setattr(http.client, "parse_headers", refused)
    gateway, server = served
    s = gateway.sessions.add(Session(0, 0, {}))
    assert post(server, s.key, GOOD).status_code == 200
    body = json.dumps(GOOD)
    s = gateway.sessions.add(Session(0, 0, {}))
    # Any case, a folded line, a repeated header (the first counts, as email.message.Message.get gives it).
    head, payload = raw_request(
        server,
        f"POST //v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {s.key}\r\n"
        f"Authorization: Bearer sk-nobody\r\nX-Folded: a\r\n b\r\ncontent-LENGTH: {len(body)}\r\n\r\n{body}",
    )
    assert head.split()[1] == b"200" and json.loads(payload)["choices"][0]["message"]
    head, payload = raw_request(
        server, "POST /v1/chat/completions HTTP/1.1\r\n" + "X-A: 1\r\n" * 101 + "\r\n"
    )
    assert head.split()[1] == b"431" and json.loads(payload)["error"]["message"] == "Too many headers"
