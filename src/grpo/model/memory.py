"""Give freed tensor memory back to the OS on glibc CPU hosts, so peak RSS tracks the tensors alive.

Why: glibc serves allocations below its mmap threshold from the heap, and that threshold grows to the
largest chunk freed so far (up to 32 MiB): once a training step has freed a few activation-sized chunks,
every activation ([tokens, ffn] is 24 MB for a 0.5B Qwen at 1,250 tokens) and weight gradient comes from
the heap. Freed heap chunks stay resident, and as activations (freed in backward) and gradients (allocated
then) interleave, the heap holds them as holes: measured on Qwen2.5-0.5B, 1.6-2.4 GiB of RSS at the end
of each backward held no tensor, and it made the peak (docs/performance.md, "Real sizes on this CPU").
A fixed threshold of 4 MiB puts every larger tensor in its own mapping, unmapped when freed; smaller
ones (the decode loop's, the optimizer's scalars) keep the heap's speed. The cost is a page fault per
4 KiB of a fresh large tensor, which the heap would have reused.

Fixing the mmap threshold also freezes glibc's trim threshold at its 128 KiB default (the two move together
only while both are dynamic), so every micro-batch's freed activations below 4 MiB were handed back to the
kernel from the top of the heap and faulted in again, zeroed, by the next one: 130-150 thousand page faults
and ~0.5 s of kernel time per update on the matrix's eos-off step (docs/performance.md). A trim threshold of
256 MiB keeps that much free heap top mapped; it is memory the process held a moment before, so it adds
nothing to RSS but what is freed and not yet reused (≤ 256 MiB), and makes no holes.
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 4 << 20  # bytes
TRIM_THRESHOLD = 256 << 20  # bytes
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc malloc.h)


def release_large_frees() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD and its trim threshold at TRIM_THRESHOLD for this
    process; True when the mmap threshold was set.

    Each is left alone where the user set it (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_: glibc reads
    them at start-up), and both off glibc (macOS, musl), where the allocators differ and this was not
    measured."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False


def available_bytes() -> int | None:
    """Memory the kernel says new allocations can get without swapping (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
