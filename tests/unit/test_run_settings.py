"""Settings resolved once (issue 30 §2): the start's decisions live in a frozen RunSettings, the caller's
config is only read, config.yaml is written from the settings, and every consumer reads ONE completion limit
(an agent run's is the whole episode's). Plus TRL's and TorchRL's names that touch the env.* section (§4)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

import grpo.run.assemble
from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ALIASES, ConfigError, TRLConfigError, all_paths, load_config
from grpo.config.settings import RunSettings, completion_limit
from grpo.run.rundir import RUN_CONFIG_HEADER
from grpo.run.sizes import step_bytes
from tests import tiny_run

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_the_completion_limit_is_the_episodes_for_agents_and_one_samples_otherwise():
    cfg = GRPOConfig(max_new_tokens=48, max_turns=4)
    assert completion_limit(cfg, multi_turn=False) == 48
    assert completion_limit(cfg, multi_turn=True) == 4 * 48  # env.max_tokens unset: every turn at its cap
    assert completion_limit(GRPOConfig(max_new_tokens=48, max_turns=4, max_tokens=100), True) == 100
    settings = RunSettings.resolve(cfg, {}, multi_turn=True)
    assert (settings.completion_limit, settings.turn_limit) == (192, 48)
    assert settings.max_model_len == cfg.data.max_prompt_length + 192


def test_settings_are_frozen_and_hold_only_start_up_decisions():
    cfg = GRPOConfig()
    settings = RunSettings.resolve(cfg, {"train.num_threads": 3}, multi_turn=False)
    assert settings.config.train.num_threads == 3 and cfg.train.num_threads != 3  # a copy, not the caller's
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.completion_limit = 1
    with pytest.raises(ValueError, match=r"not a start-up decision: optim\.learning_rate"):
        RunSettings.resolve(cfg, {"optim.learning_rate": 1.0}, multi_turn=False)
    more = settings.extend({"data.eval_dataset": None})
    assert more.decided == {"train.num_threads": 3, "data.eval_dataset": None}
    assert more.config.train.num_threads == 3 and more.config.data.eval_dataset is None
    # a decision made after the model's config was read (train(resume_from_checkpoint=)) keeps its positions
    sized = dataclasses.replace(settings, model_context=512).extend({"train.resume": "latest"})
    assert sized.model_context == 512 and sized.config.train.resume == "latest" and cfg.train.resume is None


def test_the_memory_preflight_counts_the_whole_episode():
    from types import SimpleNamespace

    model = SimpleNamespace(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, vocab_size=10)
    cfg = GRPOConfig(batch_size=2, num_generations=2, max_new_tokens=8, max_prompt_length=8, max_turns=4)
    one_turn, _ = step_bytes(RunSettings.resolve(cfg, {}, multi_turn=False), model, 4)
    episode, _ = step_bytes(RunSettings.resolve(cfg, {}, multi_turn=True), model, 4)
    assert one_turn * (8 + 4 * 8) == episode * (8 + 8)  # positions: prompt + 4 turns, not prompt + 1


def test_assembly_reads_the_config_and_config_yaml_holds_what_the_start_decided(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import grpo.trainer
    from grpo.distributed.roles import RolePlan

    # The device plan's decision (several ranks share the Ray cluster made here) reaches the settings too.
    plan = RolePlan(1, ["cpu"], "with policy", "colocated", ray_address="auto")
    monkeypatch.setattr(grpo.trainer, "apply_role_plan", lambda *_: plan)

    model_dir = tiny_run.make_model_dir(tmp_path / "model")
    cfg = GRPOConfig(
        dataset=str(FIXTURES / "ifeval_sample.jsonl"),  # IFEval's columns: its rewards are chosen for it
        base_output_directory=str(tmp_path / "runs"),  # no output_dir: the run name is decided
        max_new_tokens=6,
        max_prompt_length=200,
        batch_size=2,
        num_generations=2,
        steps=1,
        num_threads=1,
    )
    before = cfg.to_yaml()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), config=cfg)
    assert cfg.to_yaml() == before  # nothing wrote to the caller's config
    settings = trainer.settings
    assert trainer.cfg is settings.config and trainer.args is settings.config
    assert settings.decided["algorithm.reward_funcs"] == ["torchrl_ifeval"]
    assert settings.decided["model.name_or_path"] == str(model_dir)
    assert settings.decided["train.run_name"] == trainer.parts.run_dir.name and cfg.train.run_name is None
    written = (trainer.parts.run_dir / "config.yaml").read_text()
    assert written == RUN_CONFIG_HEADER + settings.to_yaml()
    assert "- torchrl_ifeval" in written and str(model_dir) in written
    assert settings.config.distributed.ray_address == "auto" and cfg.distributed.ray_address is None
    assert "ray_address: auto" in written


def test_an_agent_run_longer_than_the_models_positions_is_refused_before_the_weights_load(
    tmp_path, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the sizes were checked")

    monkeypatch.setattr(grpo.run.assemble, "_policy", refuse)
    # tiny-tools-lm has 512 positions; 4 turns of up to 128 tokens each, after the prompt, do not fit
    # (counting one turn, 128 + the prompt, they would).
    cfg = load_config(
        "tiny_tools",
        {
            "env.max_tokens": None,
            "max_new_tokens": 128,
            "output_dir": str(tmp_path / "run"),
            "eval_before": False,
        },
    )
    with pytest.raises(ConfigError) as refused:
        GRPOTrainer(config=cfg)
    message = str(refused.value)
    assert "env.max_turns × generation.max_new_tokens (4 × 128 = 512)" in message
    assert "the model has 512 (max_position_embeddings)" in message
    assert (
        "Set env.max_tokens to " in message
        and "or lower env.max_turns × generation.max_new_tokens" in message
    )


def test_an_agent_run_that_set_no_lengths_gets_an_episode_budget_that_fits_the_model(tmp_path, monkeypatch):
    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    written: list[str] = []
    monkeypatch.setattr(grpo.run.assemble, "_policy", stop)
    monkeypatch.setattr(grpo.run.assemble, "write_run_config", lambda run_dir, text: written.append(text))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("grpo").addHandler(handler)
    try:
        # The default preset's 4 turns × 48 tokens after its longest prompt (70 tokens) need 262 positions;
        # the bundled model has 256. Nothing about lengths was set: the budget is fitted, not refused.
        cfg = load_config(
            "tiny_math",
            {
                "env.agent": "tests.gateway_agents:calculator_agent",
                "output_dir": str(tmp_path / "run"),
                "eval_before": False,
            },
        )
        with pytest.raises(Loaded):  # the context check passed: the weights were about to load
            GRPOTrainer(config=cfg)
    finally:
        logging.getLogger("grpo").removeHandler(handler)
    assert any("env.max_tokens is set to 186 so every episode fits" in m for m in said)
    assert "max_tokens: null" in written[0] and "max_tokens: 186" in written[-1]  # config.yaml shows it
    assert cfg.env.max_tokens is None  # the caller's config is not written
    # A length the user set is theirs: the same overflow is refused, as above.
    cfg = load_config(
        "tiny_math",
        {
            "env.agent": "tests.gateway_agents:calculator_agent",
            "env.max_turns": 4,
            "output_dir": str(tmp_path / "run2"),
            "eval_before": False,
        },
    )
    with pytest.raises(ConfigError, match=r"Set env\.max_tokens to 186 or less"):
        GRPOTrainer(config=cfg)


def test_trl_max_tool_calling_iterations_sets_the_turn_cap():
    # TRL counts rounds of tool calls, each followed by one more sampled turn: N rounds, N + 1 turns.
    assert GRPOConfig(max_completion_length=64, max_tool_calling_iterations=3).env.max_turns == 4
    assert GRPOConfig(max_completion_length=64, max_tool_calling_iterations=0).env.max_turns == 1
    unset = GRPOConfig(max_completion_length=64, max_tool_calling_iterations=None).env.max_turns
    assert unset == GRPOConfig().env.max_turns
    with pytest.raises(TRLConfigError, match=r"max_tool_calling_iterations=-1\) must be a whole number"):
        GRPOConfig(max_completion_length=64, max_tool_calling_iterations=-1)


def test_torchrl_env_names_say_which_setting_they_are_and_never_shadow_the_env_section(caplog):
    with caplog.at_level(logging.INFO, logger="grpo"):
        cfg = load_config(None, {"env.repeats": 4, "env.max_turns": 3})
    assert (cfg.generation.num_generations, cfg.env.max_turns) == (4, 3)
    said = [r.getMessage() for r in caplog.records if "TorchRL's name" in r.getMessage()]
    assert said == [
        "Config: env.repeats is TorchRL's name for generation.num_generations (this package's env.* "
        "settings are the agent environment's: env.tools, env.environment, env.max_turns, ...)."
    ]
    # An alias that were also a field's own path would have two meanings: none is.
    assert not set(ALIASES) & set(all_paths())


def test_vllm_max_model_len_is_the_prompt_plus_the_completion_limit_within_the_model():
    cfg = GRPOConfig(max_new_tokens=48, max_turns=4, max_prompt_length=160)
    agent = RunSettings.resolve(cfg, {}, multi_turn=True)
    assert agent.generation.vllm_max_model_len == 160 + 4 * 48
    assert dataclasses.replace(agent, model_context=256).generation.vllm_max_model_len == 256
    assert agent.config.generation.vllm_max_model_len is None  # config.yaml keeps the user's (unset)
    chosen = RunSettings.resolve(GRPOConfig(**{"generation.vllm_max_model_len": 1000}), {}, False)
    assert chosen.generation.vllm_max_model_len == 1000


def test_the_colocated_engine_gets_the_settings_generation_section(monkeypatch):
    from types import SimpleNamespace

    import torch

    from grpo.distributed.runtime import Runtime
    from grpo.rollout import colocated

    seen = {}
    monkeypatch.setattr(colocated, "build_engine", lambda *a, **k: seen.update(k))
    monkeypatch.setattr(colocated, "ColocatedRollout", lambda *a, **k: None)
    cfg = GRPOConfig(max_new_tokens=48, max_turns=4, max_prompt_length=160)
    settings = RunSettings.resolve(cfg, {}, multi_turn=True)
    parts = SimpleNamespace(
        policy=torch.nn.Linear(1, 1),
        engine=None,
        tokenizer=None,
        compute_dtype=torch.float32,
        settings=settings,
    )
    colocated.build(settings.config, parts, Runtime(), None, None, None)
    assert seen["generation"].vllm_max_model_len == 160 + 4 * 48


def test_trls_peft_config_is_applied_to_a_copy_not_the_callers_args(tmp_path):
    peft = pytest.importorskip("peft")
    model_dir = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 4)
    args = GRPOConfig(**tiny_run.config(model_dir, data, tmp_path / "run"))
    before = args.to_yaml()
    trainer = GRPOTrainer(
        args=args, peft_config=peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")
    )
    assert args.to_yaml() == before and not args.lora.enabled
    assert trainer.args.lora.enabled and trainer.args.lora.r == 2


def test_the_learner_of_an_agent_run_normalises_by_the_episode_limit(tmp_path, monkeypatch):
    import grpo.train

    class Stop(Exception):
        pass

    seen = {}

    def learner(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    cfg = load_config("tiny_tools", {"output_dir": str(tmp_path / "run"), "eval_before": False, "steps": 1})
    trainer = GRPOTrainer(config=cfg)
    monkeypatch.setattr(grpo.train, "Learner", learner)
    with pytest.raises(Stop):
        trainer.train()
    # env.max_tokens 160: the episode's limit, not one turn's max_new_tokens (48)
    assert (
        seen["completion_limit"] == trainer.settings.completion_limit == 160 != cfg.generation.max_new_tokens
    )


CONFIG_NAMES = {"cfg", "config", "args", "self.cfg", "self.args"}  # what the code calls a GRPOConfig


def config_writes(source: str) -> list[str]:
    """`cfg.section.key = ...` (and `+=`) in a module's code: a config, args or self.cfg written to."""
    import ast

    sections = {f.name for f in dataclasses.fields(GRPOConfig)}
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) else []:
            if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)):
                continue
            section, root = target.value, target.value.value
            if section.attr in sections and ast.unparse(root) in CONFIG_NAMES:
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def test_config_writes_are_found_and_none_are_made_outside_the_config_package():
    """Issue 30 §2: a start's decisions are RunSettings' (config/settings.py), never writes into the
    validated config (roles.py wrote distributed.ray_address, lifecycle.py train.resume)."""
    assert config_writes("cfg.train.resume = 'latest'\nself.cfg.distributed.ray_address = 'auto'\n") == [
        "1: cfg.train.resume",
        "2: self.cfg.distributed.ray_address",
    ]
    assert config_writes("model.config.use_cache = False\nargs.config = 'x'\n") == []
    src = Path(grpo.run.assemble.__file__).resolve().parents[1]
    writes = {
        str(path.relative_to(src)): found
        for path in sorted(src.rglob("*.py"))
        if "config" not in path.relative_to(src).parts[:1]
        and (found := config_writes(path.read_text(encoding="utf-8")))
    }
    assert writes == {}, f"config written after validation (record a RunSettings decision instead): {writes}"
