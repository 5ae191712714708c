"""Rollout in the learner's process (`rollout.mode=colocated`, the default): a prompt feed, an engine and
the episode runner.

The source builds its engine. The native and transformers engines sample with the policy's own
parameters, so a weight sync costs nothing; vLLM keeps its own copy and reloads it
(`RolloutEngine.sync_weights`). Under FSDP2 no rank holds whole weights, so the engine samples from a full
copy that receives the gathered weights after every update (every rank takes part in the gather; each
samples its own prompts). Evaluation samples with the same engine and episodes; `close` releases it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch

from grpo.distributed.runtime import Runtime
from grpo.records import PromptBatch, Rollouts, SamplingParams
from grpo.rollout import RolloutEngine, build_engine
from grpo.rollout.engine import logprobs_match_policy
from grpo.rollout.episodes import EpisodeRunner, SingleTurn
from grpo.rollout.source import PromptFeed

Gather = Callable[[torch.nn.Module], Iterable[tuple[str, torch.Tensor]]]


class ColocatedRollout:
    def __init__(
        self,
        engine: RolloutEngine,
        feed: PromptFeed,
        num_generations: int,
        sampling: SamplingParams,
        chunk_prompts: int | None = None,
        gather: Gather | None = None,
        episodes: EpisodeRunner | None = None,
    ):
        self.engine, self.feed, self.n, self.sampling = engine, feed, num_generations, sampling
        self.chunk_prompts = chunk_prompts
        self.gather = gather  # set: the engine gets whole weights pushed by name (from a sharded policy)
        self.episodes = episodes or SingleTurn()
        self.multi_turn = self.episodes.multi_turn
        self.exact_logprobs = logprobs_match_policy(engine, sampling)
        self.sampler_differs = engine.sampler_differs
        self._next: tuple[PromptBatch, dict] | None = None  # start_next's prompts, the stream after them

    def next_batch(self) -> tuple[PromptBatch, Rollouts, int]:
        if self._next is not None:  # the episodes start_next began
            prompts, after = self._next
            self._next = None
            self.feed.stream.load_state_dict(after)
        else:
            prompts = self.feed.next()
        prompts, rollouts = self.episodes.run(
            self.engine, prompts, self.n, self.sampling, chunk_prompts=self.chunk_prompts
        )
        return prompts, rollouts, 0

    def start_next(self) -> None:
        """The next step's episodes start now, while the learner updates, where the runner can (the agent
        gateway's `start_ahead`: its agents' first requests are built and queued, then sampled with the new
        weights at next_batch). The prompt stream stays where it is until next_batch takes them: a checkpoint
        saved before that, or a stop, resumes with the same prompts, the started episodes discarded."""
        start = getattr(self.episodes, "start_ahead", None)
        if start is None or self._next is not None:
            return
        stream = self.feed.stream
        here = stream.state_dict()
        prompts = self.feed.next()
        after = stream.state_dict()
        stream.load_state_dict(here)
        if start(self.engine, prompts, self.n, self.sampling):
            self._next = (prompts, after)

    def sample(self, prompts: PromptBatch, n: int, sampling: SamplingParams) -> tuple[PromptBatch, Rollouts]:
        return self.episodes.run(self.engine, prompts, n, sampling, chunk_prompts=self.chunk_prompts)

    def sync_weights(self, step: int, policy: torch.nn.Module) -> None:
        del step  # colocated engines sample with the newest weights, whichever step made them
        if self.gather is not None:
            self.engine.load_weights(self.gather(policy))
        else:
            self.engine.sync_weights(policy)

    def data_state(self) -> dict:
        return self.feed.stream.state_dict()

    def metrics(self) -> dict[str, float]:
        own = getattr(self.episodes, "metrics", None)  # the agent gateway's (rows, forks, batching)
        return own() if own is not None else {}

    def close(self) -> None:
        if (stop := getattr(self.episodes, "close", None)) is not None:  # the agent gateway's server
            stop()
        close = getattr(self.engine, "close", None)  # an engine a caller made before engines had close()
        if close is not None:
            close()


def build(cfg, parts, rt: Runtime, feed: PromptFeed, sampling: SamplingParams, chunk_prompts: int | None):
    """The engine samples from the policy itself, or (FSDP2, about to shard it) from a full copy that gets
    the gathered weights after every update. `parts.engine`, when a caller set one, is used as given."""
    g, gather = cfg.generation, None
    model = parts.policy
    if rt.sharded:
        gather = rt.full_named_parameters
        if parts.engine is None or not parts.engine.needs_weight_sync:
            model = copy.deepcopy(parts.policy).to(parts.compute_dtype)
    engine = parts.engine
    if engine is None:
        engine = build_engine(
            g.engine,
            model,
            parts.tokenizer,
            g.compile_decode,
            parts.compute_dtype,
            # vLLM's max_model_len from the run's one completion limit (config/settings.py)
            generation=parts.settings.generation if getattr(parts, "settings", None) else g,
            seed=cfg.train.seed,
        )
    return ColocatedRollout(
        engine, feed, g.num_generations, sampling, chunk_prompts, gather, getattr(parts, "episodes", None)
    )
