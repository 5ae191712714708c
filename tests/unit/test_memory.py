"""CPU memory: the optimizer step allocates no parameter-sized temporaries, and freed tensors leave RSS.

Peaks are read from the kernel (VmHWM, reset through /proc/self/clear_refs), since torch's CPU
allocations are invisible to tracemalloc."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.learner import Learner
from tests.conftest import tiny_llama

SRC = Path(__file__).resolve().parents[2] / "src"
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
pytestmark = pytest.mark.skipif(not CLEAR_REFS.exists(), reason="needs Linux /proc peak-RSS reset")


def _kb(field: str) -> int:
    line = next(x for x in STATUS.read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_growth(fn) -> int:
    """Bytes by which RSS peaked above its level before fn()."""
    before = _kb("VmRSS")
    CLEAR_REFS.write_text("5")  # VmHWM := VmRSS
    fn()
    return _kb("VmHWM") - before


def test_optimizer_step_allocates_no_parameter_sized_temporaries():
    # A 67 MB tied embedding: torch's default (foreach) AdamW would hold √v̂ for it, +67 MB at its peak.
    model = tiny_llama(vocab_size=1 << 19)
    cfg = GRPOConfig(batch_size=2, num_generations=4, learning_rate=1e-3, max_grad_norm=1.0).validate()
    learner = Learner(model, None, cfg, total_optimizer_steps=4)
    params = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() * p.element_size() for p in params)
    for _ in range(2):  # the first step creates AdamW's state; the second is any later step
        for p in params:
            p.grad = torch.randn_like(p)
        growth = peak_growth(learner._optimizer_step)
    assert growth < 0.1 * size, f"the step's peak rose {growth / 2**20:.0f} MiB over {size / 2**20:.0f} MiB"


_FREED_TENSORS_LEAVE_RSS = """
from pathlib import Path
import torch
from grpo.model.memory import release_large_frees

def rss():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024

assert release_large_frees()
# Without a fixed threshold glibc raises its mmap threshold to this freed 30 MB chunk, and the 8 MB
# tensors below come from the heap, where the freed ones stay resident as holes between live ones.
torch.ones(30 << 18)
tensors = [torch.ones(2 << 20) for _ in range(20)]  # 20 x 8 MB, pages touched
before = rss()
del tensors[::2]
print(before - rss())
"""


def test_freed_activation_sized_tensors_leave_rss():
    # A fresh process, as at the start of `grpo train`: in this long-lived pytest process the heap already
    # holds large free chunks from earlier tests, and malloc serves 8 MB from them whatever the threshold.
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _FREED_TENSORS_LEAVE_RSS], env=env, capture_output=True, text=True, check=True
    )
    released = int(out.stdout.split()[-1])
    assert released > 0.9 * 10 * (8 << 20), f"freeing 80 MiB of tensors released {released / 2**20:.1f} MiB"


_FREED_HEAP_IS_REUSED = """
import resource
import torch
from grpo.model.memory import release_large_frees

assert release_large_frees()
faults = []
for _ in range(4):  # a micro-batch's activations below the mmap threshold: 64 x 1 MiB, touched, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(256 << 10) for _ in range(64)]
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[0], max(faults[1:]))
"""


def test_the_next_micro_batch_reuses_the_heap_the_last_one_freed():
    # Fixing the mmap threshold also fixed glibc's trim threshold at 128 KiB, so each round's freed heap went
    # back to the kernel and came back as fresh zeroed pages: 16k page faults a round here, 130-150k and
    # ~0.5 s of kernel time per update on the matrix's eos-off step.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _FREED_HEAP_IS_REUSED], env=env, capture_output=True, text=True, check=True
    )
    first, later = (int(x) for x in out.stdout.split())
    pages = 64 * (1 << 20) // 4096
    assert first > 0.9 * pages, f"the first round faulted {first} pages in, expected ~{pages}"
    # all of them without the trim threshold; ~0-11% with it (the interpreter's and torch's own allocations
    # between rounds move the heap top a little, more in the full suite's busy worker)
    assert later < 0.5 * pages, f"a later round faulted {later} of its {pages} pages in again"
