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
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 4 << 20  # bytes
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def release_large_frees() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD for this process; True when it was set.

    Left alone when the user set MALLOC_MMAP_THRESHOLD_ (glibc reads it at start-up) and off glibc
    (macOS, musl), where the allocators differ and this was not measured."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
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
