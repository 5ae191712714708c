"""Rollout on `transformers` `generate`, colocated with the learner (it samples with the live policy).

Sampling log-probs: `generate` can return every step's full score matrix, but that is
[N, vocab] per token — gigabytes for a 150k vocabulary. Instead we switch generate's own
temperature/top-k/top-p warpers off and apply them in one logits processor that runs last, so the
distribution generate samples from is exactly the one we recorded; the processor keeps only the
previous step's log-softmax and gathers the chosen token's log-prob when the next step reveals it.

Streaming (the gateway's `on_step`): generate hands each step's tokens to a streamer; `_StepReporter` passes
on those of the rows still sampling (after eos or a stop string generate pads a row, and those pads are not
tokens of the reply).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from grpo.model.loading import autocast
from grpo.records import Rollouts, SamplingParams
from grpo.rollout.engine import copy_weights, generate_in_chunks
from grpo.rollout.sampling import filter_logits, pad_and_eos

# Our processor applies temperature/top-k/top-p; generate's own warpers stay off (top_k=0 disables it)
# so the distribution generate samples from is exactly the one recorded.
_WARPERS_OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


class _RecordingSampler(LogitsProcessor):
    def __init__(self, prompt_width: int, sampling: SamplingParams):
        self.prompt_width = prompt_width
        self.sampling = sampling
        self.previous: torch.Tensor | None = None  # [N, V] log-softmax of the last step
        self.logprobs: list[torch.Tensor] = []  # each [N]

    def record(self, chosen: torch.Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(-1, chosen[:, None]).squeeze(-1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_width:
            self.record(input_ids[:, -1])
        s = self.sampling
        if not s.greedy:
            scores = filter_logits(scores.float(), s.temperature, s.top_k, s.top_p)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores


class _StepReporter(BaseStreamer):
    """A streamer for `generate`: on_step(rows, tokens) with each decode step's tokens of the rows still
    sampling. A row stops after an eos id or once its recent text holds a stop string (the rule generate's
    StopStringCriteria and `_completion_mask` apply), so nothing streams that the final reply cuts."""

    def __init__(self, on_step, eos_ids: set[int], tokenizer, stop_strings: list[str]):
        self.on_step, self.eos_ids, self.tokenizer = on_step, eos_ids, tokenizer
        self.stops = list(stop_strings or [])
        self.window = max((len(s) for s in self.stops), default=0) + 2  # a token is ≥ 1 character
        self.sampled: list[list[int]] = []
        self.alive: list[bool] = []

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 2:  # generate's first call: the prompts
            return
        tokens = value.tolist()
        if not self.alive:
            self.alive, self.sampled = [True] * len(tokens), [[] for _ in tokens]
        rows = [r for r, live in enumerate(self.alive) if live]
        if not rows:
            return
        for r in rows:
            self.sampled[r].append(tokens[r])
            tail = self.sampled[r][-self.window :]
            if tokens[r] in self.eos_ids or (
                self.stops and any(s in self.tokenizer.batch_decode([tail])[0] for s in self.stops)
            ):
                self.alive[r] = False
        self.on_step(rows, [tokens[r] for r in rows])

    def end(self) -> None:
        pass


class TransformersEngine:
    """RolloutEngine on `model.generate`; shares the learner's parameters (no weight sync)."""

    exact_logprobs = False  # generate's kernels (KV cache, batched prompts) round differently from training's
    sampler_differs = False
    needs_weight_sync = False

    def __init__(self, model, tokenizer, compute_dtype: torch.dtype | None = None):
        self.model = model
        self.compute_dtype = compute_dtype  # autocast during generate (float32 masters, bf16/fp16 matmuls)
        self.tokenizer = tokenizer
        self.pad_id, eos = pad_and_eos(model, tokenizer)
        self.eos_ids = set(eos)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        chunk_prompts: int | None = None,
        on_step=None,
    ) -> Rollouts:
        if on_step is not None:  # the gateway: one call, each step's tokens reported (see continue_rows)
            with torch.no_grad():
                return self._generate(prompt_token_ids, n, sampling, on_step)
        return generate_in_chunks(self._generate, prompt_token_ids, n, sampling, chunk_prompts, self.pad_id)

    def continue_rows(self, rows: list[list[int]], sampling: SamplingParams, on_step=None) -> Rollouts:
        """on_step(rows, tokens), when given, receives each decode step's sampled tokens of the rows still
        sampling (the gateway streams them as they are sampled)."""
        return self.generate(rows, 1, sampling, on_step=on_step)  # each row its own prompt

    def close(self) -> None:
        pass  # holds nothing outside the policy's own parameters

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_weights(self.model, named_tensors)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        pass  # generate runs self.model, the policy itself unless weights arrive by load_weights

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, on_step=None) -> Rollouts:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [P, Lp] left-padded
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        recorder = _RecordingSampler(width, sampling)
        was_training = self.model.training
        self.model.eval()
        with autocast(device, self.compute_dtype):  # weight casts are cached for the whole call
            streamer = None
            if on_step is not None:
                streamer = _StepReporter(on_step, self.eos_ids, self.tokenizer, sampling.stop_strings)
            out = self._sample(input_ids.to(device), attention.to(device), n, sampling, recorder, streamer)
        self.model.train(was_training)
        completion = out.sequences[:, width:].cpu()  # [N, T]
        recorder.record(completion[:, -1].to(device))
        logprobs = torch.stack(recorder.logprobs, dim=1).cpu()[:, : completion.shape[1]]  # [N, T]
        mask, truncated = self._completion_mask(completion, sampling)
        return Rollouts(
            group_ids=torch.arange(len(prompts)).repeat_interleave(n),
            completion_ids=completion.masked_fill(mask == 0, self.pad_id),
            completion_mask=mask,
            sampling_logprobs=logprobs * mask,
            truncated=truncated,
        )

    def _sample(self, input_ids, attention, n: int, sampling: SamplingParams, recorder, streamer=None):
        return self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=not sampling.greedy,
            num_return_sequences=n,
            max_new_tokens=sampling.max_new_tokens,
            **({} if sampling.greedy else _WARPERS_OFF),
            logits_processor=LogitsProcessorList([recorder]),
            stop_strings=sampling.stop_strings or None,
            tokenizer=self.tokenizer if sampling.stop_strings else None,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids) or None,
            return_dict_in_generate=True,
            streamer=streamer,
        )

    def _completion_mask(self, completion: torch.Tensor, sampling: SamplingParams):
        n, t = completion.shape
        is_eos = torch.zeros_like(completion, dtype=torch.bool)
        for e in self.eos_ids:
            is_eos |= completion == e
        has_eos = is_eos.any(-1)  # [N]
        first_eos = torch.where(has_eos, is_eos.float().argmax(-1), torch.full((n,), t))  # [N]
        lengths = torch.where(has_eos, first_eos + 1, torch.full((n,), t))  # [N]
        if sampling.stop_strings and self.pad_id not in self.eos_ids:
            # generate pads a row after its stop string; without stop strings a sampled pad token is
            # a real token, so only then do trailing pads mark the end.
            not_pad = (completion != self.pad_id).flip(-1).float()
            trailing_pad = torch.where(not_pad.any(-1), not_pad.argmax(-1), torch.full((n,), t))  # [N]
            lengths = torch.where(has_eos, lengths, t - trailing_pad)
        mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # [N, T]
        stopped = torch.zeros(n, dtype=torch.bool)
        if sampling.stop_strings:
            texts = self.tokenizer.batch_decode(
                completion.masked_fill(mask == 0, self.pad_id), skip_special_tokens=True
            )
            stopped = torch.tensor([any(s in txt for s in sampling.stop_strings) for txt in texts])
        truncated = ~has_eos & ~stopped & (lengths >= sampling.max_new_tokens)
        return mask, truncated


def build(model, tokenizer, *, compute_dtype=None, **_):
    return TransformersEngine(model, tokenizer, compute_dtype=compute_dtype)
