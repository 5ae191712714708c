"""The training pass of the native decoder: shared-prompt packing and the packed forward.

The prompt of a group runs once, its completions attend to it, and only real tokens go through the
linear layers (pad tokens cost nothing there). The functions take the `NativeDecoder` whose live
weights and block pieces they use (model/decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grpo.model.arch import rms_norm
from grpo.model.compiled import compiled_block
from grpo.model.packed_attention import PackedLayout, Run, packed_attention, runs

QUERY_CHUNK = 64  # completion queries per attention call in training (see _completion_attention)


def attention_route(device: torch.device) -> str:
    """How the training attention runs on `device`.

    "packed" (CPU): model/packed_attention.py, the CPU flash kernel on views of the packed tokens (no
    padded grids, no mask, no G× prompt K/V copy, no query chunks); the same numbers as the grid routes
    within float32 rounding (tests/unit/test_packed_attention.py). The grid routes below scatter the
    packed tokens into padded [P, Lp] / [N, Tc] grids and run SDPA with a boolean mask over them:
    "gqa" (other devices): SDPA with the mask and `enable_gqa`; the CPU's fused kernel takes both.
    "expand_kv" (CUDA): K/V repeated to the query heads, then SDPA with the mask. On CUDA no fused
    kernel takes a mask together with a GQA broadcast (flash takes no mask, memory-efficient attention no
    GQA), so the first route falls back to the math kernel, which keeps float32 scores [rows, H, 64,
    Lp + Tc] per chunk and layer for backward (O(T²), uncounted by the micro-batch budget: long
    completions run out of memory). Expanded K/V go to memory-efficient attention, whose memory is
    linear in T; the copy costs H/Hkv × the K/V of a layer. (FlexAttention with a block mask over the
    packed tokens is the fused route past this one.)"""
    if device.type == "cpu":
        return "packed"
    return "expand_kv" if device.type == "cuda" else "gqa"


@dataclass
class SharedPromptPack:
    """A micro-batch laid out for shared-prompt training: every real token once, no padding.

    Token order: the P distinct prompts' tokens, then each completion's input tokens (all but its last),
    completions in group order (`layout` says where the attention pieces are).
    Slot tensors place packed tokens into the padded [P, Lp] / [N, Tc] grids attention runs on. The
    [N, Tc] grid holds the completions longest first, so the rows still real at a query position are a
    prefix of it (attention skips the rest, see NativeDecoder._completion_attention).
    """

    token_ids: torch.Tensor  # [S] long
    positions: torch.Tensor  # [S] long: position within prompt + completion
    num_prompt_tokens: int
    num_groups: int  # P
    prompt_width: int  # Lp
    num_rows: int  # N
    input_width: int  # Tc = T − 1 (≥ 1)
    completion_width: int  # T
    prompt_slot: torch.Tensor  # [Sp] row in the [P·Lp] grid
    completion_slot: torch.Tensor  # [Sc] row in the [N·Tc] grid
    row_group: torch.Tensor  # [N] which prompt each grid row's completion answers
    completion_mask: torch.Tensor  # [N, 1, Tc, Lp+Tc] bool: keys each grid row's queries may see
    input_lengths: list[int]  # [N] real input tokens of each grid row, non-increasing
    predictor_index: torch.Tensor  # [M] packed token whose output predicts each real completion token
    target_slot: torch.Tensor  # [M] where that prediction goes in the [N·T] grid
    targets: torch.Tensor  # [M] the completion token predicted there
    layout: PackedLayout  # the attention pieces in packed order (model/packed_attention.py)
    row_prompt: list[int] = field(default_factory=list)  # [N] each row's prompt, in the caller's row order
    row_inputs: list[int] = field(default_factory=list)  # [N] each row's completion inputs, the same order


def pack_shared_prompts(
    prompt_ids: list[list[int]],
    row_group: list[int],
    completions: list[list[int]],
    completion_width: int,
    device: torch.device,
) -> SharedPromptPack:
    """Build a SharedPromptPack; completions[i] answers prompt_ids[row_group[i]] (all non-empty)."""
    p, n = len(prompt_ids), len(completions)
    lp = max(len(x) for x in prompt_ids)
    tc = max(max((len(c) - 1 for c in completions), default=1), 1)
    ids, pos, pslot, cslot = [], [], [], []
    for g, x in enumerate(prompt_ids):
        ids += x
        pos += range(len(x))
        pslot += range(g * lp, g * lp + len(x))
    prompt_tokens = len(ids)
    # The token predicting completion j of row i: the prompt's last token (j = 0), else completion input j-1.
    predictor, target, target_ids = [], [], []
    plen = [len(x) for x in prompt_ids]
    pstart = [sum(plen[:g]) for g in range(p)]
    lengths = [max(len(c) - 1, 0) for c in completions]
    order = sorted(range(n), key=lambda i: -lengths[i])  # grid rows: longest completion first
    grid_row = [0] * n
    for r, i in enumerate(order):
        grid_row[i] = r
    # Completions in group order (stable), so a group's completion tokens are one segment that attends
    # to its prompt in one piece (model/packed_attention.py); rows of a group are adjacent already in a
    # TrainBatch, so this is usually the identity.
    row_starts, group_span = [0] * n, [[0, 0] for _ in range(p)]
    for i in sorted(range(n), key=lambda i: row_group[i]):
        c, g = completions[i], row_group[i]
        row_starts[i] = len(ids)
        if group_span[g][1] == 0:
            group_span[g][0] = len(ids)
        group_span[g][1] += lengths[i]
        if not c:
            continue
        inputs = c[:-1]
        first = len(ids)
        ids += inputs
        pos += range(plen[g], plen[g] + len(inputs))
        cslot += range(grid_row[i] * tc, grid_row[i] * tc + len(inputs))
        predictor += [pstart[g] + plen[g] - 1, *range(first, first + len(inputs))]
        target += range(i * completion_width, i * completion_width + len(c))
        target_ids += c
    groups = torch.tensor([row_group[i] for i in order], dtype=torch.long)  # [N] grid order
    plens = torch.tensor(plen)[groups]  # [N]
    clens = torch.tensor([lengths[i] for i in order])  # [N]
    prompt_ok = torch.arange(lp)[None, :] < plens[:, None]  # [N, Lp]
    own = torch.arange(tc)  # [Tc]
    causal = (own[None, :] <= own[:, None])[None] & (own[None, None, :] < clens[:, None, None])  # [N, Tc, Tc]
    mask = torch.cat([prompt_ok[:, None, :].expand(n, tc, lp), causal], dim=-1)  # [N, Tc, Lp+Tc]

    by_start = sorted(range(n), key=lambda i: row_starts[i])
    layout = PackedLayout(
        prompt=runs(pstart, plen),
        cross=_cross_runs(group_span, plen, pstart),
        own=runs([row_starts[i] for i in by_start], [lengths[i] for i in by_start]),
        num_prompt_tokens=prompt_tokens,
    )

    def t(v):
        return torch.tensor(v, dtype=torch.long, device=device)

    return SharedPromptPack(
        token_ids=t(ids),
        positions=t(pos),
        num_prompt_tokens=prompt_tokens,
        num_groups=p,
        prompt_width=lp,
        num_rows=n,
        input_width=tc,
        completion_width=completion_width,
        prompt_slot=t(pslot),
        completion_slot=t(cslot),
        row_group=groups.to(device),
        completion_mask=mask[:, None].to(device),
        input_lengths=clens.tolist(),
        predictor_index=t(predictor),
        target_slot=t(target),
        targets=t(target_ids),
        layout=layout,
        row_prompt=list(row_group),
        row_inputs=lengths,
    )


def _cross_runs(group_span: list[list[int]], plen: list[int], pstart: list[int]) -> list[tuple[Run, Run]]:
    """(completion tokens, prompt) runs: adjacent groups whose completion token counts and prompt lengths
    agree attend in one batched call."""
    out: list[tuple[Run, Run]] = []
    for g, (start, size) in enumerate(group_span):
        if size == 0:
            continue
        if out:
            q, k = out[-1]
            if (q.length, k.length, q.end, k.end) == (size, plen[g], start, pstart[g]):
                out[-1] = (Run(q.start, q.count + 1, size), Run(k.start, k.count + 1, plen[g]))
                continue
        out.append((Run(start, 1, size), Run(pstart[g], 1, plen[g])))
    return out


def _scatter_rows(x: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    """Packed [S, ...] → padded [size, ...] with x[i] at row slots[i], zeros elsewhere (differentiable)."""
    return x.new_zeros(size, *x.shape[1:]).index_copy(0, slots, x)


# -- training -----------------------------------------------------------------------------------
def shared_prompt_hidden(dec, packed: SharedPromptPack) -> torch.Tensor:
    """Final-normed hidden states that predict each real completion token: [M, d], in `target_slot`
    order."""
    h = dec.embed(packed.token_ids)  # [S, d] S = real prompt tokens + real completion inputs
    cos, sin = dec.rope(packed.positions)  # [S, D]
    for layer in dec.layers:
        if dec.gradient_checkpointing and torch.is_grad_enabled():
            h = torch.utils.checkpoint.checkpoint(
                _shared_block, dec, layer, h, cos, sin, packed, use_reentrant=False
            )
        else:
            h = _shared_block(dec, layer, h, cos, sin, packed)
    return dec.final_norm(h.index_select(0, packed.predictor_index))  # [M, d]


def _shared_block(dec, layer, h, cos, sin, packed: SharedPromptPack) -> torch.Tensor:
    if dec.compile_blocks:
        q, k, v = _compiled_pre_attention(dec, layer, h, cos, sin)
    else:
        q, k, v = dec.qkv(
            layer, rms_norm(h, dec.w(layer.input_layernorm.weight), dec.eps), cos, sin
        )  # [S, H|Hkv, D]
    if attention_route(h.device) == "packed":
        attn = packed_attention(q, k, v, packed.layout, dec.scale)  # [S, H·D]
    else:
        attn = _grid_attention(dec, q, k, v, packed)
    if dec.compile_blocks:
        return _compiled_post_attention(dec, layer, h, attn)
    return dec.block_tail(layer, h, attn)


def _grid_attention(dec, q, k, v, packed: SharedPromptPack) -> torch.Tensor:
    """The packed q [S, H, D], k, v [S, Hkv, D] scattered into padded [P, Lp] / [N, Tc] grids, SDPA on
    them, gathered back: [S, H·D]. The route where the packed one cannot run (not a CPU)."""
    p, lp, n, tc = packed.num_groups, packed.prompt_width, packed.num_rows, packed.input_width

    def pad_p(x):  # [S, ·] → [P, heads, Lp, D]
        return _scatter_rows(x, packed.prompt_slot, p * lp).view(p, lp, -1, dec.head_dim).transpose(1, 2)

    def pad_c(x):  # [S, ·] → [N, heads, Tc, D]
        return _scatter_rows(x, packed.completion_slot, n * tc).view(n, tc, -1, dec.head_dim).transpose(1, 2)

    qp, kp, vp = (
        pad_p(q[: packed.num_prompt_tokens]),
        pad_p(k[: packed.num_prompt_tokens]),
        pad_p(v[: packed.num_prompt_tokens]),
    )
    attn_p = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True, scale=dec.scale)
    qc, kc, vc = (pad_c(x[packed.num_prompt_tokens :]) for x in (q, k, v))  # [N, H|Hkv, Tc, D]
    # A completion's keys: its group's prompt (shared; gradients sum back through the index) then itdec.
    keys = torch.cat([kp.index_select(0, packed.row_group), kc], dim=2)  # [N, Hkv, Lp+Tc, D]
    vals = torch.cat([vp.index_select(0, packed.row_group), vc], dim=2)
    attn_c = _completion_attention(
        dec, qc, keys, vals, packed.completion_mask, lp, packed.input_lengths
    )  # [N, H, Tc, D]
    return torch.cat(
        [
            attn_p.transpose(1, 2).reshape(p * lp, -1).index_select(0, packed.prompt_slot),
            attn_c.transpose(1, 2).reshape(n * tc, -1).index_select(0, packed.completion_slot),
        ]
    )


def _compiled_pre_attention(dec, layer, h, cos, sin):
    a, w = layer.self_attn, dec.w
    norms = (w(a.q_norm.weight), w(a.k_norm.weight)) if dec.qk_norm else (None, None)
    return compiled_block().pre(
        h,
        w(layer.input_layernorm.weight),
        *dec.proj(a.q_proj),
        *dec.proj(a.k_proj),
        *dec.proj(a.v_proj),
        *norms,
        cos,
        sin,
        dec.eps,
        dec.num_heads,
        dec.num_kv_heads,
    )


def _compiled_post_attention(dec, layer, h, attn):
    m = layer.mlp
    return compiled_block().post(
        h,
        attn,
        *dec.proj(layer.self_attn.o_proj),
        dec.w(layer.post_attention_layernorm.weight),
        *(dec.proj(p)[0] for p in (m.gate_proj, m.up_proj, m.down_proj)),
        dec.eps,
    )


def _completion_attention(dec, q, keys, vals, mask, lp: int, lengths: list[int]) -> torch.Tensor:
    """Completion queries q [N, H, Tc, D] over their [prompt | completion] keys [N, Hkv, Lp+Tc, D];
    lengths: real queries per row, non-increasing (rows longest first).

    An attention kernel given an explicit mask computes every score, the masked-out ones too. Queries
    run in chunks that see only the keys up to their chunk's last position, which skips most of the
    causal upper triangle (37% fewer scores at 256 completion tokens; the CPU forward takes 27% less
    time, the backward the same). Each chunk also runs only the rows with a real query in it, a prefix
    since rows are longest first: with eos-ended completions of uneven length the padding after a
    short row costs nothing (16 rows of geometric length, mean 32, in a 128 grid: ~2× fewer scores).
    Padding rows of a chunk get zeros, which nothing reads.
    """
    tc = q.shape[2]
    gqa = attention_route(q.device) == "gqa"
    if not gqa:  # the kernels that take a mask take no GQA broadcast: each query head gets its K/V copy
        rep = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
    outs = []
    for start in range(0, tc, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, tc)
        live = sum(length > start for length in lengths)
        out = F.scaled_dot_product_attention(
            q[:live, :, start:end],
            keys[:live, :, : lp + end],
            vals[:live, :, : lp + end],
            attn_mask=mask[:live, :, start:end, : lp + end],
            enable_gqa=gqa,
            scale=dec.scale,
        )
        if live < q.shape[0]:
            out = torch.cat([out, out.new_zeros(q.shape[0] - live, *out.shape[1:])])
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
