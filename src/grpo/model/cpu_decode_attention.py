"""The decode step's attention on a CPU as one fused kernel (numba), where PyTorch needs ~50 small ops.

Why: one decode step's attention per layer is, for each row and KV head, a few queries (the GQA group) over
the group's prompt keys and the row's own completion keys: tiny matrices. As PyTorch ops it is four batched
matmuls over 128 (row, head) items of 2 × 64 by 64 × t, a concatenation, a softmax, a log-sum-exp and the
transposes between a group's prompt and its rows: per-item and per-op overhead held the cache reads to
5-17 GB/s of the 45-60 GB/s this kind of host streams (docs/performance.md, "Where a CPU decode step goes").
Here each (row, KV head) item is one pass: the scores into a small buffer, the softmax, the weighted sum of
the values, written straight to the output, with its log-sum-exp (what replay's attention backward takes).

Numbers: the same scores, softmax and sums as `decode._decode_attention`, summed in another order: outputs
and log-sum-exps agree to float32 rounding (tests/unit/test_cpu_decode_attention.py). Threads: the items
are split over torch's intra-op thread count, the first share on the calling thread and the rest on worker
threads (the kernel releases the GIL); numba's own parallel layers are not used, so there is no second
OpenMP runtime beside torch's and nothing that breaks across a fork.
Used where it applies (`applies`): float32 on a CPU, eager decode (the compiled static-shape step keeps
PyTorch's ops, which inductor fuses itself), numba importable; otherwise PyTorch's ops run as before.
`GRPO_CPU_DECODE_KERNEL=0` turns it off (for A/B measurements).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_kernel = None
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool): rebuilt after a fork
_lock = threading.Lock()


def enabled() -> bool:
    return (
        os.environ.get("GRPO_CPU_DECODE_KERNEL", "1") != "0" and importlib.util.find_spec("numba") is not None
    )


def applies(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the fused kernel serves this call: float32 CPU tensors, and the completion cache a leading
    slice of a [rows, Hkv, T, D] buffer (how the eager decode passes it)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or torch.compiler.is_compiling():
        return False
    n, hkv, _, d = cache.shape
    s = cache.stride()
    if not (s[3] == 1 and s[2] == d and s[1] % d == 0 and s[0] == hkv * s[1]):
        return False
    # The whole [n, Hkv, T, D] region the kernel is handed lies in the storage (a leading slice does).
    end = cache.storage_offset() + n * s[0]
    return end * cache.element_size() <= cache.untyped_storage().nbytes() and _ready()


def _ready() -> bool:
    global _kernel
    if _kernel is None:
        with _lock:
            if _kernel is None:
                _kernel = _compile() if enabled() else False
    return bool(_kernel)


def _compile():
    from grpo.model import cpu_decode_kernel  # imports numba (~0.3 s), only where the kernel is used

    return cpu_decode_kernel.attend


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] != n:
            _pool = (os.getpid(), n, ThreadPoolExecutor(n, thread_name_prefix="grpo-decode-attention"))
        return _pool[2]


def decode_attention(q, kc, vc, kp, vp, bias, row_group, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]; kc, vc [n, Hkv, t, D] (views of the cache buffer); kp, vp [P, Hkv, Lp, D]; bias [P, 1, 1,
    Lp] (-inf at a group's prompt padding); row_group [n]. Returns the output [n, H·D] and each query's
    log-sum-exp of its scaled scores [n, H]."""
    n, h, d = q.shape
    hkv, t = kc.shape[1], kc.shape[2]
    rows_t = kc.stride(1) // d  # the buffer's T: kc, vc are its leading [:n, :, :t]
    kc, vc = (torch.as_strided(x, (n, hkv, rows_t, d), x.stride()) for x in (kc, vc))
    out, lse = q.new_empty(n, h, d), q.new_empty(n, h)
    args = [
        q.contiguous().view(n, hkv, h // hkv, d).numpy(),
        kc.numpy(),
        vc.numpy(),
        kp.contiguous().numpy(),
        vp.contiguous().numpy(),
        bias.reshape(bias.shape[0], -1).contiguous().numpy(),
        row_group.numpy(),
        out.numpy(),
        lse.numpy(),
        t,
        np.float32(scale),
    ]
    items, threads = n * hkv, min(torch.get_num_threads(), n * hkv)
    bounds = [items * k // threads for k in range(threads + 1)]
    if threads > 1:
        pool = _workers(threads - 1)
        jobs = [pool.submit(_kernel, *args, bounds[k], bounds[k + 1]) for k in range(1, threads)]
        _kernel(*args, bounds[0], bounds[1])
        for job in jobs:
            job.result()
    else:
        _kernel(*args, 0, items)
    return out.view(n, -1), lse
