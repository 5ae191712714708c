"""Test doubles shared by several test modules (no fixtures here: plain classes)."""

import torch

from grpo.records import Rollouts


class CannedEngine:
    """A rollout engine whose completion for each prompt is the prompt's first token id; with
    CannedTokenizer that id decodes to a canned response."""

    def generate(self, prompt_ids, n, sampling, chunk_prompts=None):
        ids = torch.tensor([[ids[0]] for ids in prompt_ids for _ in range(n)])
        return Rollouts(
            group_ids=torch.arange(len(prompt_ids)).repeat_interleave(n),
            completion_ids=ids,
            completion_mask=torch.ones_like(ids, dtype=torch.float),
            sampling_logprobs=torch.zeros(ids.shape),
            truncated=torch.zeros(len(ids), dtype=torch.bool),
        )


class CannedTokenizer:
    """Prompt i tokenizes to [i]; token id i decodes to responses[i]."""

    chat_template = None

    def __init__(self, prompts, responses):
        self.index = {p: i for i, p in enumerate(prompts)}
        self.responses = responses

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[self.index[t]] for t in texts]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.responses[int(row[0])] for row in ids]
