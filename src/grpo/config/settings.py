"""RunSettings: what a run decides at start-up, resolved once from the validated config plus what only the
start knows (the objects passed to GRPOTrainer, the environment's thread count, the data), then frozen.

The caller's GRPOConfig is never written after `validate()`: each decision is recorded here, and
`RunSettings.config` is a copy with the decisions written in: what config.yaml shows and what the run's parts
read. The decisions (cleanrl derives its sizes once, right after parsing, and never writes `args` again):

* the run name (a timestamp unless given), the CPU thread count, the model paths of passed-in objects;
* the Ray cluster several learner processes share (distributed/roles.py: `auto` when none was given);
* the checkpoint a Python run continues from, decided when `train(resume_from_checkpoint=...)` is called
  (run/lifecycle.py `plan_train`);
* what other Python objects stand in for (run/provenance.py: in-memory data, reward functions, tools);
* the reward functions and their weights after task detection, and the evaluation set;
* ONE completion limit: the tokens a rollout may add after the prompt. A single-turn run's is
  generation.max_new_tokens (capped by max_total_length); a multi-turn run's is the episode's, sampled and
  injected tokens together: env.max_tokens, else env.max_turns × the per-turn limit. Overlong shaping, the
  loss's constant normaliser, the context and memory preflights, the episode cap and vLLM's max_model_len
  all read this one number. When only the defaults make a multi-turn run's episode longer than the model's
  positions (no length setting given), the context preflight fits env.max_tokens to them (run/sizes.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grpo.config.keys import set_path
from grpo.config.schema import GenerationConfig
from grpo.config.tree import GRPOConfig

# The settings a start may decide (each one's reason is in the module docstring); nothing else is written.
DECIDED_KEYS = frozenset(
    {
        "train.run_name",
        "train.num_threads",
        "train.resume",
        "distributed.ray_address",
        "model.name_or_path",
        "model.tokenizer_path",
        "model.ref_model_path",
        "algorithm.reward_funcs",
        "algorithm.reward_weights",
        "data.eval_dataset",
        # what Python objects stand in for (run/provenance.py): the data, rewards, tools, environment
        "data.dataset",
        "data.hf_path",
        "algorithm.reward_model",
        "env.tools",
        "env.environment",
        # an episode budget only the defaults made longer than the model's positions (run/sizes.py)
        "env.max_tokens",
    }
)


def completion_limit(cfg: GRPOConfig, multi_turn: bool) -> int:
    """Tokens a rollout may add after its prompt: the episode's for multi-turn runs, else one sample's."""
    return cfg.episode_max_tokens if multi_turn else cfg.effective_max_new_tokens


def is_multi_turn(cfg: GRPOConfig, tools=None, environment=None, agent=None) -> bool:
    """Whether rollouts are episodes of several turns: tools, an environment or an agent (the gateway's),
    passed or configured."""
    e = cfg.env
    return bool(tools or e.tools or environment or e.environment or agent or e.agent or e.agent_command)


@dataclass(frozen=True)
class RunSettings:
    config: GRPOConfig  # a copy of the validated config with `decided` written in (read it, never write it)
    decided: Mapping[str, Any]  # dotted path -> the value the start chose (only DECIDED_KEYS)
    multi_turn: bool
    completion_limit: int  # see the module docstring: the one answer to "how long can a completion be"
    model_context: int | None = None  # the policy's positions, once its config is read (None: unknown)

    @classmethod
    def resolve(cls, cfg: GRPOConfig, decided: Mapping[str, Any], multi_turn: bool) -> RunSettings:
        unknown = set(decided) - DECIDED_KEYS
        if unknown:
            raise ValueError(f"not a start-up decision: {', '.join(sorted(unknown))}")
        resolved = copy.deepcopy(cfg)
        for path, value in decided.items():
            set_path(resolved, path, value)
        return cls(resolved, dict(decided), multi_turn, completion_limit(resolved, multi_turn))

    def extend(self, decided: Mapping[str, Any]) -> RunSettings:
        """These settings with more decisions (the data's, made after the run directory's)."""
        more = RunSettings.resolve(self.config, decided, self.multi_turn)
        return dataclasses.replace(
            more, decided={**self.decided, **more.decided}, model_context=self.model_context
        )

    def to_yaml(self) -> str:
        """What config.yaml holds (secrets redacted)."""
        return self.config.to_yaml()

    @property
    def turn_limit(self) -> int:
        """Tokens one sampling call may produce: one turn of an episode, or a single-turn completion."""
        return self.config.effective_max_new_tokens

    @property
    def max_model_len(self) -> int:
        """Positions an engine must hold for one rollout: generation.vllm_max_model_len when set, else the
        longest prompt plus the completion limit, within the model's positions (the context preflight has
        checked that the prompts the data has fit; a cap above the context would be refused by vLLM)."""
        g = self.config.generation
        if g.vllm_max_model_len:
            return g.vllm_max_model_len
        needed = self.config.data.max_prompt_length + self.completion_limit
        return min(needed, self.model_context) if self.model_context else needed

    @property
    def generation(self) -> GenerationConfig:
        """The generation section as engines use it: vllm_max_model_len filled in (config.yaml keeps the
        user's value, None when unset)."""
        return dataclasses.replace(self.config.generation, vllm_max_model_len=self.max_model_len)
