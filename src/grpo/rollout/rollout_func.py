"""TRL's `rollout_func` as an episode runner: `GRPOTrainer(rollout_func=fn)` runs a TRL 1.16 rollout function
unchanged.

TRL 1.16's contract (trl/trainer/grpo_trainer.py, `RolloutFunc = Callable[[list, GRPOTrainer], dict]`): the
function receives this process's prompts (as the dataset gives them, chat messages kept; each prompt once) and
the trainer, and returns a dict with
    "prompt_ids"       one token-id list per completion (or one per prompt): the prompt as it rendered it
    "completion_ids"   one token-id list per completion, num_generations per prompt, prompt by prompt
    "logprobs"         one list per completion: the sampler's log-prob of each completion token
    "env_mask"         optional, one list per completion: 1 on tokens the model sampled, 0 on tokens an
                       environment added (not trained on; TRL's tool_mask)
and any other key: one value per completion (or one for all), passed to reward functions as a column.
Chat templating is the function's: the prompts reach it as they are, and its prompt_ids are what the learner
scores the completions after. Inside it, `trainer.rollout_engine` is the run's rollout engine (its
`generate(prompt_ids, n, trainer.rollout_sampling)` samples from the current policy) and
`trainer.num_generations` the completions wanted per prompt.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from grpo.agents.environments import EnvironmentContractError
from grpo.config import ConfigError
from grpo.records import PromptBatch, Rollouts, SamplingParams

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


class RolloutFuncError(EnvironmentContractError):
    """A rollout_func returned something outside TRL's contract (one line: what, and what is expected)."""


class RolloutFunc:
    """Runs `fn(prompts, trainer)` for every batch (see the module docstring)."""

    multi_turn = False
    renders_prompts = True  # TRL: chat templating happens inside rollout_func
    reward_names: tuple[str, ...] = ()

    def __init__(self, fn, num_generations: int, pad_id: int, eos_ids: set[int]):
        self.fn, self.num_generations, self.pad_id, self.eos_ids = fn, num_generations, pad_id, eos_ids
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.trainer = None  # GRPOTrainer sets itself here: TRL passes the trainer as the second argument

    def check_prompts(self, rows: list[dict]) -> None:
        del rows

    def close(self) -> None:
        pass

    def run(self, engine, prompts: PromptBatch, n: int, sampling: SamplingParams, chunk_prompts=None):
        del chunk_prompts
        if self.trainer is not None:
            self.trainer.rollout_engine, self.trainer.rollout_sampling = engine, sampling
            self.trainer.num_generations = n
        out = self.fn(list(prompts.prompts), self.trainer)
        if not isinstance(out, dict) or any(k not in out for k in REQUIRED):
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise RolloutFuncError(
                f"rollout_func {self.name} must return a dict with {', '.join(REQUIRED)} (TRL 1.16); "
                f"got {got}."
            )
        p, total = len(prompts), len(prompts) * n
        completions = self._per_completion(out, "completion_ids", total)
        logprobs = self._per_completion(out, "logprobs", total)
        mask_given = out.get("env_mask")
        env_mask = None if mask_given is None else self._per_completion(out, "env_mask", total)
        prompt_ids = self._prompt_ids(out["prompt_ids"], p, n)
        width = max(1, max(len(c) for c in completions))
        ids = torch.full((total, width), self.pad_id, dtype=torch.long)  # [N, T]
        mask, lp, loss = torch.zeros(total, width), torch.zeros(total, width), torch.zeros(total, width)
        for r, tokens in enumerate(completions):
            k = len(tokens)
            if len(logprobs[r]) != k or (env_mask is not None and len(env_mask[r]) != k):
                raise RolloutFuncError(
                    f"rollout_func {self.name}: completion {r} has {k} token ids but {len(logprobs[r])} "
                    "logprobs"
                    + ("" if env_mask is None else f" and {len(env_mask[r])} env_mask entries")
                    + "; "
                    "give one per completion token."
                )
            ids[r, :k] = torch.tensor(tokens, dtype=torch.long)
            mask[r, :k] = 1.0
            values = [float(x) for x in logprobs[r]]
            if not all(math.isfinite(x) for x in values):
                raise RolloutFuncError(f"rollout_func {self.name}: completion {r} has a non-finite log-prob.")
            lp[r, :k] = torch.tensor(values)
            loss[r, :k] = torch.tensor([float(x) for x in env_mask[r]]) if env_mask is not None else 1.0
        truncated = torch.tensor([not c or c[-1] not in self.eos_ids for c in completions])
        extra = {k: v for k, v in out.items() if k not in (*REQUIRED, "env_mask")}
        for k, v in extra.items():
            if isinstance(v, list) and len(v) != total:
                raise RolloutFuncError(
                    f"rollout_func {self.name}: '{k}' has {len(v)} values for {total} completions; give "
                    "one per completion (or a single value for all)."
                )
        rows = [{k: (v[r] if isinstance(v, list) else v) for k, v in extra.items()} for r in range(total)]
        rollouts = Rollouts(
            group_ids=torch.arange(total) // n,
            completion_ids=ids,
            completion_mask=mask,
            sampling_logprobs=lp * loss,
            truncated=truncated,
            loss_mask=loss if env_mask is not None else None,
            extra_fields=rows if extra else None,
        )
        return dataclasses.replace(prompts, prompt_token_ids=prompt_ids), rollouts

    def _per_completion(self, out: dict, key: str, total: int) -> list[list]:
        value = out[key]
        if not isinstance(value, list | tuple) or len(value) != total:
            count = len(value) if isinstance(value, list | tuple) else type(value).__name__
            raise RolloutFuncError(
                f"rollout_func {self.name}: '{key}' has {count} entries for {total} completions "
                "(prompts × num_generations); give one list per completion."
            )
        return [list(v.tolist() if isinstance(v, torch.Tensor) else v) for v in value]

    def _prompt_ids(self, given, p: int, n: int) -> list[list[int]]:
        given = [list(v.tolist() if isinstance(v, torch.Tensor) else v) for v in given]
        if len(given) == p:
            return given
        if len(given) != p * n:
            raise RolloutFuncError(
                f"rollout_func {self.name}: 'prompt_ids' has {len(given)} entries; give one per completion "
                f"({p * n}) or one per prompt ({p})."
            )
        for i in range(p):
            if any(given[i * n + k] != given[i * n] for k in range(1, n)):
                raise RolloutFuncError(
                    f"rollout_func {self.name}: the {n} completions of prompt {i} came from different "
                    "prompt_ids; GRPO compares a group's completions of one prompt."
                )
        return [given[i * n] for i in range(p)]


def build(cfg, formatter, rollout_func=None, **objects) -> RolloutFunc:
    del objects
    if not callable(rollout_func):
        raise ConfigError(
            f"rollout_func must be a function (prompts, trainer) -> dict, not {rollout_func!r:.80}."
        )
    tokenizer = formatter.tokenizer
    eos = tokenizer.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return RolloutFunc(rollout_func, cfg.generation.num_generations, pad, eos_ids)
