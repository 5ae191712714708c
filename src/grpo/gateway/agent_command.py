"""`grpo train --agent-command "CMD ..."`: an agent in any language, one process per episode.

    CMD  stdin   the dataset row as one JSON object (prompt and columns), then end of file
         env     OPENAI_BASE_URL, OPENAI_API_KEY: this episode's session (any OpenAI client honours them);
                 GRPO_REWARD_URL: the session's reward endpoint (POST {"reward": r})
         stdout  a number on the last non-empty line is the episode's reward; anything else (or nothing)
                 leaves the reward to what the process posted, else to the run's reward functions
         exit    non-zero: the episode failed (counted as agent_error, scored per env.failed_episode)

A leading `python` (or `python3`) is the interpreter running grpo, so a Python agent imports what grpo's
environment has installed (openai, the agent's own packages) whatever `python` is first on PATH.

`AgentCommand` is an agent function (`run(client, row)`), so the gateway's runner drives it like a Python
agent: same sessions, same timeout. The command runs in its own process group, without a shell unless it
is given as one string that needs one; at the time limit, on close, or when the run ends, the whole group
is killed (SIGTERM, then SIGKILL after a grace period), and after a normal exit any process it left behind
in its group is killed too, so no agent outlives its episode.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from grpo.gateway.clock import step_deadline

GRACE_S = 2.0  # between SIGTERM and SIGKILL
_POLL_S = 0.5  # how often a waiting command's time limit is read again (it moves while the batcher holds)
_STDERR_TAIL = 600  # characters of the command's stderr quoted in an error


class AgentCommandError(RuntimeError):
    """The command failed its episode: a non-zero exit, a timeout, or no such program."""


class AgentCommand:
    """Run `command` once per episode (see the module docstring); `timeout_s`: its time limit."""

    def __init__(self, command: str | list[str], timeout_s: float = 300.0, cwd: str | None = None) -> None:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ValueError('the agent command is empty; give the program to run, e.g. "python my_agent.py"')
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the Python running grpo: the agent sees the packages grpo sees
        if timeout_s <= 0:
            raise ValueError(f"the agent command's time limit must be positive, got {timeout_s}")
        self.argv, self.timeout_s, self.cwd = argv, timeout_s, cwd
        self.paused = _never  # the runner's: whether its batcher holds the step (its time limit waits)
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.__qualname__ = f"command {shlex.join(argv)!r}"  # how the runner names the agent in its log
        _ALL.add(self)

    def __getstate__(self) -> dict:
        """To a Ray rollout actor: the command, run from this directory when the actor's machine has it."""
        return {"argv": self.argv, "timeout_s": self.timeout_s, "cwd": self.cwd or os.getcwd()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["argv"], state["timeout_s"], state["cwd"] if os.path.isdir(state["cwd"]) else None
        )

    def __call__(self, client: Any, row: dict) -> float | None:
        base_url = str(client.base_url).rstrip("/")
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": str(client.api_key),
            "GRPO_REWARD_URL": f"{base_url}/reward",
        }
        # The row reaches its stdin from an unlinked file, whole and ended before the command starts. Not a
        # pipe written by communicate(input, timeout): a call that timed out before writing (its thread not
        # run within _POLL_S, as with hundreds of episodes starting at once) never wrote it on the calls
        # after (CPython registers stdin for writing only in a call given the input, and refuses the input
        # once started), and the command waited on its stdin until its time limit.
        with tempfile.TemporaryFile() as row_file:
            row_file.write(json.dumps(row, default=str).encode())
            row_file.seek(0)
            try:
                process = subprocess.Popen(
                    self.argv,
                    stdin=row_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    cwd=self.cwd,
                    text=True,
                    start_new_session=True,  # its own process group: killed whole, children included
                )
            except OSError as err:
                raise AgentCommandError(
                    f"cannot start the agent command {shlex.join(self.argv)!r}: {err}"
                ) from None
        with self._lock:
            self._live.add(process)
        # Its limit runs from when the step's requests can be served: a command started while the learner
        # updates (the runner's start_ahead) waits on a paused batcher, and that wait is not its time.
        deadline = step_deadline(self.timeout_s, self.paused)
        try:
            while True:
                left = max(min(deadline() - time.monotonic(), _POLL_S), 0.0)
                try:  # called again after a timeout, it goes on collecting the output
                    stdout, stderr = process.communicate(timeout=left)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline():
                        raise
        except subprocess.TimeoutExpired:
            _kill_group(process)
            raise AgentCommandError(
                f"the agent command ran past its {self.timeout_s:g} s limit and was killed with its children"
            ) from None
        finally:
            _kill_group(process, grace_s=0.0)  # whatever it left running in its group
            with self._lock:
                self._live.discard(process)
        if process.returncode != 0:
            tail = stderr.strip()[-_STDERR_TAIL:]
            raise AgentCommandError(
                f"the agent command exited with status {process.returncode}" + (f": {tail}" if tail else "")
            )
        return last_line_reward(stdout)

    def close(self) -> None:
        """Kill every episode's process group still running (the run ended or was interrupted). Signals
        only: each episode's own thread, blocked reading its process's output, then reaps it."""
        with self._lock:
            live = [p for p in self._live if p.poll() is None]
        for process in live:
            _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        for process in live:
            _signal_group(process.pid, signal.SIGKILL)  # the stragglers, and what the leaders left behind


def _never() -> bool:
    return False


def last_line_reward(stdout: str) -> float | None:
    """The reward a command printed: a finite number alone on its last non-empty line, else None."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value = float(lines[-1])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _kill_group(process: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the process's group and wait up to `grace_s`, then SIGKILL what is left of it; reap it."""
    group = process.pid  # start_new_session: the process leads its own group, whose id is its pid
    if grace_s > 0 and process.poll() is None:
        _signal_group(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    _signal_group(group, signal.SIGKILL)  # the leader's children too, even after it exited
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left in the group
        os.killpg(group, sig)


_ALL: weakref.WeakSet[AgentCommand] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit (the end of a run, Ctrl-C) no agent process is left behind."""
    for command in list(_ALL):
        command.close()
