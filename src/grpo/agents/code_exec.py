"""A code-execution environment shipped with grpo: the model runs Python and reads what it prints.

    env.environment: python     (or grpo.agents.code_exec:PythonSandbox; environment_factory=PythonSandbox)

Each assistant turn may run code in one of two ways:
- a `run_python` tool call (the prompt declares the tool): its output comes back as the tool message;
- a fenced block (```python ... ```) with no tool call: its output comes back as a user message.
A turn with neither is the answer and ends the episode. The code runs in rewards/sandbox.py's `run_python`: a
separate `python -I` process in an empty directory under time, memory, file-size and process-count limits
(a guard against runaway code, not a security boundary). What it prints (stdout, then the end of stderr) is
the model's to read. Every process still running is killed when the environment is closed, and a sandboxed
process whose trainer dies (even by SIGKILL) kills its own process group.

It implements the Environment protocol itself (agents/environments.py), so it is one module plus one
registry line (factory.BUILTIN_ENVIRONMENTS). It gives no reward of its own: score the answers with reward
functions (e.g. gsm8k_correctness), or subclass it and return one from reward().
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading

from grpo.agents.environments import StepResult
from grpo.rewards import sandbox

_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


class PythonSandbox:
    """Runs the model's Python (a `run_python` call or a fenced block) in the sandbox (module docstring)."""

    tool_methods = ("run_python",)  # described to the model from the method's docstring and type hints
    gives_reward = False

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, output_chars: int = 2000):
        self.timeout_s, self.memory_mb, self.output_chars = timeout_s, memory_mb, output_chars
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def start(self, messages: list[dict], row: dict) -> list[dict]:
        del row
        return messages

    def step(self, conversation: list[dict], turn) -> StepResult:
        if turn.calls or turn.errors:
            return StepResult([], run_calls=True)
        blocks = _FENCED.findall(str(conversation[-1].get("content") or ""))
        if not blocks:
            return StepResult([], done=True, ended_by="answer")
        return StepResult([{"role": "user", "content": self.run_python(blocks[-1])}])

    def reward(self) -> float | None:
        return None

    def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: The program's source; use print() to see values.
        """
        result = sandbox.run_python(
            code,
            timeout=self.timeout_s,
            memory_mb=self.memory_mb,
            output_chars=self.output_chars,
            on_start=self._started,
        )
        with self._lock:
            self._running = {p for p in self._running if p.poll() is None}
        text = result.stdout.rstrip("\n")
        if result.stderr:
            text += ("\n" if text else "") + result.stderr[-self.output_chars // 2 :]
        if result.timed_out:
            text += f"\n[stopped: the program ran past {self.timeout_s:g} s]"
        return text.strip() or "(no output)"

    def _started(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._running.add(process)

    def close(self) -> None:
        """Kill every program still running (each in its own process group: children included)."""
        with self._lock:
            running, self._running = self._running, set()
        for process in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
