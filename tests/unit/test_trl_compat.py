"""TRL's GRPOConfig names and defaults mapped to ours; refusals that say why; bare --resume."""

import pytest

from grpo import GRPOConfig
from grpo.cli import _assignments_first, _overrides, build_parser
from grpo.config import ConfigError
from grpo.trl_compat import TRLConfigError


def test_trl_names_translate_with_trl_defaults():
    cfg = GRPOConfig(
        output_dir="out",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=32,
        beta=0.04,
        epsilon_high=0.28,
        max_steps=5,
        report_to="none",
        use_cpu=True,
        bf16=False,
        learning_rate=1e-5,
    ).validate()
    # 4 completions per micro-batch × 2 micro-batches = 8 completions = 2 prompts × 4 generations
    assert (
        cfg.train.prompts_per_step,
        cfg.train.micro_batch_size,
        cfg.train.gradient_accumulation_steps,
    ) == (2, 4, 2)
    assert cfg.generation.max_new_tokens == 32 and cfg.train.steps == 5 and cfg.model.device == "cpu"
    assert (cfg.algorithm.epsilon_low, cfg.algorithm.epsilon_high, cfg.algorithm.beta) == (0.2, 0.28, 0.04)
    # TRL 1.16's defaults where the script says nothing: loss "dapo", bias-corrected KL, sampling off,
    # linear lr
    assert (cfg.algorithm.loss_variant, cfg.algorithm.loss_aggregation) == ("grpo", "token_mean")
    assert cfg.algorithm.use_bias_correction_kl is True
    assert (cfg.generation.temperature, cfg.generation.top_k, cfg.generation.top_p) == (1.0, 0, 1.0)
    assert (cfg.optim.lr_scheduler, cfg.optim.warmup_steps, cfg.optim.adam_beta2) == ("linear", 0, 0.999)
    assert cfg.optim.learning_rate == 1e-5


def test_our_own_names_keep_our_defaults():
    cfg = GRPOConfig(batch_size=4, learning_rate=1e-6)
    assert cfg.algorithm.beta == 0.1 and cfg.algorithm.use_bias_correction_kl is False
    assert cfg.generation.temperature == 0.7


@pytest.mark.parametrize(
    "loss_type,level,variant,aggregation",
    [
        ("grpo", "token", "grpo", "sequence_mean"),
        ("bnpo", "token", "grpo", "token_mean"),
        ("dr_grpo", "token", "grpo", "constant"),
        ("dapo", "sequence", "gspo", "token_mean"),
        ("sapo", "token", "sapo", "sequence_mean"),
    ],
)
def test_loss_types(loss_type, level, variant, aggregation):
    cfg = GRPOConfig(loss_type=loss_type, importance_sampling_level=level)
    assert (cfg.algorithm.loss_variant, cfg.algorithm.loss_aggregation) == (variant, aggregation)


def test_cispo_cap_is_trls_epsilon_high():
    # TRL caps the ratio at epsilon_high itself (5.0); ours at 1 + epsilon_high.
    cfg = GRPOConfig(loss_type="cispo", epsilon_high=5.0)
    assert cfg.algorithm.loss_variant == "cispo" and cfg.algorithm.epsilon_high == 4.0
    with pytest.raises(TRLConfigError, match="epsilon_high > 1"):
        GRPOConfig(loss_type="cispo")


def test_scale_rewards_booleans():
    assert GRPOConfig(scale_rewards=False).algorithm.advantage_scale == "none"
    assert GRPOConfig(scale_rewards="batch").algorithm.advantage_scale == "batch"


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"use_vllm": True, "vllm_mode": "remote"}, "vllm_mode must be"),
        ({"loss_type": "vespo"}, "not implemented"),
        ({"steps_per_generation": 4}, "reuses one generation batch"),
        ({"per_device_train_batch_size": 6}, "divisible by num_generations"),
        ({"top_entropy_quantile": 0.2}, "high-entropy tokens"),
        ({"warmup_ratio": 0.1}, "give warmup_steps"),
        ({"report_to": "mlflow"}, "metrics.jsonl"),
        ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, "clipped losses"),
    ],
)
def test_unsupported_settings_are_refused_with_the_reason(kwargs, reason):
    with pytest.raises(ConfigError, match=reason):
        GRPOConfig(**kwargs)


def test_unknown_names_still_fail_with_a_suggestion():
    with pytest.raises(ConfigError, match="Did you mean"):
        GRPOConfig(per_device_train_batch_size=8, num_generationz=8)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["train", "--resume"], {"--resume": "latest"}),
        (["train", "--resume", "optimizer.lr=2e-5"], {"--resume": "latest", "optimizer.lr": "2e-5"}),
        (["train", "--resume", "runs/x/checkpoint-4"], {"--resume": "runs/x/checkpoint-4"}),
        (["train", "--dynamic-sampling", "beta=0"], {"--dynamic-sampling": "true", "beta": "0"}),
    ],
)
def test_bare_resume_means_latest(argv, expected):
    parser = build_parser()
    args = parser.parse_args(_assignments_first(parser, argv))
    assert dict(_overrides(args)) == expected  # (the flag as typed, its value), in order


def test_chat_template_kwargs_from_the_command_line_and_from_trl():
    assert GRPOConfig(
        **{"data.chat_template_kwargs": "{enable_thinking: false}"}
    ).data.chat_template_kwargs == {"enable_thinking": False}
    assert GRPOConfig(
        chat_template_kwargs={"enable_thinking": False}, max_completion_length=8
    ).data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="expects a mapping"):
        GRPOConfig(**{"data.chat_template_kwargs": "[1, 2]"})
