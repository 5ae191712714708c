"""Multi-turn KV reuse on the native decoder: each live row's keys and values kept between turns.

A later turn of an episode continues the row of ids it had: the earlier turns as sampled, then the injected
messages' ids (token in, token out). Under causal attention the K/V of position j depend on ids ≤ j only, so
every position the previous turn computed is still right; only the new ids need a forward pass. A
`TurnCache` keeps each row's K/V after a turn (the prompt's, then the sampled tokens' that the decode steps
wrote); the next turn `extend`s it by the new ids (queries over the cached keys plus their own, causally)
and decodes with the row's whole history as its prompt.

Rows are found by the key their caller gives (an episode, a session's row) and reused only as far as the
ids the cache holds agree, id for id, with the row asked for: a row that forked or whose history was
rewritten prefills again from where it differs. A cache holds K/V of the weights it was filled with: its
owner drops it when the rollout ends (the weights change between steps).

The reused K/V are not bitwise those of a full prefill (a sampled token's K/V come from the decode step's
kernels, and the softmax sums in another order), so log-probs agree to float rounding, not bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.model.arch import rms_norm
from grpo.model.decode import PromptCache


@dataclass
class _Row:
    ids: list[int]  # the ids whose K/V `kv` holds, prompt first
    kv: torch.Tensor  # [2, L, Hkv, len(ids), D]: keys then values, every layer


class TurnCache:
    """K/V of rows kept between turns, by the caller's key. `bind(keys)` is what an engine call takes
    (`NativeEngine.generate/continue_rows(..., kv=)`); rows the call samples replace their entries."""

    def __init__(self):
        self.rows: dict[Hashable, _Row] = {}
        self.reused_tokens = 0  # positions not prefilled again, since the cache was made
        self.prefilled_tokens = 0  # positions prefilled

    def bind(self, keys: Iterable[Hashable]) -> TurnCall:
        """The engine call for these rows: keys[i] is result row i's (one per completion row)."""
        return TurnCall(self, list(keys))

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Free every row but these (an episode that ended holds no K/V)."""
        keep = set(keys)
        for key in [k for k in self.rows if k not in keep]:
            del self.rows[key]

    def __len__(self) -> int:
        return len(self.rows)


class TurnCall:
    """One engine call's side of a TurnCache: its prefill (reusing what it can) and the K/V it keeps."""

    def __init__(self, cache: TurnCache, keys: list[Hashable]):
        self.cache, self.keys = cache, keys

    def prefill(self, dec, prompts: list[list[int]], n: int, pad_id: int) -> tuple[PromptCache, torch.Tensor]:
        """What `dec.prefill(prompts)` returns: the rows' prompt K/V (as a PromptCache, possibly with gaps
        the bias masks) and the last position's logits [P, V]; only positions the cache lacks run."""
        if len(self.keys) != len(prompts) * n:
            raise ValueError(f"{len(self.keys)} cache keys for {len(prompts)} prompts × {n} rows.")
        self.prompts, self.n = prompts, n
        past, reuse = [None] * len(prompts), [0] * len(prompts)
        if n == 1:  # a group's first turn (n > 1) shares one fresh prompt: nothing to look up
            for i, (key, row) in enumerate(zip(self.keys, prompts, strict=True)):
                held = self.cache.rows.pop(key, None)  # superseded by what this call keeps
                if held is not None:
                    past[i], reuse[i] = held.kv, common_prefix(held.ids, row, len(row) - 1)
        self.cache.reused_tokens += sum(reuse)
        self.cache.prefilled_tokens += sum(len(x) for x in prompts) - sum(reuse)
        if not any(reuse):
            cache, logits = dec.prefill(prompts, pad_id)
            self.segments = [[(0, len(x))] for x in prompts]  # each prompt's columns in the cache
        else:
            cache, logits = extend(
                dec, past, reuse, [x[c:] for x, c in zip(prompts, reuse, strict=True)], pad_id
            )
            width = max(reuse)
            self.segments = [
                [(0, c), (width, width + len(x) - c)] for x, c in zip(prompts, reuse, strict=True)
            ]
        self.prompt_cache, self._prompt_kv = cache, None
        return cache, logits

    def save(
        self,
        active: torch.Tensor,
        cache_rows: torch.Tensor,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        ids: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """Keep the K/V of the completion caches' (L × [n, Hkv, T, D]) rows `cache_rows`, whose result rows
        are active[cache_rows]; ids [N, T] and lengths [N] the sampled tokens by result row. A row's last
        token has no K/V yet (no step fed it), so the row keeps its prompt and all but its last token."""
        if cache_rows.numel() == 0:
            return
        rows = active[cache_rows]
        at = cache_rows.to(cache_k[0].device)
        done = torch.stack([torch.stack([k[at] for k in cache_k]), torch.stack([v[at] for v in cache_v])])
        if self._prompt_kv is None:  # [2, L, P, Hkv, W, D], once per call
            pc = self.prompt_cache
            self._prompt_kv = torch.stack([torch.stack(pc.keys), torch.stack(pc.values)])
        for j, r in enumerate(rows.tolist()):
            g, valid = r // self.n, int(lengths[r]) - 1
            parts = [self._prompt_kv[:, :, g, :, a:b] for a, b in self.segments[g] if b > a]
            kv = torch.cat([*parts, done[:, :, j, :, :valid]], dim=-2)  # [2, L, Hkv, len, D]
            self.cache.rows[self.keys[r]] = _Row(self.prompts[g] + ids[r, :valid].tolist(), kv)


def common_prefix(held: list[int], row: list[int], limit: int) -> int:
    """How many leading ids `held` and `row` share, at most `limit`."""
    m = min(len(held), len(row), limit)
    if held[:m] == row[:m]:  # the usual case: the row extends what is held
        return m
    differ = (torch.tensor(held[:m]) != torch.tensor(row[:m])).nonzero()
    return int(differ[0, 0])


def extend(
    dec, past: list[torch.Tensor | None], reuse: list[int], new: list[list[int]], pad_id: int
) -> tuple[PromptCache, torch.Tensor]:
    """Prefill each row's `new` ids (≥ 1) after the first reuse[i] positions of its cached K/V
    past[i] [2, L, Hkv, ≥ reuse[i], D]. Returns the rows' whole K/V as a PromptCache: columns [0, Lh) the
    reused ones (Lh = max reuse), then [Lh, Lh + M) the new ones, the bias masking each row's gaps; and the
    logits after each row's last id [R, V]."""
    device, dtype = dec.device, dec.dtype
    r, lh, m = len(new), max(reuse), max(len(x) for x in new)
    ids = torch.full((r, m), pad_id, dtype=torch.long)
    for i, x in enumerate(new):
        ids[i, : len(x)] = torch.tensor(x)
    held = torch.tensor(reuse, device=device)  # [R]
    count = torch.tensor([len(x) for x in new], device=device)  # [R]
    step = torch.arange(m, device=device)
    cos, sin = dec.rope((held[:, None] + step[None]).reshape(-1))  # [R·M, D]: each id at its own position
    h = dec.embed(ids.to(device)).view(r * m, -1)  # [R·M, d]
    old = torch.arange(lh, device=device)[None] < held[:, None]  # [R, Lh] reused columns
    causal = (step[None, :] <= step[:, None]).expand(r, m, m)  # [R, M, M]
    mask = torch.cat([old[:, None].expand(r, m, lh), causal], dim=-1)[:, None]  # [R, 1, M, Lh+M]
    keys, values = [], []
    shape = (r, dec.num_kv_heads, lh + m, dec.head_dim)
    for i, layer in enumerate(dec.layers):
        q, k, v = dec.qkv(layer, rms_norm(h, dec.w(layer.input_layernorm.weight), dec.eps), cos, sin)
        q, k, v = (t.view(r, m, -1, dec.head_dim).transpose(1, 2) for t in (q, k, v))  # [R, H, M, D]
        # The layer's K/V in place: the reused columns row by row (no second copy of every row's history).
        ks, vs = (
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
        )
        for j, (kv, c) in enumerate(zip(past, reuse, strict=True)):
            if c:
                ks[j, :, :c], vs[j, :, :c] = kv[0, i, :, :c], kv[1, i, :, :c]
        ks[:, :, lh:], vs[:, :, lh:] = k, v  # [R, Hkv, Lh+M, D]
        attn = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=True, scale=dec.scale)
        h = dec.block_tail(layer, h, attn.transpose(1, 2).reshape(r * m, -1))
        keys.append(ks)
        values.append(vs)
    last = h.view(r, m, -1)[torch.arange(r, device=device), count - 1]  # [R, d]
    real = torch.cat([old, step[None] < count[:, None]], dim=-1)  # [R, Lh+M]
    bias = torch.zeros(r, 1, 1, lh + m, device=device, dtype=dtype).masked_fill_(
        ~real[:, None, None], float("-inf")
    )
    return PromptCache(keys, values, bias, held + count), dec.logits(last)


def takes_kv(engine) -> bool:
    """Whether an engine's calls take `kv=` (the native engine; others prefill every turn)."""
    try:
        return all("kv" in inspect.signature(f).parameters for f in (engine.generate, engine.continue_rows))
    except (AttributeError, TypeError, ValueError):
        return False
