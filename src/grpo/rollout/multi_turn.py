"""The multi-turn episode runner: every episode of a step advances together, one batched engine call a turn.

    sample a turn → parse its tool calls → env.step(conversation, turn) → run every episode's tool calls at
    once (time-limited) when the environment asks for it, or inject the messages it answers → append the
    injected messages' tokens (loss_mask 0) → repeat until an answer, `done`, or a cap (turns, tokens per
    episode, tokens per turn)

The loop talks to each episode's environment only through the Environment protocol (agents/environments.py).

Token in, token out: sampled ids are kept as sampled; an injected message's ids are the chat template's
rendering of the conversation with it minus the rendering without it (agents/chat.py). Nothing sampled is
ever re-tokenized, so the learner scores exactly the tokens the sampler produced.

A completion here is everything after the prompt: [turn 1 | tool result | turn 2 | ...]; `loss_mask` marks
the sampled turns. A group's G episodes start from one prompt (GRPO's baseline compares them), so an
environment whose reset gives different starting points for the same row is refused.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from grpo.agents.chat import ChatRenderer
from grpo.agents.environments import Environment, EnvironmentContractError
from grpo.agents.factory import EnvironmentFactory, build_factory
from grpo.agents.messages import assistant_message, tool_messages
from grpo.agents.parsing import ParsedTurn, ToolCallParser, detect_parser, parse_turn
from grpo.agents.tools import ToolBox
from grpo.config import ConfigError
from grpo.model.turn_kv import TurnCache, takes_kv
from grpo.records import Episode, PromptBatch, Rollouts

log = logging.getLogger("grpo")


@dataclasses.dataclass
class EpisodeLimits:
    max_turns: int  # assistant turns per episode
    max_tokens: int  # completion tokens per episode, sampled and injected
    turn_tokens: int  # sampled tokens per turn (generation.max_new_tokens)


@dataclasses.dataclass
class EpisodeState:
    """One episode in progress."""

    group: int
    row: dict
    env: Environment
    messages: list[dict]  # the whole conversation so far, prompt included
    prompt_messages: int  # how many of `messages` are the prompt
    ids: list[int] = dataclasses.field(default_factory=list)  # completion ids so far
    sampled: list[float] = dataclasses.field(default_factory=list)  # 1 = sampled, 0 = injected
    logprobs: list[float] = dataclasses.field(default_factory=list)
    episode: Episode = dataclasses.field(default_factory=lambda: Episode(messages=[]))
    done: bool = False
    toolbox: ToolBox | None = None  # this episode's own tools (an environment instance's methods)

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.sampled += [1.0 if logprobs is not None else 0.0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def end(self, why: str) -> None:
        self.done, self.episode.ended_by = True, why


class MultiTurn:
    """Episodes with tools or an environment (see the module docstring)."""

    multi_turn = True
    renders_prompts = True  # with the tools each row's environment declares
    # A later turn prefills only its new ids where the engine keeps each row's K/V (the native one,
    # model/turn_kv.py); off, every turn prefills each row's whole conversation.
    reuse_kv = True

    def __init__(
        self,
        factory: EnvironmentFactory,
        formatter,
        parser: ToolCallParser,
        limits: EpisodeLimits,
        *,
        tool_timeout_s: float = 10.0,
        tool_max_chars: int = 4000,
    ):
        self.factory, self.formatter, self.parser, self.limits = factory, formatter, parser, limits
        self.tokenizer = formatter.tokenizer
        # Environment instances are stateful: one episode's calls run in the order written (episodes still
        # run concurrently); plain tools are stateless and all run at once.
        self.toolbox = ToolBox(
            factory.fixed_tools,
            timeout_s=tool_timeout_s,
            max_chars=tool_max_chars,
            in_episode_order=factory.stateful,
        )
        self.reward_names = factory.reward_names  # the environments' reward columns (reward/<ClassName>)
        self.template_kwargs = dict(formatter.cfg.chat_template_kwargs or {})
        self.special_ids = set(self.tokenizer.all_special_ids)
        self._said_template = False
        self._template_errors: list[str] = []
        self._renderers: dict[str, ChatRenderer] = {}
        self.kv_tokens = (0, 0)  # the last step's (positions reused, positions prefilled)

    def renderer(self, schemas: list[dict]) -> ChatRenderer:
        key = repr(schemas)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, schemas or None, **self.template_kwargs)
        return self._renderers[key]

    # -- the episode loop ---------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, engine, prompts, n, sampling, chunk_prompts=None):
        del chunk_prompts  # one row per live episode; the engine bounds its own batch
        prompts, live = self._start(prompts, n)
        lim = self.limits
        # Lives for this step's episodes only: its K/V are of the weights they were sampled with.
        cache = TurnCache() if self.reuse_kv and takes_kv(engine) else None
        for turn in range(1, lim.max_turns + 1):
            for e in live:
                if not e.done and len(e.ids) >= lim.max_tokens:
                    e.end("max_tokens")
            active = [e for e in live if not e.done]
            if not active:
                break
            room = [lim.max_tokens - len(e.ids) for e in active]  # each ≥ 1
            step_sampling = dataclasses.replace(
                sampling, max_new_tokens=max(1, min(lim.turn_tokens, max(room)))
            )
            out = self._sample(engine, prompts, live, n, turn, step_sampling, cache)
            waiting: list[tuple[EpisodeState, ParsedTurn]] = []
            for r, (e, budget) in enumerate(zip(active, room, strict=True)):
                parsed = self._take_turn(e, out, r, budget, turn)
                if parsed is not None:
                    waiting.append((e, parsed))
            if waiting:
                self._run_tools(waiting)
        for e in live:
            if not e.done:  # the last allowed turn asked for more
                e.end("max_turns")
            e.episode.messages = e.messages[e.prompt_messages :]
            e.episode.env_reward = e.env.reward()
            e.episode.environment = e.env.instance
            e.episode.env_class = e.env.name
        if self._template_errors and all(e.episode.ended_by == "template" for e in live):
            raise EnvironmentContractError(
                f"Every episode of the step ended after its first injected message: the chat template cannot "
                f"render it ({self._template_errors[0]}). Make the environment's messages plain "
                "role/content text the template accepts."
            )
        self._template_errors.clear()
        self.kv_tokens = (cache.reused_tokens, cache.prefilled_tokens) if cache is not None else (0, 0)
        return prompts, self._rollouts(live)

    @staticmethod
    def _sample(engine, prompts, live: list[EpisodeState], n, turn, sampling, cache: TurnCache | None):
        """One turn of every live episode, in one engine call; with a cache, each episode's rows by its
        index in `live`."""
        keys = [k for k, e in enumerate(live) if turn == 1 or not e.done]  # turn 1: P·n rows, every episode
        if cache is not None:
            cache.retain(keys)  # an episode that ended holds no K/V
        kv = {} if cache is None else {"kv": cache.bind(keys)}
        if turn == 1:  # every episode of a group starts from its prompt: the shared-prompt fast path
            return engine.generate(prompts.prompt_token_ids, n, sampling, **kv)
        rows = [prompts.prompt_token_ids[live[k].group] + live[k].ids for k in keys]
        return engine.continue_rows(rows, sampling, **kv)

    def _run_tools(self, waiting: list[tuple[EpisodeState, ParsedTurn]]) -> None:
        """Every waiting episode's calls at once; each episode gets its results as tool messages."""
        boxes = [self._toolbox(e) for e, _ in waiting]
        results = self.toolbox.run([p for _, p in waiting], episode_tools=boxes)
        for (e, parsed), res in zip(waiting, results, strict=True):
            self._inject(e, tool_messages(parsed, res, e.episode.turns))
            e.episode.tool_calls += sum(x.call is not None for x in res)
            for x in res:
                if x.error:
                    e.episode.tool_errors[x.error] = e.episode.tool_errors.get(x.error, 0) + 1

    def _take_turn(self, e: EpisodeState, out: Rollouts, r: int, budget: int, turn: int) -> ParsedTurn | None:
        """Append row r of a turn's sampling to episode e; the parsed turn when its tool calls are to run."""
        length = int(out.completion_mask[r].sum())
        cut = min(length, budget)
        new = out.completion_ids[r, :cut].tolist()
        e.add(new, out.sampling_logprobs[r, :cut].tolist())
        e.episode.turns = turn
        # Special tokens stay: some formats mark calls with them (Mistral's [TOOL_CALLS]); the end-of-turn
        # token is not content.
        body = new[:-1] if new and new[-1] in self.special_ids else new
        parsed = parse_turn(self.parser, self.tokenizer.decode(body, skip_special_tokens=False))
        e.messages.append(assistant_message(parsed, turn))
        if cut < length or (bool(out.truncated[r]) and cut >= budget):
            e.end("max_tokens")
            return None
        if bool(out.truncated[r]):
            e.end("turn_length")
            return None
        result = e.env.step(e.messages, parsed)
        if result.run_calls:
            if turn < self.limits.max_turns:
                return parsed
            e.episode.tool_calls += len(parsed.calls)
            e.end("max_turns")
        elif result.done or not result.messages:
            e.end(result.ended_by)
        else:
            self._inject(e, result.messages, from_env=True)
        return None

    def _toolbox(self, e: EpisodeState) -> ToolBox:
        """The tools this episode's environment offers (an instance's own methods get a box of their own)."""
        if e.toolbox is None:
            same = e.env.tools.keys() == set(self.toolbox.names)
            e.toolbox = (
                self.toolbox if same else ToolBox(e.env.tools, self.toolbox.timeout_s, self.toolbox.max_chars)
            )
        return e.toolbox

    def _inject(self, e: EpisodeState, messages: list[dict], from_env: bool = False) -> None:
        """Append the tokens of injected messages (loss_mask 0), ending the episode if they do not fit."""
        history = e.messages
        renderer = self.renderer(self.factory.schemas(e.row))
        ids = []
        end = self.tokenizer.convert_tokens_to_ids(renderer.end_of_turn)
        if e.ids and e.ids[-1] != end:
            # The turn stopped on a stop string: the template closes it with the end-of-turn token.
            ids.append(end)
        try:
            ids += renderer.injected_ids(history, messages)
        except Exception as err:  # noqa: BLE001 - a template that cannot render this turn ends the episode
            # e.g. Llama 3's template takes one tool call per assistant turn and raises on two.
            if not self._said_template:
                self._said_template = True
                log.warning("An episode ended: the chat template cannot render its next turn (%s).", err)
            if from_env:  # the environment's own messages, not a turn the model wrote
                self._template_errors.append(f"{type(err).__name__}: {err}")
            e.end("template")
            return
        if len(e.ids) + len(ids) > self.limits.max_tokens:
            e.end("max_tokens")
            return
        e.add(ids, None)
        e.messages = [*history, *messages]

    # -- start and finish ---------------------------------------------------------------------------
    def _start(self, prompts: PromptBatch, n: int) -> tuple[PromptBatch, list[EpisodeState]]:
        live, ids = [], []
        slots: dict = {}  # the next environment instance of each class (TRL: construct once, reset often)
        for i, prompt in enumerate(prompts.prompts):
            row = {"prompt": prompt, **{k: v[i] for k, v in prompts.columns.items()}}
            base = self.formatter.messages(prompt)
            group = []
            for _ in range(n):
                key = row.get("environment") if self.factory.multi_factory else None
                slots[key] = slots.get(key, -1) + 1
                env = self.factory.make(row, slots[key])
                start = env.start(base, self.factory.reset_row(row))
                group.append(EpisodeState(i, row, env, list(start), len(start)))
            first = group[0].messages
            if any(g.messages != first for g in group[1:]):
                raise EnvironmentContractError(
                    f"The environment started the {n} episodes of one prompt (dataset row "
                    f"{prompts.indices[i] if prompts.indices else i}) from different conversations. GRPO "
                    "compares a group's episodes from one starting point: make reset deterministic for a "
                    "row, or put the variation in the dataset."
                )
            ids.append(self._prompt_ids(first, row, prompts.indices[i] if prompts.indices else i))
            live += group
        prompts = dataclasses.replace(
            prompts,
            prompts=[g.messages[: g.prompt_messages] for g in live[::n]],
            prompt_token_ids=ids,
        )
        return prompts, live

    def _prompt_ids(self, messages: list[dict], row: dict, index: int) -> list[int]:
        ids = self.renderer(self.factory.schemas(row)).prompt_ids(messages)
        limit = self.formatter.cfg.max_prompt_length
        if len(ids) > limit:
            raise ConfigError(
                f"Dataset row {index}'s prompt is {len(ids)} tokens with the tool descriptions the chat "
                f"template adds, more than data.max_prompt_length = {limit}: raise data.max_prompt_length "
                "(and keep prompt + env.max_tokens within the model's context)."
            )
        return ids

    def check_prompts(self, rows: list[dict], sample: int = 64) -> None:
        """At start-up: the template keeps earlier turns with a real prompt's opening (a system message
        changes some templates), reset takes the rows' columns, and the first rows' prompts with their tools
        fit data.max_prompt_length."""
        self.factory.check_rows(rows)
        if rows:
            opening = self.formatter.messages(rows[0]["prompt"])
            renderer = self.renderer(self.factory.schemas(rows[0]))
            refuse_rewriting_template(renderer, self.formatter.tokenizer.name_or_path, opening)
        for index, row in enumerate(rows[:sample]):
            self._prompt_ids(self.formatter.messages(row["prompt"]), row, index)

    def environment_samples(self) -> list:
        """One live instance of each environment class (a start-up check that they can travel to Ray)."""
        return self.factory.samples()

    def close(self) -> None:
        """Every environment instance closed (the next run makes fresh ones)."""
        self.factory.close()

    def _rollouts(self, live: list[EpisodeState]) -> Rollouts:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = [(e.group, e.episode, e.ids, e.sampled, e.logprobs) for e in live]
        return episode_rollouts(rows, pad)


def episode_rollouts(rows: list[tuple], pad: int) -> Rollouts:
    """Episodes as padded Rollouts: each row is (group, Episode, completion ids, sampled flags, log-probs);
    `loss_mask` is the sampled flags, and log-probs count only where sampled."""
    width = max(1, max(len(ids) for _, _, ids, _, _ in rows))
    n = len(rows)
    ids_t = torch.full((n, width), pad, dtype=torch.long)  # [N, T]
    mask, loss, logprobs = torch.zeros(n, width), torch.zeros(n, width), torch.zeros(n, width)  # [N, T]
    for r, (_, _, ids, sampled, lps) in enumerate(rows):
        k = len(ids)
        ids_t[r, :k] = torch.tensor(ids, dtype=torch.long)
        mask[r, :k] = 1.0
        loss[r, :k] = torch.tensor(sampled)
        logprobs[r, :k] = torch.tensor(lps)
    episodes = [e for _, e, _, _, _ in rows]
    return Rollouts(
        group_ids=torch.tensor([g for g, *_ in rows], dtype=torch.long),
        completion_ids=ids_t,
        completion_mask=mask,
        sampling_logprobs=logprobs * loss,
        truncated=torch.tensor([ep.truncated for ep in episodes]),
        loss_mask=loss,
        episodes=episodes,
    )


def refuse_rewriting_template(renderer: ChatRenderer, name: str, opening: list[dict] | None = None) -> None:
    problem = renderer.prefix_problem(opening)
    if problem is not None:
        raise ConfigError(
            f"{name}: {problem} Training on its episodes would score tokens the model never saw. Give the "
            "tokenizer a chat template that renders earlier turns as they were sampled "
            "(tokenizer.chat_template = ...; for Qwen3, one that keeps every assistant turn's <think> "
            "block), then start again."
        )


def build(cfg, formatter, tools=None, environment=None, max_tokens=None, **objects) -> MultiTurn:
    """Multi-turn episodes with tools or an environment (objects from GRPOTrainer(tools=,
    environment_factory=), else env.tools / env.environment import paths). Refuses at start-up a model whose
    tool-call format is unknown or whose chat template rewrites earlier turns. `max_tokens`: the run's one
    completion limit (RunSettings.completion_limit) that the preflights checked."""
    from grpo.agents.workers import isolate_factory

    del objects
    tool_specs, environment_spec = tools or cfg.env.tools, environment or cfg.env.environment
    factory = build_factory(tool_specs, environment_spec)
    if factory is None:
        raise ConfigError("Multi-turn episodes need tools or an environment (env.tools / env.environment).")
    isolate_factory(
        factory, tool_specs, environment_spec, cfg.algorithm.reward_isolation, cfg.env.tool_timeout_s
    )
    name = cfg.model.name_or_path
    parser = detect_parser(formatter.tokenizer, name, cfg.env.tool_parser)
    schemas = factory.any_schemas()
    kwargs = dict(cfg.data.chat_template_kwargs or {})
    refuse_rewriting_template(ChatRenderer(formatter.tokenizer, schemas or None, **kwargs), name)
    limits = EpisodeLimits(
        cfg.env.max_turns, max_tokens or cfg.episode_max_tokens, cfg.effective_max_new_tokens
    )
    log.info(
        "Episodes: up to %d turns and %d tokens each; tools %s; tool calls parsed as %s.",
        limits.max_turns,
        limits.max_tokens,
        ", ".join(s["function"]["name"] for s in schemas) or "from the environment",
        parser.name,
    )
    return MultiTurn(
        factory,
        formatter,
        parser,
        limits,
        tool_timeout_s=cfg.env.tool_timeout_s,
        tool_max_chars=cfg.env.tool_max_chars,
    )
