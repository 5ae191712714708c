"""An agent that sends no tools trains on a model whose chat template declares no tool-call format (the
bundled tiny-math-lm), instead of the run being refused at start; a request that does send tools gets a
400 naming env.tool_parser, through the real `openai` client, and the server stays up."""

from __future__ import annotations

import openai
import pytest

from grpo.agents.parsing import NoToolCalls, detect_parser
from grpo.config import ConfigError
from grpo.gateway.server import GatewayServer
from grpo.gateway.service import Gateway, Limits
from grpo.gateway.sessions import Session
from grpo.records import SamplingParams
from tests import gateway_agents as agents
from tests.chat_templates import bundled_tokenizer
from tests.unit.test_episodes import ScriptedEngine


@pytest.fixture(scope="module")
def plain():
    return bundled_tokenizer()


def test_the_gateway_takes_a_template_without_a_tool_format_the_tool_runners_do_not(plain):
    with pytest.raises(ConfigError, match="declares no tool-call format"):
        detect_parser(plain, "tiny-math-lm")  # tools= / environment_factory= need one
    assert isinstance(detect_parser(plain, "tiny-math-lm", optional=True), NoToolCalls)
    # a format named by the user is used as before
    assert detect_parser(plain, "tiny-math-lm", "hermes", optional=True).name == "hermes"


def test_requests_with_tools_are_refused_and_plain_ones_answered(plain):
    engine = ScriptedEngine(plain, lambda text: "<tool_call>not a call</tool_call> 42", eos="<|end|>")
    limits, sampling = Limits(2000, 200, 4096), SamplingParams(max_new_tokens=64)
    gateway = Gateway(plain, NoToolCalls(), limits, engine, sampling)
    server = GatewayServer(gateway)
    try:

        def client():  # a refused request ends its episode (counted as bad_request): one session each
            session = gateway.sessions.add(Session(0, 0, {}))
            return openai.OpenAI(base_url=server.base_url, api_key=session.key, max_retries=0)

        messages = [{"role": "user", "content": "What is 6 * 7?"}]
        with pytest.raises(openai.BadRequestError) as refused:
            client().chat.completions.create(model="m", messages=messages, tools=agents.TOOLS)
        assert refused.value.status_code == 400 and refused.value.body["param"] == "tools"
        assert "env.tool_parser" in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError):  # the Responses API's function tools too
            client().responses.create(
                model="m", input="What is 6 * 7?", tools=[{"type": "function", "name": "f", "parameters": {}}]
            )
        reply = client().chat.completions.create(model="m", messages=messages)  # the server is still up
        choice = reply.choices[0]
        # the text is never read for calls: markup the model writes stays content
        assert choice.message.content == "<tool_call>not a call</tool_call> 42"
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert engine.calls == [1]  # the refused requests never reached the engine
    finally:
        server.close()
        gateway.batcher.close()
