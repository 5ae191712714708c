"""The env section: multi-turn episodes, tools, environments and agents (docs/agents.md)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.fields import Registry
from grpo.config.fields import setting as _f


@dataclass
class EnvConfig:
    """Multi-turn episodes: tools and environments (docs/agents.md). Unset tools and environment: one turn."""

    tools: list[str] = _f(
        [],
        "Tool functions as package.module:function import paths (typed arguments and a docstring become "
        "the schema the chat template shows the model), e.g. grpo.agents.calculator:calculator.",
    )
    environment: str | None = _f(
        None,
        "An environment class as package.module:Class: TRL's form (reset(**row), public methods are "
        "tools, optional get_reward()) or the step form (reset(row) -> messages, step(messages) -> "
        "(messages, reward, done)); one instance per episode.",
    )
    max_turns: int = _f(4, "Assistant turns per episode; an episode still calling tools then ends truncated.")
    max_tokens: int | None = _f(
        None,
        "Completion tokens per episode, sampled and injected together: the run's one completion limit "
        "(overlong shaping, the context and memory checks, vLLM's max_model_len); default: max_turns × "
        "generation.max_new_tokens.",
    )
    tool_timeout_s: float = _f(
        10.0, "Seconds a tool call may run; past it the model reads a timeout message."
    )
    tool_max_chars: int = _f(
        4000, "Characters of a tool's output the model reads; longer output is cut with a marker."
    )
    tool_parser: str = _f(
        "auto",
        "How tool calls are written: auto (what the tokenizer's chat template declares), hermes "
        "(<tool_call> JSON: Qwen, Hermes), llama3_json or mistral.",
        choices=Registry("grpo.agents.parsing:PARSERS", also=("auto",)),
    )
    reward_weight: float = _f(
        1.0,
        "Weight of the environment's own reward (step rewards or get_reward()) beside the reward functions.",
    )
    agent: str | None = _f(
        None,
        "Your own agent as package.module:function or path/to/file.py:function: run(client, row) drives "
        "each episode through an OpenAI-compatible gateway (client: openai.OpenAI, or AsyncOpenAI for "
        "async def run) and returns the reward or None (the reward functions score it).",
    )
    agent_command: str | None = _f(
        None,
        "A command run once per episode with the row as JSON on stdin and OPENAI_BASE_URL / "
        "OPENAI_API_KEY set for its session; a number on its last stdout line is the reward.",
    )
    agent_workers: int | None = _f(
        None,
        "Worker processes that run env.agent's episodes (each a share of a step's, on threads), so the "
        "agents' openai-client work runs beside the trainer's instead of under its GIL; unset: one per "
        "core, at most 8; 0: threads in the trainer's process (always so for env.agent_command).",
    )
    agent_start_ahead: bool | None = _f(
        None,
        "Start the next step's agent episodes while the learner updates (their first requests wait for the "
        "new weights; an evaluation, a stop or the run's end discards them unsampled); unset: only where the "
        "update leaves a core idle (more agent workers than torch threads).",
    )
    agent_keep_alive: bool = _f(
        True,
        "Keep an agent's HTTP connection to the gateway open between its calls (the server closes one it "
        "cannot go on reading, saying so); false: every call connects anew and its reply closes it.",
    )
    episode_timeout_s: float = _f(300.0, "Seconds an agent's episode may run; past it the episode fails.")
    failed_episode: str = _f(
        "zero",
        "How a failed agent episode (it raised, timed out, never called the model, sent a malformed "
        "request) is scored: zero (reward 0) or drop (left out of its group's baseline).",
        choices=("zero", "drop"),
    )
    strict_history: bool = _f(
        False,
        "End an agent's episode when a request rewrites its history, instead of starting a new row.",
    )
