"""Episode runners: how the rollout source turns a step's prompts into completions, one turn or many.

A runner is chosen by name from RUNNERS (a new one is a module with a `build` function and one line here):

    single_turn    engine.generate(prompts, n): one sampled completion per row, the shared-prompt fast path
    multi_turn     rollout/multi_turn.py: tools or an environment (agents/environments.py's protocol), every
                   episode of the step advancing together, one batched engine call per turn
    rollout_func   rollout/rollout_func.py: TRL's `rollout_func(prompts, trainer)` (TRL 1.16's contract)
    agent          gateway/runner.py: the user's own agent code through the OpenAI-compatible gateway

`build(cfg, formatter, **objects)` → an EpisodeRunner; objects are what GRPOTrainer was given (tools=,
environment=, rollout_func=, agent=) and `max_tokens`, the run's one completion limit. The rollout source
calls only the EpisodeRunner protocol below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from grpo import plugins
from grpo.records import PromptBatch, Rollouts, SamplingParams

# name → "module:function" of its builder, imported only when chosen.
RUNNERS: dict[str, str] = {
    "single_turn": "grpo.rollout.episodes:build_single_turn",
    "multi_turn": "grpo.rollout.multi_turn:build",
    "rollout_func": "grpo.rollout.rollout_func:build",
    "agent": "grpo.gateway.runner:build_agent_runner",
}


class EpisodeRunner(Protocol):
    """What the rollout source (and evaluation) call; one runner lives for the whole run.

    `run` gives n completions for every prompt, and the prompts as sampled from (an environment may extend
    them): Rollouts rows are grouped by prompt (group_ids), `loss_mask` marks the sampled tokens, and
    `episodes` (one Episode record per row, or None for one turn) carries what each episode did, its
    environment's reward (`env_reward`, `env_class`) included. `reward_names` are the environment reward
    columns its episodes carry (one per class that scores, TRL's metric name). `check_prompts` runs at
    start-up, before the model loads; `close` ends every environment the runner holds (called however the run
    ends; the runner stays usable and makes fresh ones)."""

    multi_turn: bool
    reward_names: Sequence[str]
    renders_prompts: bool  # run() renders and tokenizes the prompts itself: the feed need not

    def run(
        self, engine, prompts: PromptBatch, n: int, sampling: SamplingParams, chunk_prompts: int | None = None
    ) -> tuple[PromptBatch, Rollouts]: ...

    def check_prompts(self, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


class SingleTurn:
    """One sampled completion per row: the engine's shared-prompt generate."""

    multi_turn = False
    reward_names: tuple[str, ...] = ()
    renders_prompts = False

    def run(self, engine, prompts, n, sampling, chunk_prompts=None):
        return prompts, engine.generate(prompts.prompt_token_ids, n, sampling, chunk_prompts=chunk_prompts)

    def check_prompts(self, rows: list[dict]) -> None:
        del rows

    def close(self) -> None:
        pass


def build_single_turn(cfg, formatter, **objects) -> SingleTurn:
    del cfg, formatter, objects
    return SingleTurn()


def runner_name(cfg, tools=None, environment=None, rollout_func=None, agent=None) -> str:
    """The runner a run's settings and objects call for."""
    if agent is not None or cfg.env.agent or cfg.env.agent_command:
        return "agent"
    if rollout_func is not None:
        return "rollout_func"
    if tools or environment is not None or cfg.env.tools or cfg.env.environment:
        return "multi_turn"
    return "single_turn"


def build_episodes(
    cfg, formatter, tools=None, environment=None, rollout_func=None, agent=None, max_tokens=None, runner=None
) -> EpisodeRunner:
    """The runner `runner` names (default: the one the settings call for, see runner_name). `max_tokens`:
    the run's one completion limit (RunSettings.completion_limit), which the preflights checked."""
    from grpo.config import ConfigError

    name = runner or runner_name(cfg, tools, environment, rollout_func, agent)
    if name not in RUNNERS:
        raise ConfigError(f"No episode runner named {name!r}; the runners are {', '.join(RUNNERS)}.")
    build = plugins.load(RUNNERS[name], f"episode runner {name!r}", call=True)
    objects = dict(tools=tools, environment=environment, rollout_func=rollout_func, agent=agent)
    return build(cfg, formatter, max_tokens=max_tokens, **objects)


def answer_texts(rollouts: Rollouts, tokenizer) -> list[str]:
    """What an evaluation scores: the last assistant message of each episode (a tool's output is never
    an answer), or the decoded completion of a single turn."""
    if rollouts.episodes is None:
        return tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
    return [
        next((m.get("content") or "" for m in reversed(e.messages) if m["role"] == "assistant"), "")
        for e in rollouts.episodes
    ]
