"""Multi-turn training end to end through grpo.GRPOTrainer, TRL's way (`tools=`, `environment_factory=`) and
the step form, on a tiny random Llama with Qwen2.5's real chat template."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.records import Rollouts
from grpo.rollout.native import NativeEngine
from tests.chat_templates import family_tokenizer

SETTINGS = {
    "prompts_per_step": 2,
    "num_generations": 2,
    "max_new_tokens": 6,
    "learning_rate": 1e-2,
    "warmup_steps": 0,
    "steps": 2,
    "logging_steps": 1,
    "progress_bar": False,
    "num_threads": 1,
    "beta": 0.0,
    "tensorboard": False,
    "max_prompt_length": 768,
    "eval_before": False,
    "eval_after": False,
    "save_steps": 0,
    "env.max_tokens": 200,
}


def model_and_tokenizer():
    tokenizer = family_tokenizer("qwen2.5")
    tokenizer.pad_token = "<|endoftext|>"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config), tokenizer


class EndsItsTurns(NativeEngine):
    """The native engine, except that a turn the random model leaves open is closed with the eos token
    (so that episodes have several turns). The forced token is not the model's sample: the learner treats
    this sampler as another policy (recomputes π_old, corrects with importance weights)."""

    sampler_differs = True

    @property
    def exact_logprobs(self) -> bool:
        return False

    def generate(self, prompt_ids, n, sampling, chunk_prompts=None):
        shorter = dataclasses.replace(sampling, max_new_tokens=sampling.max_new_tokens - 1)
        out = super().generate(prompt_ids, n, shorter, chunk_prompts)
        rows = out.completion_ids.shape[0]
        ids = torch.cat([out.completion_ids, torch.full((rows, 1), self.pad_id)], 1)
        mask = torch.cat([out.completion_mask, torch.zeros(rows, 1)], 1)
        logprobs = torch.cat([out.sampling_logprobs, torch.zeros(rows, 1)], 1)
        for r in range(rows):
            if out.truncated[r]:
                k = int(out.completion_mask[r].sum())
                ids[r, k], mask[r, k], logprobs[r, k] = int(self.eos_ids[0]), 1.0, -1.0
        return Rollouts(out.group_ids, ids, mask, logprobs, torch.zeros(rows, dtype=torch.bool))


def dataset(n: int = 4) -> Dataset:
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Count to {i + 2}."}], "target": i + 2} for i in range(n)]
    )


class Echo:
    """The step form: the environment answers twice, then ends the episode with a reward."""

    def reset(self, row):
        self.turns = 0
        return None  # the dataset's prompt as it is

    def step(self, messages):
        self.turns += 1
        if self.turns == 2:
            return [], float(len(messages[-1]["content"]) % 3), True
        return [{"role": "user", "content": "Go on."}], None, False


def length_reward(prompts, completions, **_):
    return [float(len(json.dumps(c)) % 5) for c in completions]


def _train(tmp_path, **kwargs):
    model, tokenizer = model_and_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = GRPOConfig(**SETTINGS, output_dir=str(tmp_path / "run"))
    trainer = GRPOTrainer(model=model, tokenizer=tokenizer, config=cfg, train_dataset=dataset(), **kwargs)
    trainer.parts.engine = EndsItsTurns(trainer.parts.policy, tokenizer)
    summary = trainer.train()
    moved = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    return summary, moved, lines, samples


def test_a_step_environment_trains_on_whole_episodes(tmp_path):
    summary, moved, lines, samples = _train(tmp_path, environment_factory=Echo, reward_funcs=[length_reward])
    assert moved and all(torch.isfinite(torch.tensor(m["loss"])) for m in lines)
    assert summary["episode/turns"] == 2.0  # every episode: sample, "Go on.", sample, done
    assert summary["episode/injected_tokens"] > 0 and summary["episode/sampled_tokens"] > 0
    assert "reward/Echo" in summary and "reward/length_reward" in summary
    roles = [m["role"] for m in samples[0]["messages"]]
    assert roles == ["assistant", "user", "assistant"] and samples[0]["turns"] == 2


class Notebook:
    """TRL's form: reset(**row) and public methods as tools; the reward function reads the instances."""

    def reset(self, **row):
        self.target, self.notes = row["target"], []

    def write(self, text: str) -> str:
        """Write a note.

        Args:
            text: What to write.
        """
        self.notes.append(text)
        return "ok"


def test_trl_environment_factory_and_tools_run_through_the_trainer(tmp_path):
    seen = []

    def env_reward(completions, environments, target, **_):
        seen.append(environments)
        return [float(env.target == t) for env, t in zip(environments, target, strict=True)]

    summary, moved, _, samples = _train(
        tmp_path, environment_factory=Notebook, reward_funcs=[env_reward, length_reward]
    )
    assert moved and summary["reward/env_reward"] == 1.0
    assert all(isinstance(e, Notebook) for batch in seen for e in batch) and len(seen[0]) == 4
    assert samples[0]["messages"][0]["role"] == "assistant"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. 12*34
    """
    return "408"


def test_tools_list_runs_through_the_trainer_and_the_prompt_declares_them(tmp_path):
    summary, moved, _, _ = _train(tmp_path / "t", tools=[calculator], reward_funcs=[length_reward])
    assert moved and "episode/tool_calls" in summary


def test_an_unknown_tool_call_format_is_refused_at_start_up(tmp_path):
    model, _ = model_and_tokenizer()
    from transformers import AutoTokenizer

    from grpo.config import ConfigError
    from grpo.model.loading import bundled_model_path

    bundled = AutoTokenizer.from_pretrained(bundled_model_path())
    cfg = GRPOConfig(**SETTINGS, output_dir=str(tmp_path / "run"), model="my-org/plain-chat")
    with pytest.raises(ConfigError, match="tool-call format"):
        GRPOTrainer(model=model, tokenizer=bundled, config=cfg, train_dataset=dataset(), tools=[calculator])


def test_grpo_eval_runs_the_tiny_tools_model_with_its_tool_and_with_the_offline_control(tmp_path, capsys):
    """`grpo eval --config tiny_tools` puts the calculator in the loop; `--tools` swaps it for the control,
    whose every tool message says it is offline (the same calls, no results). Sampled (k = 4): the bundled
    model calls the tool in about a quarter of its samples and never under greedy decoding."""
    from grpo.cli import main

    def run(*extra: str) -> tuple[dict, list[dict]]:
        dump = tmp_path / f"dump{len(extra)}.jsonl"
        assert (
            main(
                [
                    "eval",
                    "--config",
                    "tiny_tools",
                    "--limit",
                    "12",
                    "--k",
                    "4",
                    "--json",
                    "--dump",
                    str(dump),
                    *extra,
                ]
            )
            == 0
        )
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return out, [json.loads(line) for line in dump.read_text().splitlines()]

    def tool_messages(records: list[dict]) -> list[str]:
        return [m["content"] for r in records for ep in r["messages"] for m in ep if m["role"] == "tool"]

    live, live_records = run()
    assert live["n"] == 12 and live["tool_call_rate"] > 0
    live_results = tool_messages(live_records)
    assert live_results and any(text.lstrip("-").isdigit() for text in live_results)

    offline, offline_records = run("--tools", "grpo.agents.calculator:offline_calculator")
    offline_results = tool_messages(offline_records)
    assert offline["n"] == 12 and offline["tool_call_rate"] > 0
    assert offline_results and all("offline" in text for text in offline_results)


def test_agent_prompts_are_rendered_and_tokenized_once_by_the_runner(tmp_path, monkeypatch):
    """The feed leaves an agent run's prompts to the episode runner (it renders them with their tools)."""
    from grpo.data import PromptFormatter

    encoded = []
    real = PromptFormatter.encode
    monkeypatch.setattr(
        PromptFormatter, "encode", lambda self, *a, **k: encoded.append(a) or real(self, *a, **k)
    )
    model, tokenizer = model_and_tokenizer()
    cfg = GRPOConfig(**SETTINGS, output_dir=str(tmp_path / "run"))
    trainer = GRPOTrainer(
        model=model, tokenizer=tokenizer, config=cfg, train_dataset=dataset(), tools=[calculator],
        reward_funcs=[length_reward],
    )  # fmt: skip
    encoded.clear()
    trainer.train()
    assert encoded == []  # training steps: the runner's rendering only


class Tracked(Notebook):
    """Notebook that records its instances and their closing."""

    made: typing.ClassVar[list] = []
    closed: typing.ClassVar[list] = []

    def __init__(self):
        Tracked.made.append(id(self))

    def close(self):
        Tracked.closed.append(id(self))


@pytest.mark.parametrize("ending", ["finished", "reward_crash", "ctrl_c"])
def test_every_environment_is_closed_when_the_run_ends_however_it_ends(tmp_path, ending):
    Tracked.made, Tracked.closed = [], []

    def reward(completions, **_):
        if ending == "reward_crash":
            raise RuntimeError("a bug in the reward")
        if ending == "ctrl_c":
            raise KeyboardInterrupt
        return [1.0] * len(completions)

    raised = None
    try:
        _train(tmp_path, environment_factory=Tracked, reward_funcs=[reward])
    except BaseException as err:  # noqa: BLE001 - the ending under test
        raised = err
    assert (raised is None) == (ending == "finished")
    assert len(Tracked.made) >= 4 and sorted(Tracked.closed) == sorted(Tracked.made)


def test_an_environment_breaking_its_contract_stops_grpo_train_with_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{root / 'src'}:{root}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "grpo.cli", "train", "--config", "tiny_tools", "train.steps=1",
         "env.environment=tests.unit.test_environment_contracts:Raises", "train.eval_before=false",
         "train.eval_after=false", "train.prompts_per_step=2", f"train.output_dir={tmp_path / 'run'}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo train: error: Raises.reset(**row) raised KeyError: 'no such task'"), last
    assert "Traceback" not in out.stderr
