"""`distributed.profiler=torch`: a torch.profiler trace of two training steps (MaxText's `--profiler`).

Step 1 is left out on purpose: it pays for one-off work (allocator growth, the first compile, lazy
imports) that says nothing about the steady state. The trace is a Chrome-trace JSON in the run
directory's `profile/` folder, written by torch's TensorBoard handler, so it opens in TensorBoard
(`pip install torch-tb-profiler; tensorboard --logdir RUN_DIR/profile`) or in Perfetto (ui.perfetto.dev,
"Open trace file"). Every learner process writes its own (`rank0.*.pt.trace.json`, ...).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from grpo.files import own_dir

log = logging.getLogger("grpo")


class StepProfiler:
    def __init__(
        self, enabled: bool, run_dir: Path, total_steps: int, rank: int = 0, first: int = 2, last: int = 3
    ):
        self.enabled = enabled
        self.dir = Path(run_dir) / "profile"
        self.first, self.last = min(first, total_steps), min(last, total_steps)
        self.rank = rank
        self.prof: torch.profiler.profile | None = None
        self.trace: Path | None = None

    def before_step(self, step: int) -> None:
        if not self.enabled or step != self.first or self.prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self.prof.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run stops before the last profiled step)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        own_dir(self.dir)
        before = set(self.dir.glob("*.pt.trace.json"))
        torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}")(prof)
        written = sorted(set(self.dir.glob("*.pt.trace.json")) - before)
        self.trace = written[-1] if written else None
        log.info(
            "Profiler trace of steps %d-%d: %s (open in TensorBoard: tensorboard --logdir %s, or in "
            "Perfetto: ui.perfetto.dev)",
            self.first,
            self.last,
            self.trace,
            self.dir,
        )
