"""The tool stage of one tiny_tools-sized step (128 episodes, one calculator call each), in-process
(algorithm.reward_isolation=thread) vs in worker processes (auto), interleaved; the engine is scripted, so
only episode work is timed (docs/reliability.md, issue 32).

    PYTHONPATH=src:. python benchmarks/tool_isolation.py
"""

import time

from transformers import AutoTokenizer

from grpo.agents import HermesParser
from grpo.agents.calculator import calculator
from grpo.agents.workers import isolate_factory
from grpo.config import DataConfig
from grpo.data import PromptFormatter
from grpo.model.loading import bundled_model_path
from tests.unit.test_episodes import (  # where the episode machinery lives, whichever module that is
    SAMPLING,
    EnvironmentFactory,
    EpisodeLimits,
    MultiTurn,
    ScriptedEngine,
    batch,
    call_text,
)

tok = AutoTokenizer.from_pretrained(bundled_model_path("tiny-tools-lm"))


def script(seen: str) -> str:
    return call_text("calculator", {"expression": "12*34"}) if "<|tool|>" not in seen else "#### 408"


def runner(isolation: str) -> MultiTurn:
    factory = EnvironmentFactory([calculator])
    isolate_factory(factory, ["grpo.agents.calculator:calculator"], None, isolation, 10.0)
    formatter = PromptFormatter(tok, DataConfig(max_prompt_length=512))
    return MultiTurn(factory, formatter, HermesParser(), EpisodeLimits(4, 160, 48))


runs = {"thread": runner("thread"), "auto": runner("auto")}
for rep in range(4):
    for mode, run in runs.items():
        started = time.perf_counter()
        engine = ScriptedEngine(tok, script, eos="<|end|>")
        _, rollouts = run.run(engine, batch(["What is 12*34?"] * 16), 8, SAMPLING)
        seconds = time.perf_counter() - started
        calls = sum(e.tool_calls for e in rollouts.episodes)
        print(
            f"rep {rep} {mode:6s}: {seconds * 1e3:7.1f} ms a step of 128 episodes ({calls} calls)", flush=True
        )
