"""Config tree: aliases from the seeds, overrides, validation messages, presets, secrets."""

import pytest

from grpo.config import ConfigError, GRPOConfig, load_config, preset_names, resolve_key


def test_seed_grpoconfig_fields_map_onto_the_tree():
    cfg = GRPOConfig(
        batch_size=4,
        num_epochs=3,
        learning_rate=1e-6,
        num_generations_per_prompt=4,
        max_new_tokens=64,
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        gradient_accumulation_steps=4,
        max_grad_norm=1.0,
        warmup_steps=100,
        kl_coef=0.1,
        clip_range=0.2,
        gamma=1.0,
        logging_steps=10,
        save_steps=500,
        output_dir="./grpo_output",
        use_wandb=False,
        wandb_project="p",
        wandb_run_name="r",
    )
    assert cfg.train.prompts_per_step == 4 and cfg.optim.learning_rate == 1e-6
    assert cfg.generation.num_generations == 4 and cfg.algorithm.beta == 0.1
    assert cfg.algorithm.epsilon_low == cfg.algorithm.epsilon_high == 0.2
    assert cfg.batch_size == 4 and cfg.kl_coef == 0.1  # reading seed names works too
    cfg.learning_rate = 3e-6
    assert cfg.optim.learning_rate == 3e-6
    cfg.validate()


@pytest.mark.parametrize(
    "key,path",
    [
        ("optimizer.lr", ("optim.learning_rate",)),
        ("grpo_beta", ("algorithm.beta",)),
        ("--max-prefill-predict-length", ("data.max_prompt_length",)),
        ("env.dataset", ("data.dataset",)),
        ("train_model.num_devices", ("distributed.train_devices",)),
        ("inference_rollouts", ("distributed.weight_sync_steps",)),
        ("grpo_epsilon", ("algorithm.epsilon_low", "algorithm.epsilon_high")),
        ("model_name", ("model.name_or_path",)),
    ],
)
def test_aliases(key, path):
    assert resolve_key(key) == path


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"Unknown config key 'lerning_rate'.*learning_rate"):
        GRPOConfig(lerning_rate=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"beta": "high"}, "algorithm.beta expects float, got 'high'"),
        ({"steps": "1.5"}, "train.steps expects int"),
        ({"num_generations": 1}, "at least 2"),
        ({"temperature": 0}, "temperature must be > 0"),
        ({"temperature": 9.4e-291}, "temperature must be at least 0.001"),
        (
            {"loss_variant": "sapo", "sapo_temperature_neg": 1e-300},
            "sapo_temperature_neg must be at least 0.001",
        ),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"loss_aggregation": "mean"}, "is not one of sequence_mean, token_mean, constant"),
        (
            {"batch_size": 3, "num_generations": 4, "gradient_accumulation_steps": 5},
            r"3 × 4 = 12, which gradient_accumulation_steps = 5 does not divide.*1, 2, 3, 4, 6, 12",
        ),
        ({"use_pathways": "true"}, "TPU orchestration"),
        ({"profiler": "xplane"}, "JAX/TPU"),
        ({"inference_replicas": 4}, "inference_replicas=4"),
        ({"reward_funcs": [], "reward_model": None}, "No reward"),
        ({"reward_weights": "1,2,3"}, "3 entries but there are 2 rewards"),
        ({"env.tools": ""}, r"env.tools cannot be empty \(expected list; write \[\] for an empty list\)"),
    ],
)
def test_impossible_values_name_the_constraint(overrides, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**overrides).validate()


def test_string_values_from_the_command_line_are_typed():
    cfg = GRPOConfig(
        **{
            "train.steps": "12",
            "use_wandb": "true",
            "stop_strings": "</answer>,###",
            "reward_weights": "[1.0, 0.5]",
            "micro_batch_size": "none",
            "env.tools": "[]",
        }
    )
    assert cfg.train.steps == 12 and cfg.train.use_wandb is True
    assert cfg.generation.stop_strings == ["</answer>", "###"]
    assert cfg.algorithm.reward_weights == [1.0, 0.5] and cfg.train.micro_batch_size is None
    assert cfg.env.tools == []


def test_presets_and_files(tmp_path):
    assert {"tiny_math", "gsm8k"} <= set(preset_names())
    cfg = load_config("grpo_gsm8k", {"steps": 3})  # TorchRL's --config-name spelling
    assert cfg.data.dataset == "gsm8k" and cfg.train.steps == 3
    path = tmp_path / "mine.yaml"
    path.write_text("optim:\n  learning_rate: 0.001\ntrain:\n  steps: 7\n")
    cfg = load_config(str(path), {"train.steps": 9})
    assert cfg.optim.learning_rate == 0.001 and cfg.train.steps == 9  # overrides win over the file
    path.write_text("optim:\n  lr_typo: 1\n")
    with pytest.raises(ConfigError, match=r"Unknown config key 'optim\.lr_typo'"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"No preset or file named 'tiny_mth'.*tiny_math"):
        load_config("tiny_mth")


def test_secrets_are_redacted_from_dumps():
    cfg = GRPOConfig(hf_access_token="hf_SECRET123")
    assert cfg.hf_token() == "hf_SECRET123"
    assert "hf_SECRET123" not in cfg.to_yaml() and "<redacted>" in cfg.to_yaml()


def test_cli_accepts_key_value_overrides_between_flags():
    from grpo.cli import _assignments_first, build_parser

    parser = build_parser()
    argv = ["train", "--steps", "1", "optimizer.lr=1e-3", "--dataset", "a=b.jsonl", "--seed", "3", "beta=0.1"]
    # key=value words go before the flags (a bare flag such as --resume must not take one as its value)
    assert _assignments_first(parser, argv) == [
        "train",
        "optimizer.lr=1e-3",
        "beta=0.1",
        "--steps",
        "1",
        "--dataset",
        "a=b.jsonl",
        "--seed",
        "3",
    ]
    args = parser.parse_args(_assignments_first(parser, argv))
    assert args.assignments == ["optimizer.lr=1e-3", "beta=0.1"]


@pytest.mark.parametrize(
    ("module", "registry", "key"),
    [
        ("grpo.algorithm.loss", "POLICY_LOSSES", "algorithm.loss_variant"),
        ("grpo.algorithm.loss", "KL_ESTIMATORS", "algorithm.kl_estimator"),
        ("grpo.algorithm.loss", "LOSS_AGGREGATIONS", "algorithm.loss_aggregation"),
        ("grpo.algorithm.advantages", "ADVANTAGE_SCALINGS", "algorithm.advantage_scale"),
        ("grpo.algorithm.schedules", "LR_SCHEDULES", "optim.lr_scheduler"),
    ],
)
def test_a_registry_entry_is_a_valid_choice(monkeypatch, module, registry, key):
    """A new variant is one dict entry: the config's choices are the registry's keys, read at validation."""
    import importlib

    entries = getattr(importlib.import_module(module), registry)
    with pytest.raises(ConfigError, match=f"is not one of {', '.join(entries)}"):
        load_config(None, {key: "new_variant"})
    monkeypatch.setitem(entries, "new_variant", next(iter(entries.values())))
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, {key: "new_variant"}), section), name) == "new_variant"
