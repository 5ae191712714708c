"""Running model-written code: in a child process with time and memory limits, never in the trainer.

`run_python(code)` starts `python -I` (isolated: no user site-packages, no PYTHON* variables) in an empty
temporary directory with a minimal environment, under POSIX resource limits: CPU seconds, address space
(memory), file size and process count, plus a wall-clock timeout after which the whole process group is
killed. It is a guard against runaway and accidental damage (infinite loops, memory bombs, fork bombs,
huge files), not a security boundary against hostile code: run untrusted workloads in a container.

`code_tests` is a reward built on it: the last ```python block of the completion (or the whole
completion), followed by the row's `tests` column, scores 1.0 when the script exits 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


@dataclass
class SandboxResult:
    returncode: int | None  # None when killed by the wall-clock timeout
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# Runs in the child: set the limits, then run the code read from stdin as __main__. (Limits are set here,
# not in a preexec_fn, because reward calls run on threads, where preexec_fn can deadlock.)
_BOOTSTRAP = """
import os, resource, signal, sys, threading, time
def _orphaned(parent=os.getppid()):  # the trainer died (even by SIGKILL): end this group, leave nothing
    while os.getppid() == parent:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=_orphaned, daemon=True).start()  # before RLIMIT_NPROC, which counts threads
cpu, memory, files, processes = (int(x) for x in sys.argv[1:5])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, files),
                     (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
source = sys.stdin.read()
sys.stdin = open("/dev/null")
exec(compile(source, "<completion>", "exec"), {"__name__": "__main__"})
"""


def run_python(
    code: str,
    *,
    timeout: float = 10.0,
    memory_mb: int = 512,
    file_mb: int = 16,
    processes: int = 64,
    output_chars: int = 10_000,
    on_start: Callable[[subprocess.Popen], object] | None = None,
) -> SandboxResult:
    """Run `code` in a separate, resource-limited Python process and return its exit status and output."""
    if os.name != "posix":
        raise OSError("run_python needs POSIX resource limits (Linux or macOS)")
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as workdir:
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        limits = [str(max(1, int(timeout) + 1)), str(memory_mb << 20), str(file_mb << 20), str(processes)]
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOTSTRAP, *limits],
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )  # its own process group, so a timeout kills its children too
        if on_start is not None:  # an owner that may have to kill it early (agents/code_exec.py at close)
            on_start(process)
        try:
            stdout, stderr = process.communicate(code, timeout=timeout)
            return SandboxResult(process.returncode, stdout[:output_chars], stderr[:output_chars], False)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the whole group has already exited
                os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            return SandboxResult(None, stdout[:output_chars], stderr[:output_chars], True)


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ```), or the whole completion without one."""
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def code_tests(
    prompts: list[str], completions: list[str], tests: list[str | None] | None = None, **_: list
) -> list[float | None]:
    """1.0 when the completion's code followed by the row's `tests` (asserts) runs and exits 0 within 10 s
    and 512 MB, else 0.0; None for rows without tests. Each sample runs in its own sandboxed process."""
    tests = tests if tests is not None else [None] * len(completions)
    return [
        None if not test else float(run_python(extract_code(c) + "\n\n" + test).ok)
        for c, test in zip(completions, tests, strict=True)
    ]
