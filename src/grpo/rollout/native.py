"""Rollout on the native decoder: shared prompt prefill, one KV cache, finished rows dropped.

Per `generate` call: each distinct prompt is prefilled once; its G completions start from the same
last-token distribution and decode against that one prompt KV (grouped attention). The completion
KV cache is allocated once ([N, Hkv, T, D] per layer). Rows that finish (eos or a stop string) are
dropped from the batch once enough of them have finished (`_COMPACT_FRACTION`), which bounds both the
wasted decode work and the cost of compacting the cache.

Sampling is exact (rollout/sampling.py): the recorded log-prob is that of the chosen token under the
distribution it was drawn from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from grpo.model import linear
from grpo.model.decoder import GroupLayout, NativeDecoder, unsupported_reason
from grpo.model.memory import available_bytes
from grpo.records import Rollouts, SamplingParams
from grpo.rollout.engine import copy_weights, generate_in_chunks
from grpo.rollout.sampling import pad_and_eos, sample_tokens

log = logging.getLogger("grpo")

_COMPACT_FRACTION = 8  # drop finished rows once ≥ 1/8 of the active batch has finished


class NativeEngine:
    """RolloutEngine on `NativeDecoder`; colocated, it reads the learner's parameters directly."""

    sampler_differs = False
    needs_weight_sync = False  # its decoder reads the model's parameters at every call

    def __init__(
        self, model, tokenizer, compile_decode: bool = False, compute_dtype: torch.dtype | None = None
    ):
        self.model = model
        # Mixed precision: each generate call casts the weights to compute_dtype once (decode_weights;
        # no copy is kept between calls), the prefill casts as it reads.
        self.decoder = NativeDecoder(model, compute_dtype)
        # torch.compile fuses the step's many small kernels. Compiled, the step attends over the whole
        # preallocated KV cache with the unwritten columns masked (decode_step's static shapes), and rows
        # are not dropped (the group layout stays fixed), so one graph serves every step of a generate
        # call; a batch of another shape (prompt width, rows, max_new_tokens) recompiles once, after which
        # dynamo makes the dimension that changed dynamic. On the matrix's eos-off rollout this took 30%
        # less CPU time per step than the eager step (docs/performance.md); the earlier compiled step
        # over growing cache views (a dynamic length) had gained nothing.
        self.compiled = compile_decode
        self.decode_step = (
            torch.compile(self.decoder.decode_step) if compile_decode else self.decoder.decode_step
        )
        self.tokenizer = tokenizer
        self._said_no_copy = False
        self.pad_id, eos = pad_and_eos(model, tokenizer)
        self.eos_ids = torch.tensor(eos or [-1], dtype=torch.long)  # -1: no eos, run to the limit

    @property
    def exact_logprobs(self) -> bool:
        """Sampling log-probs equal the learner's (to float32 rounding): π_old needs no forward pass. Not
        in bf16/fp16, where decode and training kernels round differently (~1e-2 in a log-prob)."""
        return self.decoder.dtype == torch.float32

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        chunk_prompts: int | None = None,
        on_step=None,
        kv=None,
    ) -> Rollouts:
        """kv: a TurnCache's call (model/turn_kv.py) that keeps the rows' K/V for their next turn."""
        if on_step is not None or kv is not None:  # one call: each step's tokens reported (continue_rows)
            with torch.no_grad():
                return self._generate(prompt_token_ids, n, sampling, on_step, kv)
        return generate_in_chunks(self._generate, prompt_token_ids, n, sampling, chunk_prompts, self.pad_id)

    def continue_rows(
        self, rows: list[list[int]], sampling: SamplingParams, on_step=None, kv=None
    ) -> Rollouts:
        """on_step(rows, tokens), when given, receives each decode step's sampled tokens (the gateway
        streams them as they are sampled). kv: as in `generate`, and the K/V it holds are reused."""
        if on_step is not None or kv is not None:
            with torch.no_grad():
                return self._generate(rows, 1, sampling, on_step, kv)
        return self.generate(rows, 1, sampling)  # each row its own prompt: prefill, then decode

    def close(self) -> None:
        pass  # holds nothing outside the policy's own parameters

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_weights(self.model, named_tensors)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        pass  # the decoder reads self.model's parameters, the policy's own unless they arrive by load_weights

    def _copy_fits(self) -> bool:
        """Whether a generate call may copy the weights into its faster CPU layouts (oneDNN's, a
        transposed [in, out] copy, fused q|k|v; 4.6 GiB for Llama-3.2-1B): only while that takes at most
        half of the memory the host has available now. Otherwise decode multiplies by the live weights
        (F.linear): slower per step, no copy. A GPU decodes on the live weights anyway."""
        if self.decoder.device.type != "cpu":
            return True
        need = sum(p.numel() * p.element_size() for p in self.decoder.hf.parameters())
        have = available_bytes()
        fits = have is None or need <= have // 2
        if not fits and not self._said_no_copy:
            self._said_no_copy = True
            log.info(
                "Rollout decodes on the live weights: a per-call copy (%.1f GiB) would take more than half "
                "of the %.1f GiB available.",
                need / 2**30,
                have / 2**30,
            )
        return fits

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, on_step=None, kv=None
    ) -> Rollouts:
        dec, device = self.decoder, self.decoder.device
        p, t_max = len(prompts), sampling.max_new_tokens
        rows = p * n
        if kv is None:
            prompt_cache, first_logits = dec.prefill(prompts, self.pad_id)  # first_logits [P, V]
        else:  # a later turn: the positions kv holds from the rows' earlier turns are not run again
            prompt_cache, first_logits = kv.prefill(dec, prompts, n, self.pad_id)
        # oneDNN's own weight tensors are opaque to torch.compile: a compiled step keeps plain ones.
        width = dec.hf.config.hidden_size
        copy = self._copy_fits()
        onednn = copy and device.type == "cpu" and not self.compiled and linear.decode_onednn(width, rows)
        weights = dec.decode_weights(fuse=device.type == "cpu", onednn=onednn, copy=copy)
        shape = (rows, dec.num_kv_heads, t_max, dec.head_dim)
        # Compiled, attention reads the unwritten columns too (masked): they must hold numbers, not NaN.
        alloc = torch.zeros if self.compiled else torch.empty
        cache_k = [alloc(shape, device=device, dtype=dec.dtype) for _ in dec.layers]
        cache_v = [alloc(shape, device=device, dtype=dec.dtype) for _ in dec.layers]
        ids = torch.full((rows, t_max), self.pad_id, dtype=torch.long)  # [N, T] on the CPU
        logprobs = torch.zeros(rows, t_max)
        lengths = torch.full((rows,), t_max, dtype=torch.long)
        ended = torch.zeros(rows, dtype=torch.bool)  # stopped by eos or a stop string (not truncated)
        eos_ids = self.eos_ids.to(device)
        stops = _StopStrings(self.tokenizer, sampling.stop_strings)

        active = torch.arange(rows)  # original row of each cache row
        alive = torch.ones(rows, dtype=torch.bool)  # per cache row: still generating
        layout = GroupLayout(torch.arange(rows, device=device) // n, prompt_cache.lengths, p)
        rope_limit = max(len(x) for x in prompts) + t_max
        logits = first_logits.repeat_interleave(n, dim=0)  # [N, V]: a group's first token shares one prefill
        for step in range(t_max):
            tokens, lp = sample_tokens(logits, sampling)  # [n_active]
            host_tokens, host_lp, hit_eos = _to_host(tokens, lp, eos_ids)
            live = active[alive]
            ids[live, step] = host_tokens[alive]
            logprobs[live, step] = host_lp[alive]
            if on_step is not None:
                on_step(live.tolist(), ids[live, step].tolist())
            done = hit_eos & alive
            if stops.active:
                hit = stops.hits(ids, live, step)  # [n_alive]
                done[alive.nonzero().squeeze(-1)[hit]] = True
            lengths[active[done]] = step + 1
            ended[active[done]] = True
            alive &= ~done
            if step == t_max - 1 or not alive.any():
                break
            finished = int((~alive).sum())
            if not self.compiled and finished * _COMPACT_FRACTION >= alive.numel():
                keep = alive.nonzero().squeeze(-1)
                if kv is not None:  # finished rows leave the cache: keep their K/V first
                    kv.save(active, (~alive).nonzero().squeeze(-1), cache_k, cache_v, ids, lengths)
                for cache in (*cache_k, *cache_v):
                    cache[: keep.numel(), :, :step] = cache[keep.to(device), :, :step]
                active, alive, tokens = active[keep], alive[keep], tokens[keep.to(device)]
                layout = GroupLayout(active.to(device) // n, prompt_cache.lengths, p)
                if onednn and not linear.decode_onednn(width, keep.numel()):
                    onednn = False
                    weights = dec.decode_weights(fuse=True, onednn=False, copy=copy)
            cos, sin = dec.rope(layout.prompt_len_per_row + step, limit=rope_limit)  # [n, D]
            if self.compiled:  # static shapes: whole caches, this step's column and mask as tensors
                static = {
                    "position": torch.tensor([step], device=device),
                    "cache_bias": unwritten_bias(step, t_max, device, dec.dtype),
                }
                caches = list(zip(cache_k, cache_v, strict=True))
            else:
                n_rows, static = tokens.shape[0], {}
                caches = [
                    (k[:n_rows, :, : step + 1], v[:n_rows, :, : step + 1])
                    for k, v in zip(cache_k, cache_v, strict=True)
                ]
            logits = self.decode_step(tokens, prompt_cache, layout, caches, weights, cos, sin, **static)

        if kv is not None:
            kv.save(active, torch.arange(active.numel()), cache_k, cache_v, ids, lengths)
        mask = (torch.arange(t_max)[None, :] < lengths[:, None]).float()  # [N, T]
        return Rollouts(
            group_ids=torch.arange(p).repeat_interleave(n),
            completion_ids=ids.masked_fill(mask == 0, self.pad_id),
            completion_mask=mask,
            sampling_logprobs=logprobs * mask,
            truncated=~ended,
        )


def _to_host(tokens: torch.Tensor, lp: torch.Tensor, eos_ids: torch.Tensor):
    """A decode step's tokens, their log-probs and which are eos, on the host in one copy: on a GPU each
    copy is a sync that stops the host from queueing the next step's kernels (one, not three). float64
    holds token ids (< 2^53) and float32 log-probs exactly."""
    both = torch.stack([tokens.double(), lp.double(), torch.isin(tokens, eos_ids).double()]).cpu()  # [3, n]
    return both[0].long(), both[1].float(), both[2].bool()


def unwritten_bias(step: int, length: int, device, dtype) -> torch.Tensor:
    """[1, 1, 1, length]: 0 on the cache columns written up to `step`, −inf after it."""
    bias = torch.zeros(1, 1, 1, length, device=device, dtype=dtype)
    return bias.masked_fill_(torch.arange(length, device=device) > step, float("-inf"))


class _StopStrings:
    """Detects a stop string completed by the newest token, decoding only a short tail of each row."""

    def __init__(self, tokenizer, stop_strings: list[str]):
        self.tokenizer, self.strings = tokenizer, list(stop_strings or [])
        self.active = bool(self.strings)
        # A token decodes to ≥ 1 character, so this many tokens always cover a fresh stop string.
        self.window = max((len(s) for s in self.strings), default=0) + 2

    def hits(self, ids: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        tails = ids[rows, max(0, step + 1 - self.window) : step + 1]
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return torch.tensor([any(s in text for s in self.strings) for text in texts], dtype=torch.bool)


def build(model, tokenizer, *, compute_dtype=None, compile_decode=False, **_):
    """The native engine on a supported Llama-family model, else transformers `generate` (said once)."""
    if (reason := unsupported_reason(model)) is not None:
        from grpo.rollout.transformers import TransformersEngine

        log.info("Native engine: unsupported model (%s); using transformers generate.", reason)
        return TransformersEngine(model, tokenizer, compute_dtype=compute_dtype)
    return NativeEngine(model, tokenizer, compile_decode=compile_decode, compute_dtype=compute_dtype)
