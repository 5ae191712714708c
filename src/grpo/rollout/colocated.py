"""Rollout in the learner's process (`rollout.mode=colocated`, the default): a prompt feed and an engine.

The native and transformers engines sample with the policy's own parameters, so a weight sync costs
nothing; vLLM keeps its own copy and reloads it (`RolloutEngine.sync_weights`). Under FSDP2 no rank holds
whole weights, so the engine samples from a full copy that receives the gathered weights after every
update (every rank takes part in the gather; each samples its own prompts).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch

from grpo.distributed.runtime import Runtime
from grpo.records import PromptBatch, Rollouts, SamplingParams
from grpo.rollout import RolloutEngine, build_engine
from grpo.rollout.engine import logprobs_match_policy
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
    ):
        self.engine, self.feed, self.n, self.sampling = engine, feed, num_generations, sampling
        self.chunk_prompts = chunk_prompts
        self.gather = gather  # set: the engine gets whole weights pushed by name (from a sharded policy)
        self.exact_logprobs = logprobs_match_policy(engine, sampling)
        self.sampler_differs = engine.sampler_differs

    def next_batch(self) -> tuple[PromptBatch, Rollouts, int]:
        prompts = self.feed.next()
        rollouts = self.engine.generate(
            prompts.prompt_token_ids, self.n, self.sampling, chunk_prompts=self.chunk_prompts
        )
        return prompts, rollouts, 0

    def sync_weights(self, step: int, policy: torch.nn.Module) -> None:
        del step  # colocated engines sample with the newest weights, whichever step made them
        if self.gather is not None:
            self.engine.load_weights(self.gather(policy))
        else:
            self.engine.sync_weights(policy)

    def data_state(self) -> dict:
        return self.feed.stream.state_dict()

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass  # the engine outlives training: evaluation after the last step samples with it


def build(cfg, parts, rt: Runtime, feed: PromptFeed, sampling: SamplingParams, chunk_prompts: int | None):
    engine, gather = parts.engine, None
    if rt.sharded:
        if not engine.needs_weight_sync:  # it reads the policy's parameters, which FSDP2 is about to shard
            full = copy.deepcopy(parts.policy).to(parts.compute_dtype)
            # Evaluation samples from the same copy, the only whole weights on this rank.
            engine = parts.engine = build_engine(cfg.generation.engine, full, parts.tokenizer)
        gather = rt.full_named_parameters
    return ColocatedRollout(engine, feed, cfg.generation.num_generations, sampling, chunk_prompts, gather)
