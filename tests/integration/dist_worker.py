"""Run a short GRPO training as one process of a torchrun job (or alone), with scripted rollouts.

Used by test_distributed.py: `torchrun --nproc_per_node 2 dist_worker.py OUT key=value ... [OUT2 ...]`;
each argument without '=' starts another run in the same processes (one start-up for several runs).
The scripted engine makes every completion a function of its prompt and its index in the group, so
a run's numbers depend on the global batch only, not on how prompts are spread over processes.
"""

from __future__ import annotations

import sys
import zlib

import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import resolve_key
from grpo.records import Rollouts

BASE = {
    "batch_size": 4,
    "num_generations": 4,
    "max_new_tokens": 12,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-5,
    "warmup_steps": 0,
    "logging_steps": 1,
    "progress_bar": False,
    "seed": 7,
    "eval_dataset": None,
    "num_threads": 1,
    "beta": 0.04,
    "tensorboard": False,
    "loss_aggregation": "token_mean",
    "save_steps": 0,
    "report": False,  # its plots cost ~2 CPU-s a run (measured); no test here reads them
}


def shortness(prompts, completions, **_):
    return [-len(c) / 50 for c in completions]


class ScriptedEngine:
    """Completions drawn from a generator seeded by (prompt ids, index): the same on any rank layout."""

    exact_logprobs = sampler_differs = False
    needs_weight_sync = True  # it does not read the policy's parameters (so FSDP2 makes no copy of them)

    def __init__(self, vocab: int, pad_id: int, eos_id: int):
        self.vocab, self.pad_id, self.eos_id = vocab, pad_id, eos_id

    def load_weights(self, named_tensors) -> None:
        for _ in named_tensors:  # consume: under FSDP2 each item is a collective
            pass

    def sync_weights(self, policy) -> None:
        pass

    def generate(self, prompt_token_ids, n, sampling, chunk_prompts=None) -> Rollouts:
        t = sampling.max_new_tokens
        rows, masks = [], []
        for ids in prompt_token_ids:
            for j in range(n):
                g = torch.Generator().manual_seed(zlib.crc32(bytes(str((ids, j)), "utf-8")))
                length = int(torch.randint(1, t + 1, (1,), generator=g))
                tokens = torch.randint(3, self.vocab, (t,), generator=g)
                tokens[length:] = self.pad_id
                rows.append(tokens)
                masks.append((torch.arange(t) < length).float())
        mask = torch.stack(masks)
        return Rollouts(
            group_ids=torch.arange(len(prompt_token_ids)).repeat_interleave(n),
            completion_ids=torch.stack(rows),
            completion_mask=mask,
            sampling_logprobs=torch.zeros_like(mask),
            truncated=mask[:, -1] > 0,
        )


def run(output_dir: str, overrides: dict) -> dict:
    settings = {**BASE, "output_dir": output_dir}
    for key, value in overrides.items():  # replaces BASE's value of that field, whatever its spelling
        settings = {k: v for k, v in settings.items() if resolve_key(k) != resolve_key(key)}
        settings[key] = value
    cfg = GRPOConfig(**settings)
    trainer = GRPOTrainer(config=cfg, reward_funcs=[shortness])
    tok = trainer.parts.tokenizer
    trainer.parts.engine = ScriptedEngine(len(tok), tok.pad_token_id, tok.eos_token_id)
    return trainer.train()


if __name__ == "__main__":
    torch.set_num_threads(1)
    runs: list[tuple[str, dict]] = []
    for arg in sys.argv[1:]:
        if "=" in arg:
            runs[-1][1].update([arg.split("=", 1)])
        else:
            runs.append((arg, {}))
    for out, overrides in runs:
        run(out, overrides)
