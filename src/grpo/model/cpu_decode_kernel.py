"""The numba kernel behind model/cpu_decode_attention.py (imported only where it is used: numba's import
and, on a machine's first use, its compile cost seconds; the compiled code is cached on disk after that)."""

import math

import numba
import numpy as np

# No nnan/ninf among the fast-math flags: padded prompt keys carry a -inf bias.
_FLAGS = {"reassoc", "contract", "nsz", "arcp"}
_jit = numba.njit(nogil=True, fastmath=_FLAGS, cache=True)


@_jit
def _scores(qr, keys, count, scale, bias, s, at):
    """s[at + j] = scale · qr·keys[j] + bias[j] for j < count (bias None: no bias); returns their max."""
    m = np.float32(-np.inf)
    for j in range(count):
        k = keys[j]
        acc = np.float32(0.0)
        for e in range(qr.shape[0]):
            acc += qr[e] * k[e]
        acc = acc * scale
        if bias is not None:
            acc += bias[j]
        s[at + j] = acc
        m = max(m, acc)
    return m


@_jit
def _accumulate(s, at, count, inv, vals, o):
    """o += Σ_j s[at + j] · inv · vals[j] for j < count."""
    for j in range(count):
        p, v = s[at + j] * inv, vals[j]
        for e in range(o.shape[0]):
            o[e] += p * v[e]


@_jit
def attend(q, kc, vc, kp, vp, bias, group, out, lse, t, scale, start, stop):
    """Items start..stop of the n·Hkv (row, KV head) items: q [n, Hkv, rep, D]; kc, vc [n, Hkv, T, D] (the
    first t columns written); kp, vp [P, Hkv, Lp, D]; bias [P, Lp]; group [n]; out [n, H, D]; lse [n, H]."""
    hkv, rep = q.shape[1], q.shape[2]
    lp = kp.shape[2]
    s = np.empty(lp + t, dtype=np.float32)
    for item in range(start, stop):
        i, h = item // hkv, item % hkv
        g = group[i]
        for r in range(rep):
            m = max(
                _scores(q[i, h, r], kp[g, h], lp, scale, bias[g], s, 0),
                _scores(q[i, h, r], kc[i, h], t, scale, None, s, lp),
            )
            total = np.float32(0.0)
            for j in range(lp + t):
                s[j] = np.float32(math.exp(s[j] - m))
                total += s[j]
            lse[i, h * rep + r] = m + np.float32(math.log(total))
            o = out[i, h * rep + r]
            o[:] = 0.0
            inv = np.float32(1.0) / total
            _accumulate(s, 0, lp, inv, vp[g, h], o)
            _accumulate(s, lp, t, inv, vc[i, h], o)
