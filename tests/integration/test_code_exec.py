"""The code-execution environment (agents/code_exec.py): the model's Python runs in the sandbox, its output
comes back, and no process outlives the environment, nor a run killed at a random point."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from grpo.agents.code_exec import PythonSandbox
from grpo.agents.factory import build_factory
from tests.unit.test_episodes import SAMPLING, ScriptedEngine, batch, call_text, runner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen():
    from tests.chat_templates import family_tokenizer

    return family_tokenizer("qwen2.5")


def test_a_fenced_block_runs_and_what_it_prints_comes_back(qwen):
    def script(text):
        return "```python\nprint(6 * 7)\n```" if "42" not in text else "The answer is 42."

    _, r = runner(qwen, environment=PythonSandbox).run(
        ScriptedEngine(qwen, script), batch(["q"]), 2, SAMPLING
    )
    episode = r.episodes[0]
    assert [m["role"] for m in episode.messages] == ["assistant", "user", "assistant"]
    assert episode.messages[1]["content"] == "42" and episode.ended_by == "answer"
    assert r.episodes[0].env_class == "PythonSandbox" and r.episodes[0].env_reward is None


def test_a_run_python_tool_call_answers_as_the_tool_message(qwen):
    def script(text):
        if "<tool_response>" not in text:
            return call_text(
                "run_python", {"code": "import sys\nprint(2 + 2)\nprint('oops', file=sys.stderr)"}
            )
        return "4"

    run = runner(qwen, environment=PythonSandbox)
    assert [s["function"]["name"] for s in run.factory.schemas({})] == ["run_python"]
    _, r = run.run(ScriptedEngine(qwen, script), batch(["q"]), 1, SAMPLING)
    tool = r.episodes[0].messages[1]
    assert tool["role"] == "tool" and tool["content"] == "4\noops" and r.episodes[0].tool_calls == 1


def test_the_sandboxs_time_limit_holds():
    start = time.perf_counter()
    out = PythonSandbox(timeout_s=1).run_python("while True:\n    pass")
    assert "[stopped: the program ran past 1 s]" in out and time.perf_counter() - start < 5


def test_env_environment_python_names_it():
    factory = build_factory(None, "python")
    assert factory.classes[None] is PythonSandbox and factory.reward_names == []
    factory.close()


def _recorder(path: Path, seconds: float) -> str:
    """Code that records its pid and a forked child's, then sleeps."""
    return textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            open({str(path)!r}, "a").write(f"{{os.getpid()}}\\n")
            time.sleep({seconds})
            os._exit(0)
        open({str(path)!r}, "a").write(f"{{os.getpid()}}\\n")
        time.sleep({seconds})
    """)


def _pids(path: Path, count: int, within: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if path.exists() and len(lines := path.read_text().split()) >= count:
            return [int(x) for x in lines]
        time.sleep(0.05)
    raise AssertionError(f"the sandboxed code did not start ({path.read_text() if path.exists() else ''})")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _all_gone(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_close_kills_a_running_program_and_its_children(tmp_path):
    env = PythonSandbox(timeout_s=60)
    path = tmp_path / "pids"
    out = []
    call = threading.Thread(target=lambda: out.append(env.run_python(_recorder(path, 60))))
    call.start()
    pids = _pids(path, 2)
    env.close()
    call.join(10)
    assert not call.is_alive() and _all_gone(pids)


DRIVER = """
import signal, sys
# SIGINT as a terminal's Ctrl-C delivers it: a child of a background job (`make test`'s suite run with `&`,
# nohup) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all.
signal.signal(signal.SIGINT, signal.default_int_handler)
from grpo.agents.code_exec import PythonSandbox
from tests.chat_templates import family_tokenizer
from grpo.records import SamplingParams
from tests.unit.test_episodes import ScriptedEngine, batch, runner
from tests.integration.test_code_exec import _recorder
from pathlib import Path

qwen = family_tokenizer("qwen2.5")
LONG = SamplingParams(max_new_tokens=1000)  # the whole program in one turn, however long its path
code = _recorder(Path(sys.argv[1]), 600)
run = runner(qwen, environment=lambda: PythonSandbox(timeout_s=600), tool_timeout_s=600, turn_tokens=1000)
while True:
    run.run(ScriptedEngine(qwen, lambda text: f"```python\\n{code}\\n```"), batch(["a"]), 1, LONG)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_no_sandboxed_process_survives_a_run_killed_at_a_random_point(tmp_path, how):
    path = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "driver.log", "w")  # noqa: SIM115 - closed with the driver
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(path)], cwd=ROOT, env=env, stdout=log, stderr=log
    )
    try:
        try:
            pids = _pids(path, 2, within=120)  # the episode's program and its child
        except AssertionError:
            raise AssertionError((tmp_path / "driver.log").read_text()[-2000:]) from None
        time.sleep(random.uniform(0.0, 0.5))
        driver.send_signal(how)
        driver.wait(30)
        more = [int(x) for x in path.read_text().split()]
        assert _all_gone(sorted(set(pids + more)))
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
