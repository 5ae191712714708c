"""Every command line of the five seeds, run as written: `python …/grpo_demo.py`, `python grpo.py` and
`python grpo/train_grpo.py` become `grpo train`, hub names become local paths. Each test asserts that
every value took effect in the resolved config (`--dry-run` / `--print-config`, which load no model)
or that the refusal names the alternative. The few that must train (Quick Start, profiler, the Ray
head of docs/scaling.md) use a 1-layer random model."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from grpo.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOKEN = "hf_SeedCommandTestToken1234567890"
N_ROWS = 64
TINY_MATH_ROWS = 12000


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.tiny_run import make_model_dir

    d = tmp_path_factory.mktemp("seeds")
    rows = [
        {"question": f"Sam has {i} apples and buys 2 more. How many now?", "answer": f"#### {i + 2}"}
        for i in range(N_ROWS)
    ]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["question"]}) + "\n" for r in rows))
    shutil.copy(FIXTURES / "ifeval_sample.jsonl", d / "ifeval.jsonl")
    import datasets

    hub = d / "custom_dataset"  # a dataset folder in the hub's layout
    (hub / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows[:40]).to_parquet(str(hub / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[40:]).to_parquet(str(hub / "data" / "test-00000-of-00001.parquet"))
    (d / "custom_config.yml").write_text("train:\n  steps: 7\noptim:\n  learning_rate: 3.0e-6\n")
    make_model_dir(d / "model")
    return d


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def run(argv: list[str], capsys, mode: str = "--dry-run") -> dict:
    """`grpo train ARGV --dry-run`: the resolved config (+ plan) as a dict; fails on a refusal."""
    rc = main(["train", *map(str, argv), mode])
    out, err = capsys.readouterr()
    assert rc == 0, err
    docs = [d for d in yaml.safe_load_all(out) if d]
    return docs[0] if len(docs) == 1 else docs


def refused(argv: list[str], capsys, mode: str = "--dry-run") -> str:
    rc = main(["train", *map(str, argv), mode])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    return err


def get(cfg: dict, path: str):
    section, name = path.split(".")
    return cfg[section][name]


# -- MaxText / Tunix demo (grpo_demo.py), every flag in its three spellings -----------------------------


def spellings(flag: str, value: str | None) -> list[list[str]]:
    """MaxText's `--flag_name=value`, our `--flag-name value`, and Hydra's `flag_name=value`."""
    if value is None:  # a switch
        return [[f"--{flag}"], [f"--{flag.replace('_', '-')}"], [f"{flag}=true"]]
    return [[f"--{flag}={value}"], [f"--{flag.replace('_', '-')}", value], [f"{flag}={value}"]]


ACCEPTED = [  # (flag, value, extra args, {path: value}) — {model}, {hub}, {out} are filled in
    ("model_name", "llama3.1-8b", [], {"model.name_or_path": "llama3.1-8b"}),
    ("tokenizer_path", "{model}", [], {"model.tokenizer_path": "{model}"}),
    ("load_parameters_path", "{model}", [], {"model.load_parameters_path": "{model}"}),
    ("base_output_directory", "{out}", [], {"train.base_output_directory": "{out}"}),
    ("hf_access_token", TOKEN, [], {"model.hf_token": "<redacted>"}),
    ("hf_path", "{hub}", [], {"data.hf_path": "{hub}", "plan.train_rows": 40}),
    ("hf_data_split", "test", ["--hf_path={hub}"], {"data.hf_data_split": "test", "plan.train_rows": 24}),
    (
        "hf_data_files",
        "data/train-*.parquet",
        ["--hf_path={hub}"],
        {"data.hf_data_files": "data/train-*.parquet", "plan.train_rows": 40},
    ),
    ("steps", "100", [], {"train.steps": 100, "plan.steps": 100}),
    ("per_device_batch_size", "2", [], {"train.prompts_per_step": 2}),
    ("learning_rate", "3e-6", [], {"optim.learning_rate": 3e-6}),
    ("run_name", "my_run", [], {"train.run_name": "my_run"}),
    ("num_generations", "2", [], {"generation.num_generations": 2}),
    ("grpo_beta", "0.08", [], {"algorithm.beta": 0.08}),
    ("grpo_epsilon", "0.15", [], {"algorithm.epsilon_low": 0.15, "algorithm.epsilon_high": 0.15}),
    ("max_prefill_predict_length", "64", [], {"data.max_prompt_length": 64}),
    ("max_target_length", "176", [], {"generation.max_total_length": 176}),
    ("inference_devices_per_replica", "1", [], {"distributed.inference_devices_per_replica": 1}),
    ("inference_replicas", "1", [], {"distributed.inference_replicas": 1}),
    ("ici_fsdp_parallelism", "-1", [], {"distributed.ici_fsdp_parallelism": -1}),
    ("ici_tensor_parallelism", "-1", [], {"distributed.ici_tensor_parallelism": -1}),
    ("profiler", "torch", [], {"distributed.profiler": "torch"}),
    ("checkpoint_period", "50", [], {"train.save_steps": 50}),
    ("config_file", "{files}/custom_config.yml", [], {"train.steps": 7, "optim.learning_rate": 3e-6}),
    ("inference_rollouts", "5", ["--steps=10"], {"distributed.weight_sync_steps": 5}),
    (
        "trainer_devices_fraction",
        "0.5",
        ["sampler_devices_fraction=0.5", "rollout.mode=sync"],
        {"distributed.trainer_devices_fraction": 0.5, "distributed.sampler_devices_fraction": 0.5},
    ),
    ("trainer_devices_fraction", "1.0", [], {"distributed.trainer_devices_fraction": 1.0}),
]

REFUSED = [  # (flag, value, extra args, what the message must name)
    ("use_pathways", None, [], "rollout.mode=sync"),
    ("inference_devices_per_replica", "4", [], "inference_replicas=N"),
    ("inference_replicas", "4", [], "rollout.mode=sync"),
    ("ici_fsdp_parallelism", "16", [], "torchrun --nproc_per_node 16"),
    ("ici_tensor_parallelism", "4", [], "inference_replicas=N"),
    ("trainer_devices_fraction", "0.5", [], "add up to at most 1"),
    ("profiler", "xplane", [], "profiler=torch"),
    ("load_parameters_path", "gs://path/to/checkpoint", [], "not supported; copy the checkpoint locally"),
    ("base_output_directory", "gs://path/to/output", [], "cloud storage paths are not supported"),
    ("inference_rollouts", "20", ["--steps=10"], "between 1 and 10"),
    ("hf_data_files", "train", ["--hf_path={files}/train.jsonl"], "Drop --hf_data_files"),
]


def fill(text: str, files: Path, tmp: Path) -> str:
    return text.format(
        model=files / "model", hub=files / "custom_dataset", out=tmp / "grpo_output", files=files
    )


def small(files: Path) -> list[str]:
    """The spelling tests read a 64-row file instead of the bundled 12,000 rows (the flag is the subject)."""
    return ["--dataset", str(files / "train.jsonl"), "--eval-dataset", "none"]


@pytest.mark.parametrize("spelling", range(3), ids=["underscore", "hyphen", "key=value"])
@pytest.mark.parametrize("flag,value,extra,expected", ACCEPTED, ids=[f"{a[0]}={a[1]}" for a in ACCEPTED])
def test_maxtext_flag_takes_effect(flag, value, extra, expected, spelling, files, tmp_path, capsys):
    argv = [
        *small(files),
        *[fill(x, files, tmp_path) for x in extra],
        *spellings(flag, fill(value, files, tmp_path))[spelling],
    ]
    resolved = run(argv, capsys)
    for path, want in expected.items():
        want = fill(want, files, tmp_path) if isinstance(want, str) else want
        assert get(resolved, path) == want, (path, argv)


@pytest.mark.parametrize("spelling", range(3), ids=["underscore", "hyphen", "key=value"])
@pytest.mark.parametrize("flag,value,extra,needle", REFUSED, ids=[f"{r[0]}={r[1]}" for r in REFUSED])
def test_maxtext_flag_refused_with_advice(flag, value, extra, needle, spelling, files, tmp_path, capsys):
    argv = [*small(files), *[fill(x, files, tmp_path) for x in extra], *spellings(flag, value)[spelling]]
    assert needle in refused(argv, capsys)


MAXTEXT_8B = [
    "--model_name=llama3.1-8b",
    "--tokenizer_path=meta-llama/Llama-3.1-8B-Instruct",
    "--load_parameters_path=gs://path/to/checkpoint",
    "--base_output_directory=/tmp/grpo_output",
    f"--hf_access_token={TOKEN}",
]


def local(argv: list[str], files: Path) -> list[str]:
    """The seed's hub model and gs:// checkpoint replaced by the local model directory."""
    swap = {
        "meta-llama/Llama-3.1-8B-Instruct": files / "model",
        "meta-llama/Llama-3.1-70B-Instruct": files / "model",
        "gs://path/to/checkpoint": files / "model",
    }
    out = []
    for word in argv:
        key, sep, value = word.partition("=")
        out.append(f"{key}={swap.get(value, value)}" if sep and value in swap else word)
    return out


def test_maxtext_single_host_example(files, capsys):
    argv = [*MAXTEXT_8B, "--steps=100"]
    assert "cloud storage paths are not supported; copy the checkpoint locally" in refused(argv, capsys)
    cfg = run(local(argv, files), capsys)
    assert cfg["model"]["name_or_path"] == "llama3.1-8b"
    assert cfg["model"]["tokenizer_path"] == cfg["model"]["load_parameters_path"] == str(files / "model")
    assert (
        cfg["train"]["base_output_directory"] == "/tmp/grpo_output"
        and cfg["model"]["hf_token"] == "<redacted>"
    )
    assert cfg["train"]["steps"] == cfg["plan"]["steps"] == 100


def test_maxtext_pathways_70b_example(files, capsys):
    argv = [
        "--model_name=llama3.1-70b",
        "--tokenizer_path=meta-llama/Llama-3.1-70B-Instruct",
        "--load_parameters_path=gs://path/to/checkpoint",
        "--base_output_directory=gs://path/to/output",
        f"--hf_access_token={TOKEN}",
        "--use_pathways",
        "--inference_devices_per_replica=4",
        "--inference_replicas=4",
        "--ici_fsdp_parallelism=16",
        "--steps=100",
    ]
    err = refused(argv, capsys)
    assert "--use_pathways" in err and "rollout.mode=sync" in err and "inference_replicas=N" in err


def test_maxtext_custom_dataset_example(files, capsys):
    argv = [
        *local(MAXTEXT_8B, files),
        f"--hf_path={files / 'custom_dataset'}",
        "--hf_data_split=train",
        "--steps=100",
    ]
    cfg = run(argv, capsys)
    assert cfg["data"]["hf_path"] == str(files / "custom_dataset") and cfg["data"]["hf_data_split"] == "train"
    assert cfg["plan"]["rewards"] == ["gsm8k_correctness", "gsm8k_format"]
    # 40 rows: 4 held out to evaluate on (the preset's tiny_math:test is not this data), 36 to train on
    assert (cfg["plan"]["train_rows"], cfg["plan"]["eval_rows"], cfg["data"]["eval_dataset"]) == (
        36,
        4,
        "holdout",
    )


def test_maxtext_custom_grpo_parameters_example(files, capsys):
    argv = [
        *local(MAXTEXT_8B, files),
        "--num_generations=4",
        "--grpo_beta=0.04",
        "--grpo_epsilon=0.15",
        "--learning_rate=5e-6",
        "--steps=200",
    ]
    cfg = run(argv, capsys)
    assert cfg["generation"]["num_generations"] == 4 and cfg["algorithm"]["beta"] == 0.04
    assert cfg["algorithm"]["epsilon_low"] == cfg["algorithm"]["epsilon_high"] == 0.15
    assert cfg["optim"]["learning_rate"] == 5e-6 and cfg["plan"]["steps"] == 200


def test_maxtext_custom_config_file_example(files, capsys):
    cfg = run([f"--config_file={files / 'custom_config.yml'}", "--model_name=llama3.1-8b"], capsys)
    assert cfg["train"]["steps"] == 7 and cfg["optim"]["learning_rate"] == 3e-6
    assert cfg["model"]["name_or_path"] == "llama3.1-8b"


def test_pathways_tutorial_device_fractions(capsys):
    shared = run(["trainer_devices_fraction=1.0", "sampler_devices_fraction=1.0"], capsys)
    assert shared["distributed"]["rollout_mode"] == "colocated"
    assert "rollout.mode=sync" in refused(
        ["trainer_devices_fraction=0.5", "sampler_devices_fraction=0.5"], capsys
    )


# -- plain-PyTorch seed (grpo/train_grpo.py) ---------------------------------------------------------

PYTORCH_FLAGS = [  # (flag, value, {path: value})
    ("model-name", "{model}", {"model.name_or_path": "{model}"}),
    ("batch-size", "4", {"train.prompts_per_step": 4}),
    (
        "num-epochs",
        "3",
        {"train.num_epochs": 3.0, "train.steps": None, "plan.steps": 3 * math.ceil(N_ROWS / 16)},
    ),
    ("learning-rate", "1e-6", {"optim.learning_rate": 1e-6}),
    ("num-generations", "4", {"generation.num_generations": 4}),
    ("max-new-tokens", "64", {"generation.max_new_tokens": 64}),
    ("kl-coef", "0.1", {"algorithm.beta": 0.1}),
    ("clip-range", "0.3", {"algorithm.epsilon_low": 0.3, "algorithm.epsilon_high": 0.3}),
    ("temperature", "0.7", {"generation.temperature": 0.7}),
    (
        "gradient-accumulation-steps",
        "8",
        {"train.gradient_accumulation_steps": 8, "plan.micro_batch_size": 16},
    ),
    ("max-grad-norm", "0.5", {"optim.max_grad_norm": 0.5}),
    ("warmup-steps", "100", {"optim.warmup_steps": 100}),
    ("output-dir", "./my_grpo_model", {"train.output_dir": "./my_grpo_model"}),
    ("logging-steps", "5", {"train.logging_steps": 5}),
    ("save-steps", "500", {"train.save_steps": 500}),
    ("wandb-project", "my-project", {"train.wandb_project": "my-project"}),
    ("wandb-run-name", "grpo-experiment-1", {"train.wandb_run_name": "grpo-experiment-1"}),
    ("device", "cpu", {"model.device": "cpu"}),
]


def pytorch_spellings(flag: str, value: str) -> list[list[str]]:
    underscore = flag.replace("-", "_")
    return [[f"--{flag}", value], [f"--{underscore}={value}"], [f"{underscore}={value}"]]


def test_every_pytorch_flag_has_a_spelling_test():
    listed = {
        "model-name",
        "batch-size",
        "num-epochs",
        "learning-rate",
        "num-generations",
        "max-new-tokens",
        "kl-coef",
        "clip-range",
        "temperature",
        "gradient-accumulation-steps",
        "max-grad-norm",
        "warmup-steps",
        "output-dir",
        "logging-steps",
        "save-steps",
        "use-wandb",
        "wandb-project",
        "wandb-run-name",
        "device",
    }
    assert listed - {f for f, _, _ in PYTORCH_FLAGS} == {"use-wandb"}  # tested on its own below


@pytest.mark.parametrize("spelling", range(3), ids=["hyphen", "underscore", "key=value"])
@pytest.mark.parametrize("flag,value,expected", PYTORCH_FLAGS, ids=[f[0] for f in PYTORCH_FLAGS])
def test_pytorch_flag_takes_effect(flag, value, expected, spelling, files, tmp_path, capsys):
    resolved = run([*small(files), *pytorch_spellings(flag, fill(value, files, tmp_path))[spelling]], capsys)
    for path, want in expected.items():
        want = fill(want, files, tmp_path) if isinstance(want, str) else want
        assert get(resolved, path) == want, path


def test_pytorch_defaults_run_the_tiny_math_preset(capsys):
    cfg = run([], capsys)
    assert cfg["plan"]["steps"] == cfg["train"]["steps"] == 80 and cfg["plan"]["train_rows"] == TINY_MATH_ROWS


def test_pytorch_custom_configuration_example(files, capsys):
    argv = [
        "--model-name",
        files / "model",
        "--batch-size",
        "4",
        "--num-epochs",
        "3",
        "--learning-rate",
        "1e-6",
        "--num-generations",
        "4",
        "--output-dir",
        "./my_grpo_model",
    ]
    cfg = run(argv, capsys)
    assert (
        cfg["model"]["name_or_path"] == str(files / "model")
        and cfg["train"]["output_dir"] == "./my_grpo_model"
    )
    assert (cfg["train"]["prompts_per_step"], cfg["generation"]["num_generations"]) == (4, 4)
    assert cfg["optim"]["learning_rate"] == 1e-6
    # the user's epochs replace the preset's train.steps: 3 passes over 12000 prompts, 4 per step
    assert cfg["train"]["steps"] is None and cfg["plan"]["steps"] == 3 * TINY_MATH_ROWS // 4


def test_num_epochs_wins_over_the_preset_steps(files, capsys):
    argv = [
        "--batch-size",
        "4",
        "--num-epochs",
        "3",
        "--num-generations",
        "4",
        "--dataset",
        files / "train.jsonl",
    ]
    # 64 rows less the 6 held out for evaluation (the preset's tiny_math:test is not this file's), 4 per step
    # × 3 epochs: 3 × ceil(58 / 4) = 45, not the preset's 80
    plan = run(argv, capsys)["plan"]
    assert (plan["train_rows"], plan["eval_rows"], plan["steps"]) == (58, 6, 45)
    both = run([*argv, "--steps", "5"], capsys)  # both given: steps win (and the log names the conflict)
    assert both["plan"]["steps"] == 5


@pytest.mark.skipif(__import__("importlib").util.find_spec("wandb") is not None, reason="wandb is installed")
@pytest.mark.parametrize("mode", ["--dry-run", "--print-config"])
def test_pytorch_wandb_example_without_wandb_stops_at_start_up(mode, capsys):
    argv = ["--use-wandb", "--wandb-project", "my-project", "--wandb-run-name", "grpo-experiment-1"]
    assert "pip install 'grpo[wandb]'" in refused(argv, capsys, mode)


def test_rewards_given_drop_the_preset_weights(files, capsys):
    cfg = run([*small(files), "--reward-funcs", "gsm8k_format"], capsys)  # the preset weighs two rewards
    assert cfg["algorithm"]["reward_weights"] is None and cfg["plan"]["rewards"] == ["gsm8k_format"]
    assert "did you mean 'gsm8k_correctness'" in refused(
        [*small(files), "--reward-funcs", "gsm8k_corect"], capsys
    )


def test_prompts_without_answers_are_refused_before_a_model_loads(files, capsys):
    err = refused(["--dataset", files / "prompts.jsonl"], capsys)
    assert "no 'answer' column" in err and "gsm8k_correctness" in err and "reward_model" in err


# -- TorchRL (grpo.py) -------------------------------------------------------------------------------


def test_torchrl_device_counts_name_torchrun(capsys):
    err = refused(
        ["train_model.num_devices=2", "ref_model.num_devices=2", "inference_model.num_devices=2"], capsys
    )
    assert "torchrun --nproc_per_node 2" in err


def test_torchrl_device_lists_name_torchrun(capsys):
    err = refused(
        ["train_model.devices=[0,1]", "ref_model.devices=[2,3]", "inference_model.devices=[4,5]"], capsys
    )
    assert "torchrun --nproc_per_node 2" in err


def test_torchrl_ifeval_config_name(capsys):
    cfg = run(["--config-name", "grpo_ifeval"], capsys, "--print-config")
    assert cfg["data"]["dataset"] == "ifeval" and cfg["algorithm"]["reward_funcs"] == ["torchrl_ifeval"]


def test_torchrl_dataset_switch_brings_rewards_and_evaluation(capsys):
    cfg = run(["env.dataset=ifeval"], capsys, "--print-config")
    assert cfg["data"]["dataset"] == "ifeval" and cfg["algorithm"]["reward_funcs"] == ["torchrl_ifeval"]
    assert cfg["algorithm"]["reward_weights"] is None and cfg["data"]["eval_dataset"] == "ifeval"
    assert "<answer>" in cfg["data"]["system_prompt"]
    mine = run(["env.dataset=ifeval", "reward_funcs=ifeval_strict"], capsys, "--print-config")
    assert mine["algorithm"]["reward_funcs"] == ["ifeval_strict"]  # a reward the user chose stays


def test_torchrl_dataset_switch_to_a_local_ifeval_file(files, capsys):
    cfg = run([f"env.dataset={files / 'ifeval.jsonl'}"], capsys)
    assert cfg["plan"]["rewards"] == ["torchrl_ifeval"]
    # evaluated on a held-out row of the file (scored as IFEval), trained on the other three
    assert (cfg["plan"]["train_rows"], cfg["plan"]["eval_rows"]) == (3, 1)


def test_torchrl_dataset_without_answers_names_column_and_reward(files, capsys):
    err = refused([f"env.dataset={files / 'prompts.jsonl'}"], capsys)
    assert "'answer'" in err and "gsm8k_correctness" in err


def test_torchrl_training_parameters(capsys):
    cfg = run(["optimizer.lr=2e-5", "optimizer.weight_decay=0.01"], capsys)
    assert cfg["optim"]["learning_rate"] == 2e-5 and cfg["optim"]["weight_decay"] == 0.01


def test_torchrl_change_model(files, capsys):
    assert run([f"model.name={files / 'model'}"], capsys)["model"]["name_or_path"] == str(files / "model")


def test_torchrl_learning_rate_sweep(capsys):
    runs = run(["--multirun", "optimizer.lr=1e-4,1e-5,1e-6"], capsys, "--print-config")
    assert [r["optim"]["learning_rate"] for r in runs] == [1e-4, 1e-5, 1e-6]
    assert len({Path(r["train"]["output_dir"]).parent for r in runs}) == 1
    assert [Path(r["train"]["output_dir"]).name for r in runs] == ["0", "1", "2"]
    assert all(r["train"]["output_dir"].startswith("multirun") for r in runs)


def test_torchrl_two_parameter_sweep_uses_the_run_name(capsys):
    runs = run(
        ["--multirun", "optimizer.lr=1e-4,1e-5", "policy.kl_coef=0.01,0.1", "--run-name", "sweep1"],
        capsys,
        "--print-config",
    )
    assert [(r["optim"]["learning_rate"], r["algorithm"]["beta"]) for r in runs] == [
        (1e-4, 0.01),
        (1e-4, 0.1),
        (1e-5, 0.01),
        (1e-5, 0.1),
    ]
    assert [r["train"]["output_dir"] for r in runs] == [
        str(Path("multirun", "sweep1", str(i))) for i in range(4)
    ]


def test_torchrl_other_settings(capsys):
    cfg = run(
        [
            "mode=async",
            "train.checkpoint_frequency=25",
            "env.num_envs=8",
            "env.repeats=4",
            "train.optim_batch_size=2",
        ],
        capsys,
    )
    assert cfg["distributed"]["rollout_mode"] == "async" and cfg["train"]["save_steps"] == 25
    assert (cfg["train"]["prompts_per_step"], cfg["generation"]["num_generations"]) == (8, 4)
    assert cfg["train"]["micro_batch_size"] == cfg["plan"]["micro_batch_size"] == 2


@pytest.mark.parametrize("assignment,needle", [("train.total_dialog_turns=1000", "train.steps")])
def test_torchrl_settings_without_counterpart_are_refused_with_advice(assignment, needle, capsys):
    assert needle in refused([assignment], capsys)


# -- help ---------------------------------------------------------------------------------------------


def test_help_shows_the_effective_default_and_its_source():
    text = subprocess.run(
        [sys.executable, "-m", "grpo", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "400"},
    ).stdout
    lr = next(line for line in text.splitlines() if "Peak AdamW learning rate" in line)
    assert "default: 0.0001 from the tiny_math preset" in lr and "1e-06" in lr
    assert "(default: None)" not in text and text.count("(default:") == text.count("(default: ")


# -- runs that train: Quick Start, profiler, ESS, header lines -------------------------------------------

QUICK = {
    "max_new_tokens": 8,
    "num_threads": 1,
    "progress_bar": False,
    "report": False,
    "tensorboard": False,
    "eval_dataset": None,
}


@pytest.mark.slow
def test_quick_start_as_written(files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer, SimplePromptDataset

    model_name = str(files / "model")  # in place of "Qwen/Qwen2.5-1.5B-Instruct"
    model = AutoModelForCausalLM.from_pretrained(model_name)
    ref_model = AutoModelForCausalLM.from_pretrained(model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    prompts = ["Your prompt 1", "Your prompt 2", "..."]
    dataset = SimplePromptDataset(prompts)
    config = GRPOConfig(
        batch_size=4,
        num_epochs=3,
        learning_rate=1e-6,
        num_generations_per_prompt=4,
        output_dir=str(tmp_path / "grpo_output"),
        **QUICK,
    )
    trainer = GRPOTrainer(
        model=model,
        ref_model=ref_model,
        reward_model=model,
        tokenizer=tokenizer,
        config=config,
        train_dataset=dataset,
    )
    trainer.train()
    out = tmp_path / "grpo_output"
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["name_or_path"] == model_name  # where the passed-in model came from
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3  # 3 prompts, 4 per step: one step per epoch
    assert (out / "final_model" / "model.safetensors").is_file()


def test_quick_start_without_answers_or_reward_model_stops_before_loading(files, tmp_path, monkeypatch):
    import grpo.run.assemble
    from grpo import GRPOConfig, GRPOTrainer, SimplePromptDataset
    from grpo.config import ConfigError

    monkeypatch.setattr(grpo.run.assemble, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    config = GRPOConfig(batch_size=4, num_epochs=3, output_dir=str(tmp_path / "o"), **QUICK)
    with pytest.raises(ConfigError, match=r"no 'answer' column.*gsm8k_correctness") as e:
        GRPOTrainer(model=str(files / "model"), config=config, train_dataset=SimplePromptDataset(["a", "b"]))
    assert "SimplePromptDataset(prompts, answer=[...])" in str(e.value) and "reward_model=" in str(e.value)


@pytest.mark.slow
def test_torch_profiler_trace_and_ess_in_colocated_mode(files, tmp_path):
    from grpo import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(
        **{
            **QUICK,
            "model": str(files / "model"),
            "dataset": str(files / "train.jsonl"),
            "batch_size": 2,
            "num_generations": 2,
            "gradient_accumulation_steps": 1,
            "steps": 3,
            "logging_steps": 1,
            "save_steps": 0,
            "profiler": "torch",
            "output_dir": str(tmp_path / "r"),
        }
    )
    GRPOTrainer(config=cfg).train()
    traces = list((tmp_path / "r" / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    metrics = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(0 < m["is/ess"] <= 1.0 + 1e-9 for m in metrics)


# -- docs/scaling.md: TorchRL's device counts as torchrun learners + a Ray head (token auth) -------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_ray_started_under(root: Path, port: int) -> None:
    """Stop the head this test started, by pid (`ray stop` would stop every Ray on the machine): processes
    whose command line names its temp dir or its GCS port, and their children (Ray's agents)."""
    parents, mine = {}, set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if any(str(root) in a or (a.startswith("--address=") and a.endswith(f":{port}")) for a in args):
            mine.add(int(proc.name))
    mine |= {pid for pid, parent in parents.items() if parent in mine}
    for pid in mine:
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_scaling_doc_torchrl_translation_with_a_ray_head(files, tmp_path):
    pytest.importorskip("ray")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "ray").exists() or not (bin_dir / "torchrun").exists():
        pytest.skip("ray / torchrun scripts not installed next to the interpreter")
    root = Path(
        tempfile.mkdtemp(prefix="grpo-ray-", dir="/tmp")
    )  # short: Ray's socket paths must fit 107 bytes
    (root / "home").mkdir()
    # Isolated from other Ray clusters on the machine: its own temp dir (where `ray start` records the
    # address that ray_address=auto reads) and HOME (where the head writes its ~/.ray/auth_token).
    env = {
        **os.environ,
        "TMPDIR": str(root),
        "HOME": str(root / "home"),
        "RAY_worker_niceness": "0",
        "RAY_AUTH_MODE": "token",  # Ray's documented switch; set on the head and every learner
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2] / "src"), str(Path(__file__).resolve().parents[2])]
        ),
    }
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    head = [
        str(bin_dir / "ray"),
        "start",
        "--head",
        "--num-cpus",
        "2",
        "--port",
        str(port),
        "--ray-client-server-port",
        str(_free_port()),
        "--dashboard-port",
        str(_free_port()),
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    try:
        # Ray's token-auth guide: generate the token, then start the head (2.60 turns auth on when one
        # exists).
        subprocess.run(
            [str(bin_dir / "ray"), "get-auth-token", "--generate"],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        started = subprocess.run(head, env=env, check=False, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        # Whether `ray start` says so varies between Ray builds; the refused learner below proves auth is on.
        # docs/scaling.md: torchrun --nproc_per_node 2 -m grpo train mode=async train_model.num_devices=2
        #   ref_model.num_devices=2 inference_model.num_devices=2  (+ a tiny model and a short run)
        cmd = [
            str(bin_dir / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "grpo",
            "train",
            "mode=async",
            "train_model.num_devices=2",
            "ref_model.num_devices=2",
            "inference_model.num_devices=2",
            f"model={files / 'model'}",
            f"dataset={files / 'train.jsonl'}",
            "steps=2",
            "batch_size=2",
            "num_generations=2",
            "max_new_tokens=6",
            "gradient_accumulation_steps=1",
            "eval_dataset=none",
            "progress_bar=false",
            "report=false",
            "tensorboard=false",
            "num_threads=1",
            "logging_steps=1",
            f"output_dir={tmp_path / 'run'}",
        ]
        done = subprocess.run(
            cmd, check=False, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stderr.count("Run directory:") == 1  # header lines from rank 0 only
        metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2] and all("is/ess" in m for m in metrics)
        # A learner without the head's token is told how to pass it (not a bare ConnectionError).
        wrong = subprocess.run(
            [
                sys.executable,
                "-m",
                "grpo",
                "train",
                "mode=async",
                "ray_address=auto",
                *cmd[cmd.index("train") + 5 : -1],
                f"output_dir={tmp_path / 'run2'}",
            ],
            # Ray retries a refused connection ~20 times (RAY_NUM_REDIS_GET_RETRIES, 21 s measured) before
            # it raises; 2 tries reach the same ConnectionError, and the same message from grpo, in 3 s.
            env={**env, "RAY_AUTH_TOKEN": "not-the-head-token", "RAY_NUM_REDIS_GET_RETRIES": "2"},
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert wrong.returncode == 2 and "RAY_AUTH_TOKEN=$(ray get-auth-token)" in wrong.stderr, wrong.stderr[
            -3000:
        ]
    finally:
        _kill_ray_started_under(root, port)
        time.sleep(1)
        shutil.rmtree(root, ignore_errors=True)
