"""The result line of real (tiny) runs names what the evaluations measured (issue 31): the CLI's and a
Python GRPOTrainer's, with an evaluation before training only, during it only, or none that ran."""

import logging

import pytest
import yaml

from grpo import GRPOConfig, GRPOTrainer, cli
from tests import tiny_run

pytestmark = pytest.mark.slow
RESULT = "; model in "  # the result line a trained run ends with (run/console.py result_line)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("result_line")
    data = tiny_run.write_dataset(root / "data.jsonl", 4)
    return {"model": tiny_run.make_model_dir(root / "model"), "data": data}


def settings(assets, out, **overrides):
    evals = {"eval_dataset": str(assets["data"]), "eval_max_samples": 2, "eval_after": False}
    return tiny_run.config(assets["model"], assets["data"], out, **{"steps": 1, **evals, **overrides})


def result_of(lines: list[str]) -> str:
    (found,) = [x for x in lines if RESULT in x]
    return found


def test_cli_before_only_gives_the_before_number_and_says_nothing_ran_after(assets, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(settings(assets, tmp_path / "run", eval_before=True)))
    assert cli.main(["train", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    line = result_of((captured.out + captured.err).splitlines())
    assert (
        line.startswith("held-out accuracy ")
        and " before training, no evaluation after; mean reward " in line
    )
    assert "no evaluation set" not in line


def test_python_last_evaluation_during_training_and_an_evaluation_set_that_never_ran(
    assets, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="grpo")
    during = settings(assets, tmp_path / "a", steps=3, eval_steps=2)  # step 2 evaluates, step 3 does not
    GRPOTrainer(config=GRPOConfig(**during)).train()
    line = result_of([r.getMessage() for r in caplog.records])
    assert (
        line.startswith("held-out accuracy ")
        and " at the last evaluation during training, none after" in line
    )
    caplog.clear()
    never = settings(assets, tmp_path / "b", steps=1, eval_steps=5)  # an evaluation set, no step reaches 5
    GRPOTrainer(config=GRPOConfig(**never)).train()
    line = result_of([r.getMessage() for r in caplog.records])
    assert line.startswith("mean reward ") and "(no evaluation ran)" in line
