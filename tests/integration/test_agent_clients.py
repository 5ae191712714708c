"""Conformance: agents written with the real client packages drive episodes on the bundled tiny-tools-lm
through the gateway, end to end (native engine, the gateway's HTTP server, the agent runner). Each framework
runs the calculator itself when the model calls it and feeds the result back; each episode's tokens must be
the chat template's rendering of the conversation the agent had, token for token.

    openai            chat completions (the example agent; and streamed), the Responses API (the example
                      agent's run_responses; and streamed)
    langchain-openai  ChatOpenAI with a bound tool in a LangGraph graph (ToolNode runs the tool), invoked and
                      streamed
    openai-agents     an Agents SDK `Agent` with a `function_tool`, run by its `Runner` (Responses API, chat
                      completions, Responses streamed)
    --agent-command   the example agent as a subprocess, over plain HTTP

The versions are the `agents` extra's pins (pyproject.toml)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.agents import ChatRenderer, HermesParser
from grpo.gateway.agent_command import AgentCommand
from grpo.gateway.runner import AgentRunner
from grpo.gateway.service import Limits
from grpo.model.loading import resolve_path
from grpo.records import PromptBatch, SamplingParams
from grpo.rollout.native import NativeEngine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PATH = ROOT / "examples" / "tiny_tools_agent.py"
_spec = importlib.util.spec_from_file_location("tiny_tools_agent", EXAMPLE_PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

# Bare products: the bundled model calls the calculator on most of them when sampling at temperature 1.
QUESTIONS = ["What is 78 times 47?", "What is 95 times 52?"]
EPISODES = 6  # per question: the chance that none of 12 calls the tool is below 1e-4
LIMITS = Limits(max_tokens=160, turn_tokens=48, max_prompt_tokens=400)
SAMPLING = SamplingParams(max_new_tokens=48, temperature=1.0)


@pytest.fixture(scope="module")
def policy():
    path = resolve_path("tiny-tools-lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return tokenizer, NativeEngine(model, tokenizer)


def drive(policy, agent):
    tokenizer, engine = policy
    runner = AgentRunner(agent, tokenizer, HermesParser(), LIMITS, timeout_s=120)
    prompts = PromptBatch(
        prompts=list(QUESTIONS),
        prompt_token_ids=[[0] for _ in QUESTIONS],
        columns={"answer": ["#### 3666", "#### 4940"]},
        indices=[0, 1],
    )
    torch.manual_seed(0)
    try:
        result = runner.run(engine, prompts, EPISODES, SAMPLING)
        # every request extended its episode's conversation: one token row per episode, no fork
        assert runner.metrics()["gateway/forks"] == 0
        return result
    finally:
        runner.close()


def check_episodes(tokenizer, prompts, rollouts, tools: list[dict]) -> None:
    """Every episode ran to its end; its ids are the template's rendering of its conversation; the tool
    results the framework fed back are the calculator's values of the model's calls."""
    chat = ChatRenderer(tokenizer, tools)
    fed_back = 0
    for k, episode in enumerate(rollouts.episodes):
        assert episode.ended_by in ("answer", "max_tokens"), episode.ended_by
        group = int(rollouts.group_ids[k])
        conversation = [{"role": "user", "content": QUESTIONS[group]}, *episode.messages]
        n = int(rollouts.completion_mask[k].sum())
        ids = prompts.prompt_token_ids[group] + rollouts.completion_ids[k, :n].tolist()
        rendered = chat.encode(chat.render(conversation, add_generation_prompt=False))
        assert ids == rendered[: len(ids)], f"episode {k} is not its conversation's rendering"
        assert (
            len(rendered) - len(ids) <= len(chat.encode(chat.turn_tail)) or episode.ended_by == "max_tokens"
        )
        calls = {
            c["id"]: c for m in episode.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])
        }
        for message in episode.messages:
            if message["role"] == "tool" and message["tool_call_id"] in calls:
                arguments = calls[message["tool_call_id"]]["function"]["arguments"]
                assert message["content"] == example.use_tool("calculator", json.dumps(arguments))
                fed_back += 1
    assert fed_back > 0, "no episode called the calculator and got its result back"
    assert rollouts.loss_mask.sum() > 0


def chat_streaming_agent(client, row: dict) -> None:
    """The example's loop with every call streamed (`stream_options.include_usage`), the reply reassembled
    from the chunks as streaming clients do."""

    def ask(messages: list[dict]) -> dict:
        content, calls = "", {}
        stream = client.chat.completions.create(
            model=example.MODEL,
            messages=messages,
            tools=example.TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"type": "function", "function": {"arguments": ""}})
                    call["id"] = delta.id or call.get("id")
                    call["function"]["name"] = delta.function.name or call["function"].get("name")
                    call["function"]["arguments"] += delta.function.arguments or ""
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        return message

    example.episode(ask, row)


def responses_streaming_agent(client, row: dict) -> None:
    """The example's Responses loop with every call streamed; the output items are the final event's."""
    items: list = example.opening(row)
    for _ in range(example.MAX_TURNS):
        events = list(
            client.responses.create(
                model=example.MODEL, input=items, tools=example.RESPONSES_TOOLS, stream=True
            )
        )
        assert events[0].type == "response.created" and events[-1].type in (
            "response.completed",
            "response.incomplete",
        )
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events[-1].response
        assert deltas == final.output_text  # the text came as deltas, and they add up to the final text
        items += [item.model_dump(exclude_none=True) for item in final.output]
        calls = [item for item in final.output if item.type == "function_call"]
        if not calls:
            return
        items += [
            {
                "type": "function_call_output",
                "call_id": c.call_id,
                "output": example.use_tool(c.name, c.arguments),
            }
            for c in calls
        ]


@pytest.mark.parametrize(
    "agent",
    [example.run, chat_streaming_agent, example.run_responses, responses_streaming_agent],
    ids=["chat", "chat-streamed", "responses", "responses-streamed"],
)
def test_openai_client_drives_token_exact_episodes(policy, agent):
    prompts, rollouts = drive(policy, agent)
    check_episodes(policy[0], prompts, rollouts, example.TOOLS)


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "streamed"])
def test_langgraph_graph_with_a_bound_tool(policy, streaming):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return its value.

        Args:
            expression: The arithmetic expression to evaluate, e.g. "347*28" or "(12+5)*3".
        """
        return example.use_tool("calculator", json.dumps({"expression": expression}))

    schemas = []

    def agent(client, row: dict) -> None:
        llm = ChatOpenAI(
            model=example.MODEL, base_url=str(client.base_url), api_key=client.api_key, max_retries=0,
            streaming=streaming,
        ).bind_tools([calculator])  # fmt: skip
        schemas.append(llm.kwargs["tools"])
        graph = StateGraph(MessagesState)
        graph.add_node("model", lambda state: {"messages": [llm.invoke(state["messages"])]})
        graph.add_node("tools", ToolNode([calculator]))
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", tools_condition)
        graph.add_edge("tools", "model")
        graph.compile().invoke(
            {"messages": [("user", row["prompt"])]}, {"recursion_limit": 2 * example.MAX_TURNS}
        )

    prompts, rollouts = drive(policy, agent)
    check_episodes(policy[0], prompts, rollouts, schemas[0])


def test_agent_command_runs_the_example_as_a_process(policy):
    command = AgentCommand([sys.executable, str(EXAMPLE_PATH)], timeout_s=120)
    prompts, rollouts = drive(policy, command)
    check_episodes(policy[0], prompts, rollouts, example.TOOLS)


def test_the_example_shows_the_model_what_the_tools_episodes_show_it():
    """Its calculator schema is transformers' for grpo's calculator; its calculator agrees with grpo's on
    the task's expressions, on errors too (as a message, not an exception)."""
    from grpo.agents.calculator import calculator
    from grpo.agents.tools import tool_schema

    assert [tool_schema(calculator)] == example.TOOLS
    rows = [
        json.loads(line) for line in (ROOT / "src/grpo/assets/tiny_tools/test.jsonl").read_text().splitlines()
    ]
    for row in rows[:100]:
        expression = row["answer"].partition("=")[0]
        assert example.calculator(expression) == calculator(expression)
    for text in ("7/4", "2**-2", "(12+5)*3", "10//3", "-4%3"):
        assert example.calculator(text) == calculator(text)
    assert example.use_tool("calculator", '{"expression": "1/0"}').startswith(
        "calculator raised ZeroDivisionError"
    )
    assert example.use_tool("calculator", '{"expression": "x+1"}').startswith("calculator raised ValueError")
    assert example.use_tool("search", "{}") == "unknown tool 'search'; the tools are: calculator."
    assert example.use_tool("calculator", '{"expr": "1"}').startswith("bad arguments for calculator")
    # the control's tool message is the one grpo's own tools= control (offline_calculator) gives the model
    from grpo.agents.calculator import offline_calculator
    from grpo.agents.parsing import ParsedTurn, ToolCall
    from grpo.agents.tools import ToolBox

    turn = ParsedTurn(content="", calls=[ToolCall("calculator", {"expression": "94*73"})], errors=[])
    (result,) = ToolBox([offline_calculator]).run([turn])[0]
    assert example.use_tool("calculator", '{"expression": "94*73"}', offline=True) == result.content


def test_grpo_eval_goes_through_the_configs_agent(tmp_path, capsys):
    """`grpo eval --config tiny_tools_agent --json`: each held-out row is an episode of the example agent
    (greedy), scored on its final answer; `--agent-command` evaluates through a command the same way."""
    from grpo.cli import main

    for extra in ([], ["--agent-command", f"{sys.executable} {EXAMPLE_PATH}"]):
        dump = tmp_path / "dump.jsonl"
        args = ["eval", "--config", "tiny_tools_agent", "--json", "--limit", "3", "--dump", str(dump), *extra]
        assert main(args) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["n"] == 3 and 0.0 <= result["accuracy"] <= 1.0 and "tool_call_rate" in result
        records = [json.loads(line) for line in dump.read_text().splitlines()]
        assert all(r["messages"][0] and r["messages"][0][0]["role"] == "assistant" for r in records)


def test_a_steps_episodes_connect_at_once_without_resets():
    """The eval batch (256 rows) or a step's episodes open their connections together: the server's listen
    backlog takes them all (the stdlib default of 5 reset some of them)."""
    import threading

    import httpx

    from grpo.gateway.server import GatewayServer
    from grpo.gateway.sessions import Session, SessionTable

    class Models:  # what GET /v1/models reads of a gateway
        model_name = "policy"
        sessions = SessionTable()

    session = Models.sessions.add(Session(0, 0, {}))
    server = GatewayServer(Models())
    errors: list[str] = []

    def connect() -> None:
        try:
            headers = {"Authorization": f"Bearer {session.key}"}
            # Plain http: verify=False only skips loading the CA bundle, 45 ms of CPU for each of 256 clients.
            reply = httpx.get(f"{server.base_url}/models", headers=headers, timeout=120, verify=False)
            reply.raise_for_status()
        except httpx.HTTPError as err:
            errors.append(repr(err))

    threads = [threading.Thread(target=connect) for _ in range(256)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)
    finally:
        server.close()
    assert server.httpd.request_queue_size >= 256 and not errors, errors[:3]


@pytest.mark.parametrize("api", ["responses", "chat", "responses-streamed"])
def test_openai_agents_sdk_agent_with_a_function_tool(policy, api):
    """The OpenAI Agents SDK (`openai-agents`): an `Agent` with a `function_tool` calculator, run by its
    `Runner` against the episode's `AsyncOpenAI` client — the Responses API (the SDK's default model) and
    chat completions, and streamed. The SDK calls the tool and feeds the result back itself."""
    sdk = pytest.importorskip("agents")
    sdk.set_tracing_disabled(True)  # its tracer would export each run to OpenAI's servers

    @sdk.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return its value.

        Args:
            expression: The arithmetic expression to evaluate, e.g. "347*28" or "(12+5)*3".
        """
        return example.use_tool("calculator", json.dumps({"expression": expression}))

    async def agent(client, row: dict) -> None:
        model = (
            sdk.OpenAIChatCompletionsModel(example.MODEL, client)
            if api == "chat"
            else sdk.OpenAIResponsesModel(example.MODEL, client)
        )
        bot = sdk.Agent(name="calc", instructions=None, model=model, tools=[calculator])
        run_config = sdk.RunConfig(tracing_disabled=True)
        if api == "responses-streamed":
            result = sdk.Runner.run_streamed(
                bot, row["prompt"], max_turns=example.MAX_TURNS, run_config=run_config
            )
            async for _ in result.stream_events():
                pass
        else:
            await sdk.Runner.run(bot, row["prompt"], max_turns=example.MAX_TURNS, run_config=run_config)

    prompts, rollouts = drive(policy, agent)
    check_episodes(policy[0], prompts, rollouts, [calculator_schema(calculator)])


def calculator_schema(tool) -> dict:
    """The chat-completions form of an Agents SDK function tool's schema (what the gateway rendered)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.params_json_schema,
        },
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_in_replies_are_the_sampled_tokens_log_probs(policy, stream):
    """`logprobs=True`: the reply carries each of its sampled tokens with the log-prob the learner trains
    against (the episode's `sampling_logprobs`); the tokens spell the reply (a tool call's markup included);
    streamed, the chunks' lists join to the same. `top_logprobs` is accepted (0-20), with no alternatives."""
    seen: list[tuple[str, str | None, list]] = []

    def agent(client, row: dict) -> None:
        kwargs = {"model": example.MODEL, "messages": example.opening(row), "tools": example.TOOLS}
        kwargs.update(logprobs=True, top_logprobs=2)
        if stream:
            content, name, tokens = "", None, []
            for part in client.chat.completions.create(**kwargs, stream=True):
                for choice in part.choices:
                    content += choice.delta.content or ""
                    name = next((c.function.name for c in choice.delta.tool_calls or []), name)
                    tokens += choice.logprobs.content if choice.logprobs else []
        else:
            message, logprobs = (lambda c: (c.message, c.logprobs))(
                client.chat.completions.create(**kwargs).choices[0]
            )
            content, tokens = message.content or "", logprobs.content
            name = message.tool_calls[0].function.name if message.tool_calls else None
        seen.append((content, name, tokens))

    _, rollouts = drive(policy, agent)
    assert len(seen) == len(QUESTIONS) * EPISODES
    rows = [rollouts.sampling_logprobs[k] for k in range(len(rollouts.episodes))]
    for content, name, tokens in seen:
        text = "".join(t.token for t in tokens)
        assert tokens and (text.strip() == content.strip() if name is None else f'"{name}"' in text)
        assert all(t.top_logprobs == [] and t.logprob <= 0 for t in tokens)
        values = torch.tensor([t.logprob for t in tokens])
        assert any(torch.equal(values, row[: len(tokens)]) for row in rows)
    assert any(name for _, name, _ in seen) and any(name is None for _, name, _ in seen)
