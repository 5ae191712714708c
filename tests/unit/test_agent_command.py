"""`--agent-command`: one process per episode, the row on stdin, the session in its environment, the reward on
its last stdout line, and no process left behind (time limit, normal exit, close)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from grpo.gateway.agent_command import AgentCommand, AgentCommandError, last_line_reward

CLIENT = SimpleNamespace(base_url="http://127.0.0.1:5555/v1/", api_key="sk-episode-7")


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent, not us, reaps it)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1].split()[0] != "Z"


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_row_on_stdin_session_in_env_reward_on_last_line():
    code = (
        "import json, os, sys; row = json.load(sys.stdin); "
        "print(json.dumps([row, os.environ['OPENAI_BASE_URL'], os.environ['OPENAI_API_KEY'], "
        "os.environ['GRPO_REWARD_URL']])); print(); print(' 0.75 ')"
    )
    reward = AgentCommand(python(code))(CLIENT, {"prompt": "What is 2*3?", "answer": "#### 6"})
    assert reward == 0.75


def test_what_the_command_sees(tmp_path):
    out = tmp_path / "seen.json"
    code = (
        "import json, os, sys; row = json.load(sys.stdin); "
        f"open({str(out)!r}, 'w').write(json.dumps([row, os.environ['OPENAI_BASE_URL'], "
        "os.environ['OPENAI_API_KEY'], os.environ['GRPO_REWARD_URL']]))"
    )
    assert AgentCommand(python(code))(CLIENT, {"prompt": "p", "answer": "#### 6"}) is None  # nothing printed
    row, base_url, key, reward_url = json.loads(out.read_text())
    assert row == {"prompt": "p", "answer": "#### 6"}
    assert (base_url, key, reward_url) == (
        "http://127.0.0.1:5555/v1",
        "sk-episode-7",
        "http://127.0.0.1:5555/v1/reward",
    )


@pytest.mark.parametrize(
    ("stdout", "reward"),
    [
        ("1\n", 1.0),
        ("answer: 6\n-2.5\n\n", -2.5),
        ("#### 6\n", None),
        ("", None),
        ("nan\n", None),
        ("inf", None),
    ],
)
def test_last_line_reward(stdout, reward):
    assert last_line_reward(stdout) == reward


def test_string_command_is_split_like_a_shell_would():
    command = AgentCommand(f"{sys.executable} -c 'print(3)'")
    assert command(CLIENT, {}) == 3.0


def test_nonzero_exit_fails_the_episode_with_its_stderr():
    command = AgentCommand(python("import sys; sys.stderr.write('bad key\\n'); sys.exit(3)"))
    with pytest.raises(AgentCommandError, match="status 3: bad key"):
        command(CLIENT, {})


def test_missing_program_is_a_clear_error():
    with pytest.raises(AgentCommandError, match="cannot start the agent command"):
        AgentCommand(["/nonexistent/agent-binary"])(CLIENT, {})
    with pytest.raises(ValueError, match="empty"):
        AgentCommand("  ")


def test_timeout_kills_the_command_and_its_children(tmp_path):
    pids = tmp_path / "pids"
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pids)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    started = time.monotonic()
    with pytest.raises(AgentCommandError, match="past its 1 s limit"):
        AgentCommand(python(code), timeout_s=1.0)(CLIENT, {})
    assert time.monotonic() - started < 10
    assert wait_gone(int(pids.read_text()))


def test_children_left_behind_after_a_normal_exit_are_killed(tmp_path):
    pids = tmp_path / "pids"
    code = (
        "import subprocess, sys; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        f"open({str(pids)!r}, 'w').write(str(child.pid)); print(1)"
    )
    assert AgentCommand(python(code))(CLIENT, {}) == 1.0
    assert wait_gone(int(pids.read_text()))


def test_close_kills_running_episodes(tmp_path):
    command = AgentCommand(python("import time; time.sleep(60)"), timeout_s=60)
    errors: list[BaseException] = []

    def episode() -> None:
        try:
            command(CLIENT, {})
        except BaseException as err:  # noqa: BLE001 - collected for the assertion below
            errors.append(err)

    thread = threading.Thread(target=episode)
    thread.start()
    deadline = time.monotonic() + 10
    while not command._live and time.monotonic() < deadline:
        time.sleep(0.02)
    (process,) = command._live
    command.close()
    thread.join(10)
    assert not thread.is_alive() and not alive(process.pid)
    assert errors and isinstance(errors[0], AgentCommandError)  # killed: a non-zero exit, not a reward


def test_python_is_the_interpreter_running_grpo():
    assert AgentCommand("python -c 'import sys; print(sys.executable)'").argv[0] == sys.executable
    assert AgentCommand(["python3", "x.py"]).argv == [sys.executable, "x.py"]
    assert AgentCommand(["/usr/bin/env", "python"]).argv == ["/usr/bin/env", "python"]


def test_the_time_limit_waits_while_the_runner_holds_the_step():
    # Started while the learner updates (the runner's start_ahead), a command's wait on the paused batcher is
    # not its time: paused for 1.5 s, then 0.6 s more of its own, within a 1 s limit.
    release = time.monotonic() + 1.5
    command = AgentCommand(python("import time; time.sleep(1.9); print(0.5)"), timeout_s=1.0)
    command.paused = lambda: time.monotonic() < release
    assert command(CLIENT, {}) == 0.5
    command.paused = lambda: False  # not held: the same command is past its limit
    with pytest.raises(AgentCommandError, match="past its 1 s limit"):
        command(CLIENT, {})


def test_the_runner_gives_an_agent_command_its_paused_batcher_and_leaves_other_agents_alone():
    from grpo.agents import HermesParser
    from grpo.gateway.runner import AgentRunner
    from grpo.gateway.service import Limits
    from tests.chat_templates import family_tokenizer

    qwen, limits = family_tokenizer("qwen2.5"), Limits(100, 10, 100)
    command = AgentCommand(python("print(1)"))
    run = AgentRunner(command, qwen, HermesParser(), limits)
    assert command.paused == run._paused and not command.paused()  # no batcher yet: not held

    def agent(client, row):
        return 1.0

    agent.paused = "the user's own attribute"
    AgentRunner(agent, qwen, HermesParser(), limits).close()
    assert agent.paused == "the user's own attribute"
    run.close()


def test_the_row_arrives_when_the_first_wait_times_out_before_anything_is_written(monkeypatch):
    """Under load (500 episodes starting at once), an episode's thread may not run within the poll interval,
    so its first wait times out before writing anything. The row must still arrive whole: before, it went
    through communicate(input, timeout), whose later calls never write it, and the command waited on its
    stdin until its time limit. Here every process's first wait gets a 1 ns timeout."""
    communicate, first = subprocess.Popen.communicate, set()

    def hurried(self, input=None, timeout=None):
        if id(self) not in first:
            first.add(id(self))
            timeout = 1e-9
        return communicate(self, input, timeout)

    monkeypatch.setattr(subprocess.Popen, "communicate", hurried)
    code = "import json, sys; row = json.load(sys.stdin); print(len(row['prompt']) / 1000)"
    started = time.monotonic()
    reward = AgentCommand(python(code), timeout_s=20)(CLIENT, {"prompt": "x" * 250_000, "answer": "#### 6"})
    assert first and reward == 250.0
    assert time.monotonic() - started < 10  # not the time limit
