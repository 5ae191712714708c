"""What a new user meets at the command line: a mistyped --flag gets a suggestion, --resume continues the run
that stopped (its own config.yaml), a start that fails leaves no empty run directory, and the thread count
follows OMP_NUM_THREADS unless train.num_threads is given."""

import pytest

from grpo.cli import _config_source, main
from grpo.config import GRPOConfig, load_config
from grpo.run.assemble import cpu_threads


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_mistyped_flag_gets_did_you_mean_like_a_mistyped_key(capsys):
    assert error_of(["train", "--stpes", "3", "--learning_rat=1e-4"], capsys) == (
        "grpo: error: unrecognized arguments: --stpes --learning_rat=1e-4. --stpes: did you mean --steps "
        "or --dtype? --learning_rat: did you mean --learning-rate?"
    )
    assert error_of(["eval", "--limt", "3"], capsys).endswith("--limt: did you mean --limit?")
    assert error_of(["train", "--zzzqqq"], capsys).endswith(
        "unrecognized arguments: --zzzqqq. `grpo train --help` lists every flag."
    )


def saved_run(tmp_path, **settings):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config("tiny_math", {"output_dir": str(run_dir), "hf_token": "hf_secretsecret", **settings})
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return run_dir


def test_resume_with_an_output_dir_takes_that_runs_own_config(tmp_path):
    run_dir = saved_run(tmp_path, steps=40, learning_rate=3e-4)
    overrides = {"train.resume": "latest", "output_dir": str(run_dir)}
    source = _config_source(None, overrides)
    assert source == str(run_dir / "config.yaml")
    cfg = load_config(source, overrides)
    assert (cfg.train.steps, cfg.optim.learning_rate) == (40, 3e-4)  # not the preset's 80 and 1e-4
    assert cfg.model.hf_token is None  # the saved `<redacted>` is not taken for a token
    longer = load_config(source, {**overrides, "steps": 60})  # overrides still apply on top
    assert longer.train.steps == 60


def test_without_resume_or_a_run_directory_the_preset_stays_the_default(tmp_path):
    run_dir = saved_run(tmp_path, steps=40)
    assert _config_source(None, {"output_dir": str(run_dir)}) == "tiny_math"
    assert _config_source(None, {"resume": "latest"}) == "tiny_math"
    assert _config_source(None, {"resume": "latest", "output_dir": str(tmp_path / "new")}) == "tiny_math"
    assert _config_source("gsm8k", {"resume": "latest", "output_dir": str(run_dir)}) == "gsm8k"


def test_a_failed_start_leaves_no_empty_run_directory(tmp_path, capsys):
    code = main(
        [
            "train",
            "--dataset",
            str(tmp_path / "nope.jsonl"),
            "--base-output-directory",
            str(tmp_path / "runs"),
        ]
    )
    assert code == 2 and "nope.jsonl does not exist" in capsys.readouterr().err
    assert list((tmp_path / "runs").iterdir()) == []
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(["train", "--dataset", str(tmp_path / "nope.jsonl"), "--output-dir", str(kept)]) == 2
    assert {p.name for p in kept.iterdir()} == {"notes.txt", "run.lock", "train.log"}  # not made by it: kept


def test_threads_follow_the_environment_unless_the_user_set_them():
    preset = load_config("tiny_math")  # train.num_threads: 2, from the preset
    assert cpu_threads(preset, {}) == (
        2,
        "train.num_threads from the config; OMP_NUM_THREADS or train.num_threads=N changes it",
    )
    assert cpu_threads(preset, {"OMP_NUM_THREADS": "1"}) == (
        1,
        "OMP_NUM_THREADS=1; the preset's train.num_threads = 2 is not used",
    )
    assert cpu_threads(preset, {"MKL_NUM_THREADS": "3"})[0] == 3
    assert cpu_threads(preset, {"OMP_NUM_THREADS": "zero"})[0] == 2  # not a count: ignored
    given = load_config("tiny_math", {"num_threads": 4})
    assert cpu_threads(given, {"OMP_NUM_THREADS": "1"}) == (4, "train.num_threads")
    assert cpu_threads(GRPOConfig(), {}) == (
        None,
        "train.num_threads from the config; OMP_NUM_THREADS or train.num_threads=N changes it",
    )
