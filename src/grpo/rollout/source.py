"""Where the loop gets each step's rollouts: one `RolloutSource` per deployment, picked by `rollout.mode`.

    colocated   rollout/colocated.py   the learner's process samples with an engine (native, transformers,
                                       vLLM, or the full copy FSDP2 needs)
    sync|async  rollout/ray.py         Ray actors sample with their own copies, on- or off-policy

The loop asks a source for a batch, trains on it and hands it the new weights; everything that
differs between deployments (who holds weights, how far sampling runs ahead, what data position a
checkpoint must record) stays behind these calls. DAPO's dynamic sampling sits above the source
(train.collect), so it works the same on all of them.

A source owns its engine(s): it builds them, syncs them, samples evaluations with them (`sample`, with the
newest weights) and closes them. Inside it, an episode runner (rollout/episodes.py) turns prompts into
completions: one turn, or a multi-turn episode with tools or an environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from grpo.distributed.runtime import Runtime
from grpo.plugins import Registry
from grpo.records import PromptBatch, Rollouts, SamplingParams, join_rows, take_rows

if TYPE_CHECKING:  # grpo.data reads the config, whose choices for rollout.mode are SOURCES' keys
    from grpo.data import PromptFormatter, PromptStream

# rollout.mode → the module:function that builds its source; import paths, so listing them imports none.
SOURCES: Registry = Registry(
    "distributed.rollout_mode",
    {
        "colocated": "grpo.rollout.colocated:build",
        "sync": "grpo.rollout.ray:build",
        "async": "grpo.rollout.ray:build",
    },
)


class RolloutSource(Protocol):
    # The sampling log-probs are the learner's π_θ (see RolloutEngine.exact_logprobs) for this sampling.
    exact_logprobs: bool
    # Sampled by other kernels than the learner's: the learner corrects with importance weights.
    sampler_differs: bool
    multi_turn: bool  # completions are episodes (tools or an environment), not one sampled turn

    def next_batch(self) -> tuple[PromptBatch, Rollouts, int]:
        """The next step's prompts, their rollouts, and the lag: learner steps between the weights that
        sampled them and now (0 on-policy)."""

    def sample(self, prompts: PromptBatch, n: int, sampling: SamplingParams) -> tuple[PromptBatch, Rollouts]:
        """Prompts outside the training stream (evaluation), sampled now with the newest weights, through
        the same episodes as training."""

    def sync_weights(self, step: int, policy: torch.nn.Module) -> None:
        """From now on sample with `policy`'s weights, those of learner step `step`: called once before the
        first batch (a resumed run's weights) and after every update. On every rank (it may gather)."""

    def data_state(self) -> dict:
        """The prompt stream's position after the last batch handed out, for a checkpoint."""

    def metrics(self) -> dict[str, float]:
        """Source-specific metrics for this step's line (e.g. staleness)."""

    def close(self) -> None: ...


class PromptFeed:
    """Each step's prompts: the next P rows of the stream, this process's whole groups, tokenized (unless the
    episode runner renders them itself: `tokenize=False` leaves prompt_token_ids empty for it to fill)."""

    def __init__(
        self,
        stream: PromptStream,
        formatter: PromptFormatter,
        rt: Runtime,
        per_step: int,
        tokenize: bool = True,
    ):
        self.stream, self.formatter, self.rt, self.per_step = stream, formatter, rt, per_step
        self.tokenize = tokenize

    def next(self) -> PromptBatch:
        from grpo.data import make_prompt_batch

        indices, rows = self.rt.shard(*self.stream.next_rows(self.per_step))
        return make_prompt_batch(indices, rows, self.formatter, tokenize=self.tokenize)


def prompt_rows(batch: PromptBatch, rows: slice) -> PromptBatch:
    """Some prompts of a batch (a rollout actor's share)."""
    return take_rows(batch, rows)


def join_prompts(parts: list[PromptBatch]) -> PromptBatch:
    return join_rows(parts)


def build_source(cfg, parts, rt: Runtime, stream: PromptStream, sampling: SamplingParams) -> RolloutSource:
    """The source `distributed.rollout_mode` names, sampling `generation.num_generations` per prompt in
    chunks of `generation.batch_size` completions. Build it before the learner shards the policy."""
    g = cfg.generation
    renders = getattr(parts, "episodes", None) is not None and parts.episodes.renders_prompts
    feed = PromptFeed(stream, parts.formatter, rt, cfg.train.prompts_per_step, tokenize=not renders)
    chunk_prompts = None if g.batch_size is None else max(1, g.batch_size // g.num_generations)
    return SOURCES[cfg.distributed.rollout_mode](cfg, parts, rt, feed, sampling, chunk_prompts)
