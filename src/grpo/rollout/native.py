"""Rollout on the native decoder: shared prompt prefill, one KV cache, finished rows dropped.

Per `generate` call: each distinct prompt is prefilled once; its G completions start from the same
last-token distribution and decode against that one prompt KV (grouped attention). The completion
KV cache is allocated once ([N, Hkv, T, D] per layer). Rows that finish (eos or a stop string) are
dropped from the batch once enough of them have finished (`_COMPACT_FRACTION`), which bounds both the
wasted decode work and the cost of compacting the cache. Hybrid decode (`compile_decode`, on by default
once it has paid, see `_COMPILE_SAVES`): until the first rows are dropped, one compiled static-shape graph
runs each step, sampler included; the eager step runs the compacted batch after.

Sampling is exact (rollout/sampling.py): the recorded log-prob is that of the chosen token under the
distribution it was drawn from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from grpo import kernels
from grpo.model import linear
from grpo.model.compiled import cpp_compiler
from grpo.model.decoder import GroupLayout, NativeDecoder, unsupported_reason
from grpo.model.memory import available_bytes
from grpo.records import Rollouts, SamplingParams
from grpo.rollout.engine import copy_weights, generate_in_chunks
from grpo.rollout.sampling import pad_and_eos, sample_tokens

log = logging.getLogger("grpo")

_COMPACT_FRACTION = 8  # drop finished rows once ≥ 1/8 of the active batch has finished
# compile_decode=None (the default): compile the full-batch step once the eager full-batch steps have cost
# as much as the compilation would have saved by then, i.e. once (eager full-batch seconds so far) ×
# _COMPILE_SAVES ≥ the compile's estimated cost. Like renting skis until the rent reaches the price: never
# more than twice the cost of the best choice made knowing the run's future, and a run whose rows end
# early (few full-batch steps), or a short one, never compiles. Measured on the 4.9M matrix model
# (docs/performance.md): the compiled graph took 10-16% off an all-rows rollout on an AVX2 EPYC, 20% on an
# AVX-512 Xeon; its compile took 30-50 s cold at 1-2 threads (more under load), roughly in proportion to
# the layers it unrolls, 20-25 s from inductor's warm on-disk cache.
_COMPILE_SAVES = 0.15
_COMPILE_S_PER_LAYER = 10.0


class NativeEngine:
    """RolloutEngine on `NativeDecoder`; colocated, it reads the learner's parameters directly."""

    sampler_differs = False
    needs_weight_sync = False  # its decoder reads the model's parameters at every call

    def __init__(
        self,
        model,
        tokenizer,
        compile_decode: bool | None = False,
        compute_dtype: torch.dtype | None = None,
    ):
        self.model = model
        # Mixed precision: each generate call casts the weights to compute_dtype once (decode_weights;
        # no copy is kept between calls), the prefill casts as it reads.
        self.decoder = NativeDecoder(model, compute_dtype)
        # Hybrid decode (compile_decode): while every row of the batch is still in it, one torch.compile'd
        # graph runs the whole step at static shapes: the decode step over the whole preallocated KV cache
        # (unwritten columns masked), RoPE and mask lookups, the sampler and the eos test. Once enough rows
        # have finished to be dropped (`_COMPACT_FRACTION`), the batch is compacted and the eager step takes
        # over: there the rows left, not the per-op overhead, decide the cost, and the eager step attends
        # over the written columns only. So rows that run to the limit get the fused graph all the way, and
        # eos-ended rows lose nothing to finished rows kept in a static batch (docs/performance.md).
        # None (auto): eager until the eager full-batch steps have paid for a compile (_COMPILE_SAVES), on
        # a CPU in float32 with a C++ compiler for inductor (where it was measured), unless grpo's own CPU
        # decode ops (grpo/kernels) run the eager step: with them the eager step is the faster one (the
        # eos-off rollout 1.11 s eager against 1.25 s compiled, docs/performance.md), so auto never compiles.
        self.auto = compile_decode is None and self.decoder.dtype == torch.float32
        self.auto = self.auto and self.decoder.device.type == "cpu" and cpp_compiler() is not None
        self.auto = self.auto and kernels.cpu_ops() is None
        self._rent_s = 0.0  # auto: eager full-batch decode seconds so far × _COMPILE_SAVES
        self.compiled = bool(compile_decode)
        self._full_step = _compile_full_step(self.decoder.device) if compile_decode else None
        # The static-shape decode step alone (no sampling), compiled on first call: tests/gpu compares it.
        self.decode_step = (
            torch.compile(self.decoder.decode_step) if self.compiled else self.decoder.decode_step
        )
        self.tokenizer = tokenizer
        # Replay (model/replay.py): the learner's tape, armed before each step's rollout; the single-turn
        # generate call records its products into it (the eager step and the compiled one alike).
        self.tape = None
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

    def _full_batch(self, tokens, inputs: tuple, recording, active: torch.Tensor, step: int):
        """One step of the compiled full-batch graph, which writes its products into the recording's
        block for this step when there is one. Returns the sampled tokens [N] and `_flags` [3, N]."""
        target = None if recording is None else recording.at_step(active, step).graph_target()
        return self._full_step(self.decoder, tokens, *inputs, target)

    def _start_compiling(self) -> None:
        self.auto, self.compiled = False, True
        self._full_step = _compile_full_step(self.decoder.device)
        log.info(
            "Decode: eager full-batch steps have taken %.0f s so far; compiling the full-batch step now "
            "(generation.compile_decode: true compiles from the start, false never).",
            self._rent_s / _COMPILE_SAVES,
        )

    def _recording(self, prompts: list[list[int]], n: int, t_max: int, single_turn: bool):
        """A model/replay.py Recording for this call when the tape is armed (a single-turn call only: the
        update may replay it), else None."""
        if self.tape is None or not single_turn:
            return None
        return self.tape.start(self.decoder, prompts, n, t_max)

    def _prefill(self, prompts: list[list[int]], n: int, kv, record=None):
        if kv is None:
            return self.decoder.prefill(prompts, self.pad_id, None if record is None else record.at_prefill())
        # a later turn: the positions kv holds from the rows' earlier turns are not run again
        return kv.prefill(self.decoder, prompts, n, self.pad_id)

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, on_step=None, kv=None
    ) -> Rollouts:
        dec, device = self.decoder, self.decoder.device
        p, t_max = len(prompts), sampling.max_new_tokens
        rows = p * n
        recording = self._recording(prompts, n, t_max, single_turn=kv is None and on_step is None)
        prompt_cache, first_logits = self._prefill(prompts, n, kv, recording)  # first_logits [P, V]
        # oneDNN's own weight tensors are opaque to torch.compile: a compiled step keeps plain ones.
        width = dec.hf.config.hidden_size
        copy = self._copy_fits()
        onednn = copy and device.type == "cpu" and not self.compiled and linear.decode_onednn(width, rows)
        weights = dec.decode_weights(fuse=device.type == "cpu", onednn=onednn, copy=copy)
        shape = (rows, dec.num_kv_heads, t_max, dec.head_dim)
        # The full-batch graph reads the unwritten columns too (masked): they must hold numbers, not NaN.
        # every row still in the batch: the compiled static-shape step serves it
        full = self.compiled
        alloc = torch.zeros if full else torch.empty
        cache_k = [alloc(shape, device=device, dtype=dec.dtype) for _ in dec.layers]
        cache_v = [alloc(shape, device=device, dtype=dec.dtype) for _ in dec.layers]
        out = _Completions(rows, t_max, self.pad_id, _StopStrings(self.tokenizer, sampling.stop_strings))
        eos_ids = self.eos_ids.to(device)

        active = torch.arange(rows)  # original row of each cache row
        alive = torch.ones(rows, dtype=torch.bool)  # per cache row: still generating
        layout = GroupLayout(torch.arange(rows, device=device) // n, prompt_cache.lengths, p)
        rope_limit = max(len(x) for x in prompts) + t_max
        if full:
            rope = dec.rope(torch.arange(rope_limit, device=device), limit=rope_limit)  # [limit, D] each
            caches = list(zip(cache_k, cache_v, strict=True))
        # A group's first token shares one prefill: its logits [P, V] → [N, V].
        tokens, lp = sample_tokens(first_logits.repeat_interleave(n, dim=0), sampling)  # [N]
        host_tokens, host_lp, hit_eos = _to_host(tokens, lp, eos_ids)
        for step in range(t_max):
            alive &= ~out.add(step, active, alive, host_tokens, host_lp, hit_eos, on_step)
            if step == t_max - 1 or not alive.any():
                break
            finished = int((~alive).sum())
            if finished * _COMPACT_FRACTION >= alive.numel():
                keep = alive.nonzero().squeeze(-1)
                if kv is not None:  # finished rows leave the cache: keep their K/V first
                    kv.save(active, (~alive).nonzero().squeeze(-1), cache_k, cache_v, out.ids, out.lengths)
                for cache in (*cache_k, *cache_v):
                    cache[: keep.numel(), :, :step] = cache[keep.to(device), :, :step]
                active, alive, tokens = active[keep], alive[keep], tokens[keep.to(device)]
                layout = GroupLayout(active.to(device) // n, prompt_cache.lengths, p)
                # The batch changed shape: the eager step from here on, on oneDNN where it wins.
                full, wanted = (
                    False,
                    copy and device.type == "cpu" and linear.decode_onednn(width, keep.numel()),
                )
                if wanted != onednn:
                    onednn, weights = wanted, dec.decode_weights(fuse=True, onednn=wanted, copy=copy)
            if full:
                position = torch.tensor([step], device=device)
                full_inputs = (prompt_cache, layout, caches, weights, *rope, position, sampling, eos_ids)
                tokens, flags = self._full_batch(tokens, full_inputs, recording, active, step)
                host_tokens, host_lp, hit_eos = _split_flags(flags.cpu())
                continue
            start = time.perf_counter()
            cos, sin = dec.rope(layout.prompt_len_per_row + step, limit=rope_limit)  # [n, D]
            n_rows = tokens.shape[0]
            step_caches = [
                (k[:n_rows, :, : step + 1], v[:n_rows, :, : step + 1])
                for k, v in zip(cache_k, cache_v, strict=True)
            ]
            rec = _recording_at(recording, active, step)
            logits = dec.decode_step(tokens, prompt_cache, layout, step_caches, weights, cos, sin, record=rec)
            tokens, lp = sample_tokens(logits, sampling)  # [n_active]
            host_tokens, host_lp, hit_eos = _to_host(tokens, lp, eos_ids)
            if self.auto and n_rows == rows:  # a step the compiled graph would serve
                self._rent_s += (time.perf_counter() - start) * _COMPILE_SAVES
        if self.auto and self._rent_s >= _COMPILE_S_PER_LAYER * len(dec.layers):
            self._start_compiling()

        if kv is not None:
            kv.save(active, torch.arange(active.numel()), cache_k, cache_v, out.ids, out.lengths)
        return out.rollouts(p, n, recording)


# The full-batch graph's inductor options. fallback_random: torch.rand inside the graph is aten's, drawing
# from the global generator exactly as the eager sampler does (inductor's own RNG would draw other numbers),
# so a seeded run samples the same whichever step serves it and resumes with the same RNG state.
_INDUCTOR = {"fallback_random": True}
# On a CPU also cpp_wrapper: the graph's kernels are called from generated C++, not Python; the step is ~60
# kernels and GEMMs, so the Python between them showed: 8-10% less CPU time per all-rows rollout than the
# Python wrapper (docs/performance.md). Not tried on CUDA.
_INDUCTOR_CPU = {**_INDUCTOR, "cpp_wrapper": True}


def _compile_full_step(device: torch.device):
    return torch.compile(_full_batch_step, options=_INDUCTOR_CPU if device.type == "cpu" else _INDUCTOR)


def _full_batch_step(
    dec,
    tokens,
    prompt_cache,
    layout,
    caches,
    weights,
    rope_cos,
    rope_sin,
    position,
    sampling,
    eos_ids,
    record=None,
):
    """The step the compiled graph runs while every row is in the batch: decode `tokens` [N] at cache
    column `position` [1], sample the next tokens. Returns them [N] and `_flags` [3, N]. `record`: replay's
    recording's `graph_target()` (a second graph: None or not is a constant to the compiler), into which
    each layer's products are written at this step's slots, as the KV cache is written."""
    products = None if record is None else _GraphRecord(*record)
    length = caches[0][0].shape[2]
    at = layout.prompt_len_per_row + position  # [N] each row's position
    cols = torch.arange(length, device=tokens.device)
    bias = torch.zeros(1, 1, 1, length, device=tokens.device, dtype=dec.dtype)
    bias = bias.masked_fill(cols > position, float("-inf"))  # the columns not written yet
    logits = dec.decode_step(
        tokens, prompt_cache, layout, caches, weights, rope_cos[at], rope_sin[at], position, bias, products
    )
    tokens, lp = sample_tokens(logits, sampling)
    return tokens, _flags(tokens, lp, eos_ids)


class _GraphRecord:
    """What decode_step's `record` is inside the compiled graph: each product is written into the
    recording's buffers (graph inputs of fixed shape: the kept storage) at this step's `slots` [N] by an
    in-place index_copy_, which the compiler fuses like the KV cache's write; no block views, which would
    move every step."""

    def __init__(self, buffers, slots: torch.Tensor, unscale: torch.Tensor):
        self.buffers, self.slots, self.unscale = buffers, slots, unscale

    def block(self, layer: int, kind: str) -> None:  # noqa: ARG002 (the Recording's signature)
        return None

    def kept(self, layer: int, kind: str, value: torch.Tensor) -> torch.Tensor:
        self.buffers[layer][kind].index_copy_(0, self.slots, value)
        return value

    def put(self, layer: int, kind: str, value: torch.Tensor, scaled_q: bool = False) -> None:
        self.kept(layer, kind, value * self.unscale if scaled_q else value)


def _recording_at(recording, rows: torch.Tensor, step: int):
    return None if recording is None else recording.at_step(rows, step)


def _flags(tokens: torch.Tensor, lp: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """[3, n] float64: tokens, their log-probs, which are eos. float64 holds token ids (< 2^53) and
    float32 log-probs exactly, so the three travel to the host as one tensor."""
    return torch.stack([tokens.double(), lp.double(), torch.isin(tokens, eos_ids).double()])


def _split_flags(both: torch.Tensor):
    return both[0].long(), both[1].float(), both[2].bool()


def _to_host(tokens: torch.Tensor, lp: torch.Tensor, eos_ids: torch.Tensor):
    """A decode step's tokens, their log-probs and which are eos, on the host in one copy: on a GPU each
    copy is a sync that stops the host from queueing the next step's kernels (one, not three)."""
    return _split_flags(_flags(tokens, lp, eos_ids).cpu())


def unwritten_bias(step: int, length: int, device, dtype) -> torch.Tensor:
    """[1, 1, 1, length]: 0 on the cache columns written up to `step`, −inf after it."""
    bias = torch.zeros(1, 1, 1, length, device=device, dtype=dtype)
    return bias.masked_fill_(torch.arange(length, device=device) > step, float("-inf"))


class _Completions:
    """A generate call's completions on the host [N, T], filled in one decode step at a time."""

    def __init__(self, rows: int, t_max: int, pad_id: int, stops: _StopStrings):
        self.pad_id, self.t_max, self.stops = pad_id, t_max, stops
        self.ids = torch.full((rows, t_max), pad_id, dtype=torch.long)
        self.logprobs = torch.zeros(rows, t_max)
        self.lengths = torch.full((rows,), t_max, dtype=torch.long)
        self.ended = torch.zeros(rows, dtype=torch.bool)  # stopped by eos or a stop string (not truncated)

    def add(self, step: int, active, alive, tokens, lp, hit_eos, on_step=None) -> torch.Tensor:
        """Record step `step`'s tokens of the live cache rows (`active`: each cache row's original row);
        returns which cache rows finished with it (eos or a stop string)."""
        live = active[alive]
        self.ids[live, step] = tokens[alive]
        self.logprobs[live, step] = lp[alive]
        if on_step is not None:
            on_step(live.tolist(), self.ids[live, step].tolist())
        done = hit_eos & alive
        if self.stops.active:
            hit = self.stops.hits(self.ids, live, step)  # [n_alive]
            done[alive.nonzero().squeeze(-1)[hit]] = True
        self.lengths[active[done]] = step + 1
        self.ended[active[done]] = True
        return done

    def rollouts(self, p: int, n: int, recording=None) -> Rollouts:
        if recording is not None:  # the recorded inputs' ids: the sampled tokens, as the update checks
            recording.finish(self.ids)
        mask = (torch.arange(self.t_max)[None, :] < self.lengths[:, None]).float()  # [N, T]
        return Rollouts(
            group_ids=torch.arange(p).repeat_interleave(n),
            completion_ids=self.ids.masked_fill(mask == 0, self.pad_id),
            completion_mask=mask,
            sampling_logprobs=self.logprobs * mask,
            truncated=~self.ended,
        )


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


def build(model, tokenizer, *, compute_dtype=None, compile_decode=None, **_):
    """The native engine on a supported Llama-family model, else transformers `generate` (said once)."""
    if (reason := unsupported_reason(model)) is not None:
        from grpo.rollout.transformers import TransformersEngine

        log.info("Native engine: unsupported model (%s); using transformers generate.", reason)
        return TransformersEngine(model, tokenizer, compute_dtype=compute_dtype)
    return NativeEngine(model, tokenizer, compile_decode=compile_decode, compute_dtype=compute_dtype)
