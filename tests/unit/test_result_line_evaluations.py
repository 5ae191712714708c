"""The result line says what the held-out evaluations measured, for every combination of before / during /
after and with or without an evaluation set (issue 31: before-only said "(no evaluation set)")."""

from pathlib import Path

import pytest

from grpo.run.console import final_metric, result_line, sweep_table

B, D, A = {"eval/accuracy_before": 0.25}, {"eval/accuracy_during": 0.5}, {"eval/accuracy_after": 0.625}
REWARD = {"reward": 0.591}


def line(summary: dict, eval_set: bool | None = True) -> str:
    return result_line({**summary, **REWARD}, 0.49, 25, Path("m"), None, eval_set=eval_set).removesuffix(
        " in 25s; model in m"
    )


@pytest.mark.parametrize(
    ("evals", "expected"),
    [
        ((B, A), "held-out accuracy 25.0% → 62.5% (+37.5)"),
        ((B, D, A), "held-out accuracy 25.0% → 62.5% (+37.5)"),
        ((A,), "held-out accuracy 62.5%"),
        ((D, A), "held-out accuracy 62.5%"),
        ((B,), "held-out accuracy 25.0% before training, no evaluation after; mean reward 0.490 → 0.591"),
        (
            (B, D),
            "held-out accuracy 25.0% → 50.0% (+25.0) at the last evaluation during training, none after",
        ),
        ((D,), "held-out accuracy 50.0% at the last evaluation during training, none after"),
        ((), "mean reward 0.490 → 0.591 (no evaluation ran)"),
    ],
)
def test_the_result_line_names_what_was_measured(evals, expected):
    summary = {k: v for e in evals for k, v in e.items()}
    summary["eval/accuracy"] = next(iter(summary.values()), None)  # any last value: not read
    summary = {k: v for k, v in summary.items() if v is not None}
    assert line(summary) == expected


def test_without_an_evaluation_set_the_line_says_so():
    assert line({}, eval_set=False) == "mean reward 0.490 → 0.591 (no evaluation set)"
    assert line({}, eval_set=None) == "mean reward 0.490 → 0.591 (no evaluation set)"
    no_steps = result_line(B, None, 3, Path("m"), None, eval_set=True)
    assert (
        no_steps
        == "held-out accuracy 25.0% before training, no evaluation after; no steps run in 3s; model in m"
    )


def test_a_sweep_never_compares_runs_by_the_accuracy_before_training():
    assert final_metric({**B, "eval/accuracy": 0.25, **REWARD}) == ("final reward", 0.591)
    assert final_metric({**B, **D, "eval/accuracy": 0.5, **REWARD}) == ("held-out accuracy", 0.5)
    assert final_metric({**B, **D, **A, "eval/accuracy": 0.625}) == ("held-out accuracy", 0.625)
    runs = [({"lr": "1"}, {**B, **REWARD}, Path("a")), ({"lr": "2"}, {**B, "reward": 0.25}, Path("b"))]
    assert sweep_table(runs).splitlines()[:2] == ["lr  final reward  run dir", "1   0.591         a"]
