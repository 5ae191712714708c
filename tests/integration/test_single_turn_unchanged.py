"""Refactors left training bitwise as it was, compared on this host (tests/reference.py says why not with
numbers recorded elsewhere): the same run at a reference commit and at the working tree gives the same
losses, the same final weights byte for byte and the same config.yaml (less settings added since, which
are new lines, not changes).

* 091d311: before the multi-turn seam; single-turn training must not have moved since.
* e11bfc4: before issue 30's redesign (trainer/train split, settings resolved once); the presets' runs and
  config.yaml must not have moved since.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import reference, tiny_run

BEFORE_THE_SEAM = "091d311"
BEFORE_ISSUE_30 = "e11bfc4"


def test_single_turn_training_is_what_it_was(tmp_path):
    """Within float32 tolerance, not bitwise: issue 34's packed attention (the CPU training route since,
    model/packed_attention.py) sums each softmax in other pieces than the grid route of 091d311, so
    log-probs and gradients differ by ~1e-6 (tests/unit/test_packed_attention.py), and AdamW carries
    that into the weights. The run must still be the same run: same losses to 1e-5, and the weights as
    `assert_same_training` says."""
    model = tiny_run.make_model_dir(tmp_path / "model")
    data = tiny_run.write_dataset(tmp_path / "data.jsonl", 6)
    runs = {}
    for side, src in (("before", reference.source_at(BEFORE_THE_SEAM)), ("now", None)):
        out = tmp_path / side
        reference.run_python(tiny_run.config(model, data, out, steps=3, save_steps=0, report=False), src)
        runs[side] = reference.losses(out), tiny_run.weights(out / "final_model")
    assert len(runs["now"][0]) == 3
    assert runs["now"][0] == pytest.approx(runs["before"][0], rel=1e-5, abs=1e-7)
    assert_same_training(tiny_run.weights(model), runs["before"][1], runs["now"][1])


def assert_same_training(start: dict, before: dict, now: dict) -> None:
    """`now` is the `before` run up to float32 noise. AdamW's first steps move a weight by about ±lr
    whatever its gradient's size, so where a gradient is ~0 that noise can flip a step's sign: single
    weights may land up to a step apart. On average over each tensor they must agree to 1% of how far
    training moved it, and none may be further apart than twice the furthest any weight of it moved (a
    step flipped)."""
    for name, b in before.items():
        moved, diff = (b - start[name]).abs(), (now[name] - b).abs()
        assert diff.mean() <= 0.01 * moved.mean() + 1e-9, (name, diff.mean(), moved.mean())
        assert diff.max() <= 2 * moved.max() + 1e-9, (name, diff.max(), moved.max())


PRESETS = ("tiny_math", "tiny_tools")


def preset_argv(preset: str, run: Path) -> list[str]:
    # A quarter of the preset's prompts per step and half its group size, on one thread (the other xdist
    # worker has the other core), no report (its plots cost ~2 s of CPU a run; tests/unit/test_report.py
    # covers it): the same training path for less; both sides get the same overrides, and config.yaml still
    # carries every other setting of the preset.
    argv = ["train", "--config", preset, "--output-dir", str(run), "train.steps=2"]
    argv += ["train.prompts_per_step=4", "generation.num_generations=4"]
    argv += ["train.num_threads=1", "train.report=false"]
    return [*argv, "train.eval_before=false", "train.eval_after=false"]


@pytest.fixture(scope="module")
def before_issue_30_and_now(tmp_path_factory):
    """Each side's dry runs (DRY_RUNS) and preset runs (PRESETS), one after another in one process per side
    (reference.cli_outputs): each process start costs ~6 CPU-s of imports, and the file used six. For each
    side: the dry runs' (exit code, stdout), and each preset's (config.yaml, final weights). One run path per
    preset for both sides: config.yaml records it."""
    runs = {preset: tmp_path_factory.mktemp(preset) / "run" for preset in PRESETS}
    argvs = [["train", *argv, "--dry-run"] for argv in DRY_RUNS.values()]
    argvs += [preset_argv(preset, runs[preset]) for preset in PRESETS]
    seen = {}
    for side, src in (("before", reference.source_at(BEFORE_ISSUE_30)), ("now", None)):
        shown = reference.cli_outputs(argvs, src)
        trained = {}
        for preset, (code, _) in zip(PRESETS, shown[len(DRY_RUNS) :], strict=True):
            assert code == 0, f"grpo train --config {preset} at {src or 'HEAD'} exited {code}"
            run = runs[preset]
            trained[preset] = (run / "config.yaml").read_bytes(), tiny_run.weights(run / "final_model")
            shutil.rmtree(run)
        seen[side] = shown[: len(DRY_RUNS)], trained
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_are_what_they_were(preset, before_issue_30_and_now):
    """config.yaml byte for byte; the weights within float32 tolerance since issue 34's packed attention
    (see test_single_turn_training_is_what_it_was)."""
    from grpo.model.loading import bundled_model_path

    before, now = before_issue_30_and_now["before"][1][preset], before_issue_30_and_now["now"][1][preset]
    before_yaml, now_yaml = before[0].decode(), now[0].decode()
    # config.yaml byte for byte, less the settings added since (their defaults change nothing run before)
    assert reference.without_new_settings(now_yaml, before_yaml) == before_yaml
    start = tiny_run.weights(bundled_model_path(f"{preset.replace('_', '-')}-lm"))
    assert_same_training(start, before[1], now[1])


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Every preset, with local data where the preset's is on the hub (this host may be offline), and the task
# detection that rewrites the rewards and evaluation set (IFEval rows under the tiny_math preset).
DRY_RUNS = {
    "tiny_math": ["--config", "tiny_math"],
    "tiny_tools": ["--config", "tiny_tools"],
    "gsm8k": ["--config", "gsm8k", "data.dataset=tiny_math", "data.eval_dataset=tiny_math:test"],
    "ifeval": [
        "--config",
        "ifeval",
        f"data.dataset={FIXTURES / 'ifeval_sample.jsonl'}",
        "data.eval_dataset=holdout",
    ],
    "task_detected": ["--config", "tiny_math", f"data.dataset={FIXTURES / 'ifeval_sample.jsonl'}"],
}


def test_preset_configs_are_what_they_were(before_issue_30_and_now):
    """`grpo train --dry-run` prints the config.yaml a run writes (and the plan) from the data alone."""
    before, now = before_issue_30_and_now["before"][0], before_issue_30_and_now["now"][0]
    for name, shown_before, shown_now in zip(DRY_RUNS, before, now, strict=True):
        assert shown_before[0] == 0 and "plan:" in shown_before[1], name
        assert shown_now[0] == 0, name
        assert reference.without_new_settings(shown_now[1], shown_before[1]) == shown_before[1], name


def test_a_setting_added_since_is_new_lines_and_any_other_difference_is_a_change():
    before = "model:\n  a: 1\n  b:\n  - x\nenv:\n  tools: []\n  max_turns: 4\n"
    now = "model:\n  a: 1\n  b:\n  - x\n  c:\n  - y\nenv:\n  tools: []\n  max_turns: 4\n  agent: null\n"
    assert reference.without_new_settings(now, before) == before
    assert reference.without_new_settings(now.replace("a: 1", "a: 2"), before) != before
    assert reference.without_new_settings(now.replace("  - x\n", "  - w\n", 1), before) != before
