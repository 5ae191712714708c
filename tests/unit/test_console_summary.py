"""The lines a run and a sweep end with (run/console.py), with the numbers written out."""

from pathlib import Path

from grpo.run.console import duration, result_line, sweep_table


def test_durations_read_as_a_person_writes_them():
    assert [duration(s) for s in (0.4, 45, 59.6, 134, 3599, 3780)] == [
        "0s",
        "45s",
        "1m00s",
        "2m14s",
        "59m59s",
        "1h03m",
    ]


def test_the_result_line_gives_accuracy_before_and_after_time_model_and_report():
    summary = {"eval/accuracy_before": 0.396, "eval/accuracy_after": 0.756, "eval/accuracy": 0.756}
    line = result_line(summary, 0.41, 134.2, Path("runs/x/final_model"), Path("runs/x/report/index.html"))
    assert line == (
        "held-out accuracy 39.6% → 75.6% (+36.0) in 2m14s; model in runs/x/final_model; "
        "report runs/x/report/index.html"
    )


def test_without_an_evaluation_the_result_line_gives_the_reward_it_started_and_ended_with():
    line = result_line({"reward": 0.5914}, 0.4902, 25, Path("o/final_model"), None)
    assert line == "mean reward 0.490 → 0.591 (no evaluation set) in 25s; model in o/final_model"
    only_after = result_line({"eval/accuracy_after": 0.5}, None, 61, Path("m"), None)
    assert only_after == "held-out accuracy 50.0% in 1m01s; model in m"


def test_a_sweep_table_lists_the_swept_values_the_final_metric_and_each_run_dir():
    runs = [
        ({"optimizer.lr": "1e-4", "train.steps": "40"}, {"eval/accuracy_after": 0.756}, Path("multirun/s/0")),
        ({"optimizer.lr": "3e-5", "train.steps": "40"}, {"eval/accuracy_after": 0.612}, Path("multirun/s/1")),
    ]
    assert sweep_table(runs).splitlines() == [
        "optimizer.lr  held-out accuracy  run dir",
        "1e-4          75.6%              multirun/s/0",
        "3e-5          61.2%              multirun/s/1",
    ]


def test_a_sweep_without_evaluation_compares_the_final_reward():
    runs = [
        ({"lr": "1", "beta": "0"}, {"reward": 0.25}, Path("a")),
        ({"lr": "2", "beta": "0.1"}, {"reward": 0.5}, Path("b")),
    ]
    assert sweep_table(runs).splitlines() == [
        "lr  beta  final reward  run dir",
        "1   0     0.250         a",
        "2   0.1   0.500         b",
    ]
