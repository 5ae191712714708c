"""The agent runner: a step's episodes driven by the user's own agent code through the gateway.

    GRPOTrainer(..., agent=run)          grpo train --agent pkg.module:run  (or path/to/file.py:run)

`run(client, row)` gets an `openai.OpenAI` whose base URL and key address its episode's session (`async def
run`: an `openai.AsyncOpenAI`, all episodes on one event loop) and the dataset row (prompt and columns). The
episodes run in a few forked worker processes (env.agent_workers, gateway/agent_pool.py: the client's CPU off
the trainer's GIL), or with env.agent_workers=0 on threads in this process. It
runs its own loop, messages and tools, and returns the episode's reward, or None to have the run's reward
functions score the conversation it had (TRL's contract: `completions` are the messages after the first
request's, tool messages included; the row's columns as keyword arguments). It may also post the reward to
the session's `/v1/reward`.

Faults end an episode, not the run: an agent that raises (`agent_error`; `bad_request` after a malformed
request), runs past env.episode_timeout_s (`timeout`), or never calls the model (`no_calls`); with
env.strict_history a rewritten history ends it too (`history`). Each reason is counted
(episode/ended_by/<reason>) and the episode scored per env.failed_episode: `zero` (reward 0) or `drop` (no
reward: left out of its group's baseline, advantage 0). Sync mode: every episode of a step finishes (or
times out) before the learner updates the weights.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import logging
import math
import threading
import time
from pathlib import Path

import torch

from grpo import plugins
from grpo.agents.environments import EnvironmentContractError
from grpo.config import ConfigError
from grpo.config.errors import clause
from grpo.gateway.clock import step_deadline, until
from grpo.gateway.rows import session_rollouts
from grpo.gateway.server import GatewayServer
from grpo.gateway.service import Gateway, Limits
from grpo.gateway.sessions import Session
from grpo.gateway.wire import finite_reward
from grpo.records import Episode, PromptBatch
from grpo.rewards.isolation import STOP_GRACE_S, stop_requested

log = logging.getLogger("grpo")

FAILURES = ("agent_error", "bad_request", "timeout", "no_calls", "history")
DISCARDED = "discarded"  # a pre-started episode that no step took (start_ahead): never scored or counted


@dataclasses.dataclass(eq=False)
class _Ahead:
    """The next step's episodes, started while the learner updates (AgentRunner.start_ahead)."""

    prompts: PromptBatch
    n: int
    sessions: list[Session]
    thread: threading.Thread | None = None
    results: list[tuple] | None = None
    cut: threading.Event = dataclasses.field(default_factory=threading.Event)  # set: discarded
    error: BaseException | None = None  # what driving them raised (run() raises it)


def load_agent(spec):
    """The agent callable: itself, or `package.module:function` / `path/to/file.py:function`."""
    if callable(spec):
        _check_signature(spec, getattr(spec, "__qualname__", repr(spec)))
        return spec
    agent = plugins.load(portable_spec(spec), "env.agent", call=True)
    _check_signature(agent, str(spec))
    return agent


def _check_signature(agent, spec: str) -> None:
    """grpo calls `agent(client, row)`: one that cannot take both is refused before the model loads, instead
    of failing every episode with a TypeError."""
    try:
        signature = inspect.signature(agent)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    try:
        signature.bind(object(), {})
    except TypeError:
        raise ConfigError(
            f"env.agent {spec!r} has the signature {signature}, but grpo calls it as agent(client, row): "
            "give it exactly those two parameters (client: an openai client for this episode, row: the "
            "dataset row as a dict)."
        ) from None


class AgentFailed(EnvironmentContractError):
    """Every episode of a step failed the same way in the agent's own code: the run stops with the cause."""


def portable_spec(spec) -> str | None:
    """A string spec as any process on this machine loads it: a file path made absolute (a relative one not
    found here may be one of grpo's own examples, the tiny_tools_agent preset's); None for a callable."""
    if callable(spec):
        return None
    module_name, _, name = str(spec).rpartition(":")
    path = Path(module_name)
    if not (module_name.endswith(".py") or "/" in module_name) or path.is_absolute():
        return str(spec)
    if not path.is_file():
        path = Path(__file__).resolve().parents[3] / path
    return f"{path.resolve()}:{name}" if path.is_file() else str(spec)


class AgentRunner:
    """An episode runner (rollout/episodes.py's protocol) over the gateway; see the module docstring."""

    multi_turn = True
    # The agent's own reward (returned by run() or posted to /v1/reward) is the column reward/agent; None
    # where it left the scoring to the run's reward functions.
    reward_names = ("agent",)
    renders_prompts = False
    # An episode is many engine calls: on a Ray actor under rollout.mode=async, new weights may load between
    # two of them (each token keeps the version that sampled it: rollout/weight_versions.py).
    weights_mid_episode = True

    def __init__(
        self,
        agent,
        tokenizer,
        parser,
        limits: Limits,
        *,
        timeout_s: float = 300.0,
        failed_episode: str = "zero",
        strict_history: bool = False,
        template_kwargs: dict | None = None,
        model_name: str = "grpo-policy",
        window_s: float = 0.2,
        workers: int | None = 0,
        ahead: bool | None = None,
        keep_alive: bool = True,
    ):
        self.agent = load_agent(agent)
        from grpo.gateway.agent_command import AgentCommand

        if isinstance(self.agent, AgentCommand):  # its time limit waits while the batcher holds the step
            self.agent.paused = self._paused
        self.agent_spec = portable_spec(agent)  # set: a Ray rollout actor loads the agent by it
        self.is_async = inspect.iscoroutinefunction(self.agent)
        self.tokenizer, self.parser, self.limits = tokenizer, parser, limits
        self.timeout_s, self.failed_episode = timeout_s, failed_episode
        self._notes: dict[str, str] = {}  # session key → why its episode failed in the agent's code
        self._worked = False  # some episode of the run ended without failing
        self.gateway_args = dict(
            strict_history=strict_history,
            template_kwargs=template_kwargs,
            model_name=model_name,
            window_s=window_s,
        )
        self.gateway: Gateway | None = None
        self.server: GatewayServer | None = None
        self._http = None  # the sync agents' shared connection pool
        self._previous: list[Session] = []
        self._metrics: dict[str, float] = {}
        self._lock = threading.Lock()
        # env.agent_workers: the Python agents run in that many forked processes (None: one per core, at most
        # 8), off the trainer's GIL (gateway/agent_pool.py); 0, an agent command (its own processes already)
        # or no fork: threads in this process.
        self.workers = workers
        self._pool = None
        self._ahead: _Ahead | None = None
        # start_ahead (env.agent_start_ahead): True / False, or None: where a core is left idle by the
        # update's torch threads. On 2 cores at 2 threads the agents' first requests only move into the
        # update and slow it as much as they save (12 interleaved pairs, 2026-11-27: 1.07x the step
        # without); with a spare core their CPU is free.
        self.ahead = ahead
        self.keep_alive = keep_alive  # env.agent_keep_alive: the server leaves an agent's connection open

    def __getstate__(self) -> dict:
        """What travels to a Ray rollout actor: the settings, not the live server, threads or sessions (the
        actor serves its own gateway); an agent named by a path is loaded there again by that path."""
        state = dict(
            self.__dict__,
            gateway=None,
            server=None,
            _http=None,
            _previous=[],
            _lock=None,
            _pool=None,
            _ahead=None,
        )
        if self.agent_spec is not None:
            state["agent"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())
        if self.agent is None:
            self.agent = load_agent(self.agent_spec)

    # -- the gateway lives as long as the runner ---------------------------------------------------------
    def _serve(self, engine, sampling) -> Gateway:
        if self.gateway is None:
            self.gateway = Gateway(
                self.tokenizer, self.parser, self.limits, engine, sampling, **self.gateway_args
            )
            self.server = GatewayServer(self.gateway, keep_alive=self.keep_alive)
            log.info("Agent gateway: %s (one key per episode).", self.server.base_url)
        self.gateway.batcher.use(engine, sampling)
        return self.gateway

    def close(self) -> None:
        """Stop the server and the batcher: no thread keeps the port."""
        if self._ahead is not None:  # the run ended (or stopped) after a step: its next one never comes
            ahead, self._ahead = self._ahead, None
            self._discard(ahead)
        if (stop := getattr(self.agent, "close", None)) is not None:  # an agent command's live processes
            stop()
        if self._pool is not None:  # before the server: no worker is left to call it
            self._pool.close()
            self._pool = None
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.server is not None:
            self.server.close()
            self.gateway.batcher.close()
            self.server = self.gateway = None

    def check_prompts(self, rows: list[dict], sample: int = 64) -> None:
        """At start-up: the chat template keeps earlier turns as sampled (else no row could be continued
        token in, token out). The prompts are the agent's own: each request is checked as it arrives."""
        from grpo.agents.chat import ChatRenderer
        from grpo.rollout.multi_turn import refuse_rewriting_template

        del rows, sample
        renderer = ChatRenderer(self.tokenizer, None, **(self.gateway_args["template_kwargs"] or {}))
        refuse_rewriting_template(renderer, self.gateway_args["model_name"])

    def metrics(self) -> dict[str, float]:
        out, self._metrics = self._metrics, {}
        if self.gateway is not None:
            out.update(self.gateway.batcher.metrics())
        return out

    # -- one step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, engine, prompts: PromptBatch, n: int, sampling, chunk_prompts=None):
        del chunk_prompts  # the batcher bounds nothing: every live episode's call joins one engine call
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.prompts is not prompts or ahead.n != n):
            self._discard(ahead)  # an evaluation between steps: its episodes never mix with the next step's
            ahead = None
        gateway = self._serve(engine, sampling)
        gateway.sessions.remove(self._previous)  # a late call of the step before this one is now a 401
        if ahead is not None:  # started while the learner updated: the weights are the new ones now
            sessions = ahead.sessions

            def collect() -> None:  # the batcher's calls run on this thread (host) from its first one on
                gateway.batcher.resume()
                ahead.thread.join()

            gateway.batcher.host(collect)
            if ahead.error is not None:
                raise ahead.error
            results = ahead.results
        else:
            sessions = self._sessions(gateway, prompts, n)
            results = gateway.batcher.host(lambda: self._drive_any(sessions))
        episodes = [
            self._episode(s, value, failure) for s, (value, failure) in zip(sessions, results, strict=True)
        ]
        self._previous = sessions
        self._refuse_if_all_failed(sessions, episodes)
        self._count(sessions)
        self._metrics["gateway/started_ahead"] = float(ahead is not None)
        return session_rollouts(self.tokenizer, prompts, sessions, episodes)

    def _sessions(self, gateway: Gateway, prompts: PromptBatch, n: int) -> list[Session]:
        sessions = []
        for i, prompt in enumerate(prompts.prompts):
            row = {"prompt": prompt, **{k: v[i] for k, v in prompts.columns.items()}}
            for _ in range(n):
                sessions.append(gateway.sessions.add(Session(len(sessions), i, row)))
        return sessions

    def _drive_any(self, sessions: list[Session], cut: threading.Event | None = None) -> list[tuple]:
        """`cut` set: the episodes were discarded, the agents that are still running get a second to end."""
        if (pool := self._agent_pool()) is not None:
            return self._drive_workers(pool, sessions, cut)
        if self.is_async:
            return self._drive_async(sessions, cut)
        return self._drive(sessions, cut)

    def _paused(self) -> bool:
        """The batcher holds the step's requests (the learner updates): its episodes' clock waits."""
        return self.gateway is not None and self.gateway.batcher.paused

    # -- the next step's agents, started while the learner updates -----------------------------------------
    def start_ahead(self, engine, prompts: PromptBatch, n: int, sampling) -> bool:
        """Start the episodes of the step whose prompts are `prompts` now, while the learner updates: each
        agent builds and sends its first request, the server renders and tokenizes it, and it waits in the
        paused batcher. `run(engine, prompts, ...)` with the same batch then resumes the batcher (the weights
        are the new ones by then) and collects them; a `run` with other prompts (an evaluation) or `close`
        discards them first: their sessions end and nothing of them reaches any step. Without this, the
        step's first engine call waits for all its agents' first requests (~0.2-0.3 s for 64 at ~3 ms of
        client CPU each on 2 cores). False where it does not start them (no gateway yet, a stop signal)."""
        del engine, sampling  # the batcher keeps the step's; run() sets them again before it resumes
        if self._ahead is not None:
            self._discard(self._ahead)
            self._ahead = None
        if self.gateway is None or stop_requested() or not self._ahead_pays():
            return False
        self.gateway.batcher.pause()
        sessions = self._sessions(self.gateway, prompts, n)
        ahead = _Ahead(prompts, n, sessions)

        def drive() -> None:
            try:
                ahead.results = self._drive_any(sessions, ahead.cut)
            except BaseException as err:  # noqa: BLE001 - raised again by the run() that takes the step
                ahead.error = err

        ahead.thread = threading.Thread(target=drive, name="grpo-agents-ahead", daemon=True)
        ahead.thread.start()
        self._ahead = ahead
        return True

    def _ahead_pays(self) -> bool:
        if self.ahead is not None:
            return self.ahead
        from grpo.gateway.agent_pool import default_size

        return default_size() > torch.get_num_threads()

    def _discard(self, ahead: _Ahead) -> None:
        """End the pre-started episodes: their calls get 409, their queued first requests an error, and their
        agents' failures are not counted (`discarded`); returns once their driver has."""
        for s in ahead.sessions:
            s.end(DISCARDED)
        ahead.cut.set()
        if self.gateway is not None:
            error = RuntimeError("this episode was discarded before it started (an evaluation came first)")
            self.gateway.batcher.fail_pending(error)
        ahead.thread.join(timeout=self.timeout_s + STOP_GRACE_S)
        if self.gateway is not None:
            self.gateway.batcher.fail_pending(RuntimeError("discarded"))  # none should be left; never sampled
            self.gateway.sessions.remove(ahead.sessions)
            self.gateway.batcher.resume()

    def _agent_pool(self):
        """The worker processes for the agents, when env.agent_workers asks for them and they can run."""
        from grpo.agents.workers import can_fork
        from grpo.gateway.agent_command import AgentCommand
        from grpo.gateway.agent_pool import AgentPool, default_size

        if self._pool is not None:
            return self._pool
        if self.workers == 0 or not can_fork() or isinstance(self.agent, AgentCommand):
            return None
        size = default_size() if self.workers is None else int(self.workers)
        self._pool = AgentPool(
            self.agent,
            size,
            is_async=self.is_async,
            timeout_s=self.timeout_s,
            close_fds=(self.server.httpd.fileno(),),
        )
        log.info(
            "Agents: %d worker process%s, each running its share of a step's episodes.",
            size,
            "" if size == 1 else "es",
        )
        return self._pool

    def _drive_workers(self, pool, sessions: list[Session], cut: threading.Event | None = None):
        results: list[tuple] = [(None, "timeout")] * len(sessions)
        deadline = step_deadline(self.timeout_s, self._paused, cut)

        def ended(k: int, value, error) -> None:
            s = sessions[k]
            if error is None:
                results[k] = (value, None)
            else:
                name, message, late = error
                late = late or time.monotonic() >= deadline() - 0.1  # it raised as its time ran out
                results[k] = (None, "timeout" if late else self._failure(s, RaisedInWorker(message), name))
            self._ended(s, results[k][1])

        episodes = [(k, s.key, s.row) for k, s in enumerate(sessions)]
        for k in pool.drive(self.server.base_url, episodes, deadline, ended):
            self._ended(sessions[k], "timeout")  # its worker was killed: its calls, if any come, get 409
        return results

    def _drive(self, sessions: list[Session], cut: threading.Event | None = None) -> list[tuple]:
        import openai

        from grpo.gateway.agent_http import agent_http_client

        results: list[tuple] = [(None, "timeout")] * len(sessions)
        if self._http is None:  # one connection stack for every episode's client: a client each costs ~0.1 s
            # No client-side timeout: a request may wait in a paused batcher for a whole update (start_ahead);
            # the episode's time limit is the runner's (gateway/clock.py).
            self._http = agent_http_client()
        clients = [
            openai.OpenAI(base_url=self.server.base_url, api_key=s.key, max_retries=0, http_client=self._http)
            for s in sessions
        ]

        def work(k: int, s: Session) -> None:
            try:
                results[k] = (self.agent(clients[k], copy.deepcopy(s.row)), None)
            except Exception as err:  # noqa: BLE001 - the agent's fault ends its episode, not the run
                late = time.monotonic() >= deadline() - 0.1  # e.g. an agent command killed at its limit
                results[k] = (None, "timeout" if late else self._failure(s, err))
            finally:
                self._ended(s, results[k][1])

        threads = [
            threading.Thread(target=work, args=(k, s), name=f"grpo-agent-{k}", daemon=True)
            for k, s in enumerate(sessions)
        ]
        deadline = step_deadline(self.timeout_s, self._paused, cut)
        for t in threads:
            t.start()
        for k, t in enumerate(threads):
            while t.is_alive() and (left := deadline() - time.monotonic()) > 0:
                t.join(min(left, 0.25))
            if t.is_alive():  # a thread cannot be stopped: its session ends, so its calls now get 409
                self._ended(sessions[k], "timeout")
        return results

    def _drive_async(self, sessions: list[Session], cut: threading.Event | None = None) -> list[tuple]:
        import httpx
        import openai

        deadline = step_deadline(self.timeout_s, self._paused, cut)

        async def one(s: Session, http):
            client = openai.AsyncOpenAI(
                base_url=self.server.base_url, api_key=s.key, max_retries=0, http_client=http
            )
            try:
                return await until(self.agent(client, copy.deepcopy(s.row)), deadline), None
            except TimeoutError:
                return None, "timeout"
            except Exception as err:  # noqa: BLE001
                return None, self._failure(s, err)

        async def everyone():
            async def ended(s, http):
                out = await one(s, http)
                self._ended(s, out[1])
                return out

            async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
                return await asyncio.gather(*(ended(s, http) for s in sessions))

        box: list = []
        # Its own thread and loop: the caller may be inside an event loop of its own (a notebook).
        thread = threading.Thread(
            target=lambda: box.append(asyncio.run(everyone())), name="grpo-agents", daemon=True
        )
        thread.start()
        thread.join()
        return list(box[0]) if box else [(None, "agent_error")] * len(sessions)

    def _refuse_if_all_failed(self, sessions: list[Session], episodes: list[Episode]) -> None:
        """An agent whose every episode failed for the same reason in its own code (it raised the same
        error, returned something that is not a reward, never called the model) before any episode of the
        run worked would train on nothing and end with advice about reward spread: stop with the cause
        instead. Timeouts and history rewrites are the model's doing as much as the agent's: never here."""
        notes = {self._notes.get(s.key) for s in sessions}
        kinds = {e.ended_by for e in episodes}
        self._worked = self._worked or not kinds <= set(FAILURES)
        if len(notes) != 1 or None in notes or not kinds <= {"agent_error", "no_calls"}:
            return
        if self._worked:  # it worked before: a flaky step is counted (episode/ended_by/*), the run goes on
            log.warning("Every episode of this step failed the same way in the agent: %s.", next(iter(notes)))
            return
        raise AgentFailed(
            f"Every episode of this step ({len(sessions)}) failed the same way in the agent: {notes.pop()}. "
            "Fix the agent (run it once against any OpenAI-compatible server to see it work), then start "
            "again."
        )

    def _failure(self, s: Session, err: BaseException, name: str | None = None) -> str:
        """`name`: the error's type name, where `err` stands for one raised in a worker process."""
        if s.ended == DISCARDED:
            return DISCARDED  # its agent saw the 409 of a discarded episode: nothing to say
        if s.ended in FAILURES:
            return s.ended  # bad_request / history: the gateway ended it, the agent's client then raised
        name = name or type(err).__name__
        self._notes[s.key] = f"it raised {name}: {str(err)[:300]}"
        if not getattr(self, "_said_error", False):
            self._said_error = True
            log.warning(
                "An agent raised %s: %s (its episode is scored as failed; said once).", name, clause(err)
            )
        return "agent_error"

    def _ended(self, s: Session, failure: str | None) -> None:
        s.end(failure or "answer")
        if self.gateway is not None:
            self.gateway.batcher.wake()

    def _episode(self, s: Session, value, failure: str | None) -> Episode:
        if failure is None and s.ended in FAILURES:
            failure = s.ended  # the agent caught the gateway's refusal and returned
        if failure is None and not s.calls:
            failure = "no_calls"
            self._notes[s.key] = "it never called the model (no request reached this episode's session)"
        if failure is None and value is not None and finite_reward(value) is None:
            log.warning("An agent returned %r, not a number or None: its episode is scored as failed.", value)
            failure = "agent_error"
            self._notes[s.key] = f"it returned {value!r}, which is not a number or None"
        # The episode's own reward wins (returned, else posted without a turn); else the sum of its per-turn
        # rewards; else None: the run's reward functions score it. The "turn" estimator reads both apart.
        reward = finite_reward(value) if failure is None and value is not None else s.reward
        from_turns = reward is None and bool(s.turn_rewards)
        if from_turns:
            reward = sum(s.turn_rewards.values())
        last = s.rows[-1] if s.rows else None
        ep = Episode(messages=[] if last is None else [dict(m) for m in last.messages[last.first_messages :]])
        ep.turns, ep.tool_calls = s.turns, s.tool_calls
        if failure is not None:
            ep.ended_by = failure
            ep.final_reward = 0.0 if self.failed_episode == "zero" else math.nan
        else:
            ep.ended_by = "max_tokens" if s.last_finish == "length" else "answer"
            ep.final_reward = reward
            ep.turn_rewards, ep.reward_is_turn_sum = dict(s.turn_rewards), from_turns
        ep.env_reward = reward if failure is None else None
        ep.env_class = "agent"  # its reward column
        return ep

    def _count(self, sessions: list[Session]) -> None:
        n = max(len(sessions), 1)
        self._metrics = {
            "gateway/rows_per_episode": sum(max(len(s.rows), 1) for s in sessions) / n,
            "gateway/forks": float(sum(s.forks for s in sessions)),
            "gateway/drift_tokens": float(sum(s.drift_tokens for s in sessions)),
            "gateway/calls_per_episode": sum(s.calls for s in sessions) / n,
        }


class RaisedInWorker(Exception):
    """An error an agent raised in a worker process, by its message (its type's name travels beside it)."""


def build_agent_runner(cfg, formatter, agent=None, **objects) -> AgentRunner:
    """The runner for GRPOTrainer(agent=) or env.agent; the family's tool-call parser reads every turn.
    (`objects`: the other runners' objects, which rollout/episodes.RUNNERS passes to every builder.)"""
    from grpo.agents.parsing import detect_parser

    del objects

    if agent is None:
        agent = cfg.env.agent
    if agent is None:  # env.agent_command: any language, one process per episode
        from grpo.gateway.agent_command import AgentCommand

        agent = AgentCommand(cfg.env.agent_command, timeout_s=cfg.env.episode_timeout_s)
    tokenizer = formatter.tokenizer
    parser = detect_parser(tokenizer, cfg.model.name_or_path, cfg.env.tool_parser, optional=True)
    limits = Limits(
        max_tokens=cfg.episode_max_tokens,
        turn_tokens=cfg.effective_max_new_tokens,
        max_prompt_tokens=cfg.data.max_prompt_length + cfg.episode_max_tokens,
    )
    runner = AgentRunner(
        agent,
        tokenizer,
        parser,
        limits,
        timeout_s=cfg.env.episode_timeout_s,
        failed_episode=cfg.env.failed_episode,
        strict_history=cfg.env.strict_history,
        template_kwargs=dict(cfg.data.chat_template_kwargs or {}),
        model_name=str(cfg.model.name_or_path),
        workers=cfg.env.agent_workers,
        ahead=cfg.env.agent_start_ahead,
        keep_alive=cfg.env.agent_keep_alive,
    )
    log.info(
        "Episodes: your agent %s through the gateway; up to %d tokens each; %s.",
        getattr(runner.agent, "__qualname__", runner.agent),
        limits.max_tokens,
        f"tool calls parsed as {parser.name}"
        if parser.name != "none"
        else "no tool calls (the chat template declares no tool-call format: requests that send tools get "
        "a 400; set env.tool_parser=hermes|llama3_json|mistral to the format the model writes)",
    )
    return runner


__all__ = ["AgentRunner", "build_agent_runner", "load_agent"]
