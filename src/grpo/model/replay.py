"""Replay: the update reuses the rollout's forward instead of recomputing it (μ = 1, float32, one turn).

With one optimisation pass over a rollout batch (μ = 1), the update's forward evaluates the policy at the
weights that sampled the batch, on the tokens it sampled: the rollout's decode has computed every product
of the update's forward already. During a recorded rollout the decode keeps, for every prompt token (the
prefill, once per group) and every completion input token, each layer's

    qkv   the q|k|v projection's output (before q/k norms and RoPE; q unscaled) [H·D + 2·Hkv·D]
    attn  the attention's output                                               [H·D]
    lse   each head's log-sum-exp of the query's scaled scores                 [H]
    gu    gate_proj(x) | up_proj(x), side by side (decode runs them as one GEMM)  [2·ffn]
    out   mid + down_proj(silu(gate) · up), the block's output (mid = h + o_proj(attn)) [d]

(`Recording`). The update's forward then runs the same packed micro-batch graph with each linear layer an
autograd function whose forward returns the recorded output and whose backward is the linear's (grad x =
g W, grad W = gᵀ x with x recomputed); the attention likewise returns the recorded output, and its backward
(the fused kernel's) takes the recorded log-sum-exps, which is all a fused attention keeps from its forward.
o_proj runs forward (a [S, H·D] × [H·D, d] GEMM costs a fifth of the attention forward it replaces, and
keeping `mid` too would cost as much memory as the attention's output); norms, RoPE, SiLU·up and the LM
head run as in the normal forward, and make the graph. The loss is the same function at the same point up
to the float rounding of differently shaped GEMMs (decode's few rows against training's packed thousands),
so the replayed log-probs equal the sampling log-probs to ~1e-6, and gradients equal the normal forward's
to float32 rounding (tests/unit/test_replay.py). What it removes: every linear layer's forward product but
o_proj's, about a third of the update's arithmetic, and the attention's forward.

A `ReplayTape` is shared by the native engine (which records into it while armed) and the learner (which
takes the recording of the step's one generate call and checks, token for token, that the micro-batch is
what was recorded; anything else runs the normal forward).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from grpo import kernels
from grpo.model import shared_prompt
from grpo.model.arch import rms_norm, rotate
from grpo.model.linear import linear
from grpo.model.memory import available_bytes
from grpo.model.packed_attention import replayed_attention

log = logging.getLogger("grpo")

# A recording may take at most this share of the memory available when it starts (MemAvailable).
BUDGET_FRACTION = 0.25


def recording_bytes(hf_config, prompt_slots: int, completion_slots: int) -> int:
    """Bytes of float32 recorded activations for this many prompt and completion token slots."""
    c = hf_config
    d, heads = c.hidden_size, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or d // heads
    kv = c.num_key_value_heads or heads
    per_layer = (2 * heads + 2 * kv) * head_dim + heads + d + 2 * c.intermediate_size
    return 4 * (prompt_slots + completion_slots) * c.num_hidden_layers * per_layer


class Recording:
    """One generate call's recorded products: per layer and kind a [P·Lp + T·N, width] buffer, prompt slots
    (group g, position j → g·Lp + j) then one block per decode step of the rows it decoded, in the step's
    batch order, each block right after the previous one: each step writes one contiguous block (a
    scattered index_copy_ of rows cost 50 µs a call), and a rollout writes a prefix of the buffer as long as
    the tokens it decoded. `slot_of` [N, T] says where each original row's input j went (−1: not decoded),
    and `ids` the input token at each slot (−1 where nothing was recorded)."""

    def __init__(
        self,
        dec,
        prompts: list[list[int]],
        n: int,
        t_max: int,
        prompt_width: int,
        reuse: list | None = None,
        pool: dict | None = None,
    ):
        self.num_prompts, self.n, self.t, self.lp = len(prompts), n, t_max, prompt_width
        self.rows = self.num_prompts * n
        self.base = self.num_prompts * prompt_width
        slots = self.base + self.rows * t_max
        d, hd = dec.hf.config.hidden_size, dec.head_dim
        widths = {
            "qkv": (dec.num_heads + 2 * dec.num_kv_heads) * hd,
            "attn": dec.num_heads * hd,
            "lse": dec.num_heads,
            "gu": 2 * dec.hf.config.intermediate_size,
            "out": d,
        }
        kw = {"device": dec.device, "dtype": dec.dtype}
        # reuse: the previous recording's storage (ReplayTape keeps it), else fresh buffers, which the
        # allocator maps anew (model/memory.py): only the pages written become resident.
        self.storage = [
            {k: _storage(None if reuse is None else reuse[i][k], slots * w, kw) for k, w in widths.items()}
            for i in range(len(dec.layers))
        ]
        self.buffers = [
            {k: flat[: slots * widths[k]].view(slots, widths[k]) for k, flat in layer.items()}
            for layer in self.storage
        ]
        self.ids = torch.full((slots,), -1, dtype=torch.long)
        for g, x in enumerate(prompts):
            self.ids[g * prompt_width : g * prompt_width + len(x)] = torch.tensor(x, dtype=torch.long)
        self.slot_of = torch.full((self.rows, t_max), -1, dtype=torch.long)  # [N, T]
        self.unscale = torch.ones(widths["qkv"], **kw)  # the decode's q arrives scaled (folded weights)
        self.unscale[: dec.num_heads * hd] = 1.0 / dec.scale
        self.start, self.count = 0, 0  # this step's block of slots
        self._whole: list | None = None  # graph_target's buffers, made on first use
        self.cursor = self.base  # where the next step's block goes: the blocks are packed, decoded rows only
        # [first step, last step + 1, original row of each cache row, the first step's block]
        self._segments: list[list] = []
        self.replayed = self.missed = 0  # micro-batches the update replayed / ran normally
        # (layer, kind) → the buffer a micro-batch's gathered rows go to, reused by the next micro-batch
        # (its autograd graph is gone by then) and, kept by the ReplayTape, the next steps: a fresh
        # [tokens, width] tensor each time cost a page fault per 4 KiB (eos-off update: gathers 0.52 s CPU
        # fresh, 0.19 s into reused buffers). Only pages written become resident: one micro-batch's worth.
        self.pool = {} if pool is None else pool
        self._scratch: tuple[torch.Tensor, ...] | None = None  # the replayed MLP's backward temporaries

    # -- writing (the rollout) ----------------------------------------------------------------------
    def scratch(self, rows: int, width: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Two [rows, width] and one [rows, 2·width] buffers for `_ReplayedMLP`'s backward, one set for the
        step's update (the backward runs one layer at a time; nothing it returns is a view of them), grown to
        its largest micro-batch."""
        have = self._scratch
        if (
            have is None
            or have[0].shape[0] < rows
            or have[0].shape[1] != width
            or have[0].dtype != like.dtype
        ):
            kw = {"dtype": like.dtype, "device": like.device}
            have = self._scratch = (
                torch.empty(rows, width, **kw),
                torch.empty(rows, width, **kw),
                torch.empty(rows, 2 * width, **kw),
            )
        return tuple(t[:rows] for t in have)

    def at_prefill(self) -> Recording:
        self.start, self.count = 0, self.base
        return self

    def at_step(self, rows: torch.Tensor, step: int) -> Recording:
        """Decode step `step` of the cache rows whose original rows are `rows` [n] (host; the same
        tensor from step to step until the batch is compacted)."""
        self.start, self.count = self.cursor, rows.shape[0]
        self.cursor += self.count
        if self._segments and self._segments[-1][2] is rows and self._segments[-1][1] == step:
            self._segments[-1][1] = step + 1
        else:
            self._segments.append([step, step + 1, rows, self.start])
        return self

    def block(self, layer: int, kind: str) -> torch.Tensor:
        """This step's rows of `kind` in `layer` [n, width], for the decode to write its product into."""
        return self.buffers[layer][kind][self.start : self.start + self.count]

    def graph_target(self) -> tuple:
        """What the compiled full-batch decode step writes this step's products into (rollout/native.py
        `_GraphRecord`): per layer each kind's buffer over the whole kept storage (its shape stays the same
        from call to call while the storage is reused, so the graph is not recompiled for another prompt
        width), this step's slots [n], and the factor that unscales q."""
        if self._whole is None:
            self._whole = [
                {k: _whole_rows(self.storage[i][k], b.shape[1]) for k, b in buffers.items()}
                for i, buffers in enumerate(self.buffers)
            ]
        slots = torch.arange(self.start, self.start + self.count, device=self.unscale.device)
        return self._whole, slots, self.unscale

    def kept(self, layer: int, kind: str, value: torch.Tensor) -> torch.Tensor:  # noqa: ARG002
        """`value` was computed into `block(layer, kind)`: nothing more to keep."""
        return value

    def put(self, layer: int, kind: str, value: torch.Tensor, scaled_q: bool = False) -> None:
        """value [n, width]: this step's (or the prefill's [P·Lp, width]) output of `kind` in `layer`."""
        out = self.buffers[layer][kind][self.start : self.start + value.shape[0]]
        if scaled_q:
            torch.mul(value, self.unscale, out=out)
        else:
            out.copy_(value)

    def finish(self, completion_ids: torch.Tensor) -> None:
        """completion_ids [N, T]: the token sampled at step j of row r is the input decoded at step j."""
        for first, end, rows, start in self._segments:
            steps = torch.arange(first, end)  # [s]
            n = rows.shape[0]
            slots = start + (steps[None, :] - first) * n + torch.arange(n)[:, None]  # [n, s]
            self.slot_of[rows[:, None], steps[None, :]] = slots
            self.ids[slots.flatten()] = completion_ids[rows[:, None], steps[None, :]].flatten()
        self._segments = []

    # -- reading (the update) -----------------------------------------------------------------------
    def index(self, packed, first_row: int, group_ids: torch.Tensor) -> torch.Tensor | None:
        """The slot of every packed token of a micro-batch (rows first_row.. of the rollout batch; its
        rows' group ids `group_ids`), or None when its tokens are not the ones recorded there."""
        row_prompt, inputs = packed.row_prompt, packed.row_inputs
        first: dict[int, int] = {}
        for i, k in enumerate(row_prompt):
            first.setdefault(k, i)
        parts = []
        for k, (_, length) in enumerate(_prompt_starts(packed)):
            g = int(group_ids[first[k]])
            if g >= self.num_prompts or length > self.lp:
                return None
            parts.append(torch.arange(length) + g * self.lp)
        for i in sorted(range(len(row_prompt)), key=lambda i: row_prompt[i]):  # the pack's row order
            r = first_row + i
            if r >= self.rows or inputs[i] > self.t:
                return None
            parts.append(self.slot_of[r, : inputs[i]])
        index = torch.cat(parts)
        if index.numel() != packed.token_ids.numel() or (index < 0).any():
            return None
        if not torch.equal(self.ids[index], packed.token_ids.cpu()):
            return None
        return index.to(self.buffers[0]["qkv"].device)

    def gather(self, layer: int, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each kind's recorded rows `index` [S] of `layer`: [S, width] views of the pool's buffers, valid
        until the next micro-batch's gather (the update runs forward and backward of one at a time)."""
        out, m = {}, index.shape[0]
        for k, b in self.buffers[layer].items():
            buf = self.pool.get((layer, k))
            if buf is None or buf.shape[0] < m or buf.device != b.device or buf.shape[1] != b.shape[1]:
                rows = int(m * HEADROOM) if b.device.type == "cpu" else m
                buf = self.pool[(layer, k)] = torch.empty(rows, b.shape[1], dtype=b.dtype, device=b.device)
            out[k] = torch.index_select(b, 0, index, out=buf[:m])
        return out


# A fresh buffer is this much larger than the recording that asked for it, so the next steps' recordings
# (their prompts' width varies with the data) still fit and reuse it. Only the pages a rollout writes
# become resident, so the headroom costs address space, not memory.
HEADROOM = 1.5


def _whole_rows(flat: torch.Tensor, width: int) -> torch.Tensor:
    """The flat storage as [rows, width] from its start (where a recording's buffer begins too)."""
    return flat[: flat.numel() // width * width].view(-1, width)


def _storage(have: torch.Tensor | None, size: int, kw: dict) -> torch.Tensor:
    if (
        have is not None
        and have.numel() >= size
        and have.device == kw["device"]
        and have.dtype == kw["dtype"]
    ):
        return have
    return torch.empty(int(size * HEADROOM) if kw["device"].type == "cpu" else size, **kw)


def _prompt_starts(packed) -> list[tuple[int, int]]:
    """(start, length) of each prompt in the pack, in pack order."""
    out = []
    for r in packed.layout.prompt:
        out += [(r.start + c * r.length, r.length) for c in range(r.count)]
    return out


class ReplayTape:
    """Where the native engine records a rollout for the learner: armed before each step's rollout, taken
    by the update. A step with more than one generate call (chunked rollouts, DAPO rounds) or a recording
    over the memory budget gives nothing to take."""

    def __init__(self, budget_bytes: int | None = None, cap_bytes: int | None = None):
        # budget_bytes: the budget itself (tests); else a quarter of the available memory, and at most
        # cap_bytes (the learner's activation budget: the recording is held through the update's peak)
        self.budget_bytes, self.cap_bytes = budget_bytes, cap_bytes
        self.armed, self.calls, self.recording = False, 0, None
        self._said_budget = False
        # The last recording's storage, reused by the next: fresh pages cost a page fault per 4 KiB written,
        # ~0.1-0.2 s per rollout (eos-off: ×1.27 of the rollout's CPU time fresh, ×1.04 reused). A rollout
        # writes a prefix of it (the tokens decoded), so what stays resident is the longest rollout's.
        self._kept: list | None = None
        self._resident = 0  # bytes of it the rollouts wrote at most (allocated with HEADROOM beyond that)
        self._pool: dict = {}  # the update's gather buffers (Recording.pool), kept from step to step

    def arm(self) -> None:
        self.armed, self.calls, self.recording = True, 0, None

    def start(self, dec, prompts: list[list[int]], n: int, t_max: int) -> Recording | None:
        """A recording for a generate call, or None (not armed, a second call, over budget)."""
        if not self.armed:
            return None
        self.calls += 1
        self.recording = None
        if self.calls > 1:
            return None
        width = max(len(x) for x in prompts)
        need = recording_bytes(dec.hf.config, len(prompts) * width, len(prompts) * n * t_max)
        budget = self.budget_bytes
        if budget is None:
            have = available_bytes()
            held = 0 if self._kept is None else self._resident
            budget = None if have is None else int((have + held) * BUDGET_FRACTION)
            if self.cap_bytes is not None:
                budget = self.cap_bytes if budget is None else min(budget, self.cap_bytes)
        if budget is not None and need > budget:
            if not self._said_budget:
                self._said_budget = True
                log.info(
                    "Replay: recording this rollout's forward would take %.2f GiB, over its budget of %.2f "
                    "GiB (%d%% of available memory, at most train.activation_memory_gb); the update "
                    "recomputes its forward.",
                    need / 2**30,
                    budget / 2**30,
                    int(BUDGET_FRACTION * 100),
                )
            return None
        kept, self._kept = self._kept, None
        self.recording = Recording(dec, prompts, n, t_max, width, kept, self._pool)
        reused = kept is not None and all(
            new[k] is old[k] for new, old in zip(self.recording.storage, kept, strict=True) for k in new
        )
        self._resident = max(self._resident, need) if reused else need
        return self.recording

    def take(self) -> Recording | None:
        """The step's recording, once; disarms (evaluation's generate calls record nothing)."""
        rec = self.recording if self.calls == 1 else None
        self.armed, self.calls, self.recording = False, 0, None
        self._kept = None if rec is None else rec.storage
        return rec


@dataclass
class Replay:
    """What the update hands the training forward for one micro-batch: the step's recording and where
    the micro-batch's rows start in the rollout batch."""

    recording: Recording
    first_row: int

    def index(self, packed, group_ids: torch.Tensor) -> torch.Tensor | None:
        index = self.recording.index(packed, self.first_row, group_ids)
        if index is None:
            self.recording.missed += 1
            if self.recording.missed == 1:
                log.warning("Replay: a micro-batch is not the recorded rollout; its forward is recomputed.")
        else:
            self.recording.replayed += 1
        return index


# -- the replayed forward --------------------------------------------------------------------------
class _ReplayedLinear(torch.autograd.Function):
    """out = [x W₁ᵀ + b₁ | x W₂ᵀ + b₂ | …] (q|k|v): forward returns the recorded `out`; backward as the
    linear layers'."""

    @staticmethod
    def forward(ctx, recorded, x, *params):
        ctx.save_for_backward(x, *params[0::2])
        ctx.has_bias = [b is not None for b in params[1::2]]
        return recorded.view_as(recorded)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        # Several weights (q|k|v) as one: one GEMM for x's gradient and one for the weights', where one
        # each per weight and the sums between them ran before (fewer, larger products; −15% of the q|k|v
        # backward's CPU time at the matrix's shapes).
        w = weights[0] if len(weights) == 1 else torch.cat(weights)
        if not ctx.needs_input_grad[1]:
            grad_x = None
        else:
            grad_x = linear(grad, w.t()) if grad.is_contiguous() else grad @ w
        need_w = any(ctx.needs_input_grad[2 + 2 * i] for i in range(len(weights)))
        grad_w = (grad.t() @ x).split([w.shape[0] for w in weights]) if need_w else [None] * len(weights)
        grads, start = [], 0
        for i, w in enumerate(weights):
            grads.append(grad_w[i] if ctx.needs_input_grad[2 + 2 * i] else None)
            need_b = ctx.has_bias[i] and ctx.needs_input_grad[3 + 2 * i]
            grads.append(grad[:, start : start + w.shape[0]].sum(0) if need_b else None)
            start += w.shape[0]
        return None, grad_x, *grads


class _ReplayedMLP(torch.autograd.Function):
    """out = residual + down(silu(x W_gᵀ) · x W_uᵀ): forward returns the recorded `out` (gate and up are the
    recorded products too); backward as the three linear layers', with gate and up as one product of
    [W_g; W_u]: one GEMM for x's gradient and one for both weights', where two each and a sum ran before.
    Its [S, ffn] temporaries live in the step's workspace (`Recording.scratch`), reused from layer to layer:
    fresh, each would be a mapping of its own (model/memory.py), paged in again for every layer."""

    @staticmethod
    def forward(ctx, recorded, gu, x, w_gate, w_up, w_down, residual, scratch):  # noqa: ARG004
        ctx.save_for_backward(gu, x, w_gate, w_up, w_down)
        ctx.scratch = scratch
        return recorded.view_as(recorded)

    @staticmethod
    def backward(ctx, grad):
        gu_in, x, w_gate, w_up, w_down = ctx.saved_tensors
        gate, up = gu_in.chunk(2, dim=-1)
        s, f = gate.shape
        a, b, gu = ctx.scratch(s, f, gate)
        ops = kernels.cpu_ops_for(gate, grad)  # grpo's SwiGLU ops: one pass each way for 2 and 3 of PyTorch's
        if ops is not None:
            ops.swiglu_forward(gate, up, a, b)  # silu, its product with up
            silu, product = a, b
        else:
            silu = torch.ops.aten.silu.out(gate, out=a)
            product = torch.mul(silu, up, out=b)
        grad_w_down = grad.t() @ product if ctx.needs_input_grad[5] else None  # Gᵀ P
        grad_p = torch.mm(grad, w_down, out=b)  # G W_down
        if ops is not None:
            ops.swiglu_backward(grad_p, gate, up, silu, gu[:, :f], gu[:, f:])
        else:
            torch.mul(grad_p, silu, out=gu[:, f:])  # up's gradient
            torch.ops.aten.silu_backward.grad_input(torch.mul(grad_p, up, out=a), gate, grad_input=gu[:, :f])
        need_w = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        grad_w_gate, grad_w_up = (gu.t() @ x).split(f) if need_w else (None, None)
        grad_x = linear(gu, torch.cat([w_gate, w_up]).t()) if ctx.needs_input_grad[2] else None
        return None, None, grad_x, grad_w_gate, grad_w_up, grad_w_down, grad, None


def replayed_hidden(dec, packed, recording: Recording, index: torch.Tensor) -> torch.Tensor:
    """As `shared_prompt.shared_prompt_hidden`, every product replayed from the rollout: [M, d]."""
    h = dec.embed(packed.token_ids)  # [S, d]
    cos, sin = dec.rope(packed.positions)  # [S, D]
    cos, sin = cos[:, None], sin[:, None]
    s, hq, hkv, hd = h.shape[0], dec.num_heads, dec.num_kv_heads, dec.head_dim
    packed_route = shared_prompt.attention_route(h.device) == "packed"
    for i, layer in enumerate(dec.layers):
        rec = recording.gather(i, index)
        a, m, w = layer.self_attn, layer.mlp, dec.w
        x = rms_norm(h, w(layer.input_layernorm.weight), dec.eps)
        qkv = _ReplayedLinear.apply(
            rec["qkv"], x, *dec.proj(a.q_proj), *dec.proj(a.k_proj), *dec.proj(a.v_proj)
        )  # [S, (H + 2Hkv)·D]
        q, k, v = qkv.view(s, hq + 2 * hkv, hd).split([hq, hkv, hkv], dim=1)
        if dec.qk_norm:
            q = rms_norm(q, w(a.q_norm.weight), dec.eps)
            k = rms_norm(k, w(a.k_norm.weight), dec.eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if packed_route:
            attn = replayed_attention(q, k, v, packed.layout, dec.scale, rec["attn"], rec["lse"])  # [S, H·D]
        else:
            attn = shared_prompt._grid_attention(dec, q, k, v, packed)
        mid = h + linear(attn, *dec.proj(a.o_proj))
        x = rms_norm(mid, w(layer.post_attention_layernorm.weight), dec.eps)
        weights = (dec.proj(p)[0] for p in (m.gate_proj, m.up_proj, m.down_proj))
        h = _ReplayedMLP.apply(rec["out"], rec["gu"], x, *weights, mid, recording.scratch)
    return dec.final_norm(h.index_select(0, packed.predictor_index))  # [M, d]
