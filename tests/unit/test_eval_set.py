"""Which data is evaluated: a preset's evaluation set stays with the preset's data; training data the user
brings that is not a task is evaluated on a held-out slice of itself; the set is named at start-up and in
the report, and a set that fails to load is named as the evaluation set."""

import json
import logging
from pathlib import Path

import pytest

from grpo.config import ConfigError, GRPOConfig, load_config
from grpo.data import SimplePromptDataset, load_rows
from grpo.data.sources import split_holdout
from grpo.run.assemble import describe_eval_set, eval_set_name, load_data_and_rewards
from grpo.run.report import write_report
from tests.unit.test_report import fake_run


@pytest.fixture
def my_jsonl(tmp_path):
    """64 rows of the bundled task's training data, as a user's own file."""
    rows = load_rows("tiny_math:train", GRPOConfig().data)[:64]
    path = tmp_path / "my.jsonl"
    path.write_text(
        "".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
    )
    return path


def test_new_training_data_that_is_no_task_evaluates_on_a_holdout_of_itself(caplog):
    with caplog.at_level(logging.INFO, logger="grpo"):
        cfg = load_config("tiny_math", {"hf_path": "my.jsonl"})
    assert cfg.data.eval_dataset == "holdout"
    assert "evaluating on a held-out 10% of it" in caplog.text and "'tiny_math:test'" in caplog.text
    ifeval = load_config("ifeval", {"env.dataset": "local.jsonl"})  # TorchRL's spelling, IFEval's preset
    assert ifeval.data.eval_dataset == "holdout"


def test_a_task_brings_its_own_split_and_a_chosen_evaluation_set_is_kept():
    assert load_config("tiny_math", {"dataset": "gsm8k"}).data.eval_dataset == "gsm8k:test"
    chosen = load_config("tiny_math", {"dataset": "my.jsonl", "data.eval_dataset": "mine_test.jsonl"})
    assert chosen.data.eval_dataset == "mine_test.jsonl"
    assert load_config("tiny_math", {"steps": 3}).data.eval_dataset == "tiny_math:test"


def test_the_holdout_is_a_seeded_tenth_disjoint_from_training_and_capped():
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(64)]
    train, held = split_holdout(rows)
    assert (len(train), len(held)) == (58, 6)  # round(6.4) held out
    assert sorted(r["prompt"] for r in train + held) == sorted(r["prompt"] for r in rows)
    assert split_holdout(rows) == (train, held)  # the same rows every run (and every resume)
    assert len(split_holdout([{"prompt": str(i)} for i in range(12000)])[1]) == 500
    assert [len(part) for part in split_holdout(rows[:2])] == [1, 1]
    with pytest.raises(ConfigError, match="at least 2 training rows"):
        split_holdout(rows[:1])


def test_a_users_file_is_trained_on_less_its_holdout_which_is_evaluated(my_jsonl):
    cfg = load_config("tiny_math", {"hf_path": str(my_jsonl)})
    train, held, _, _ = load_data_and_rewards(cfg)
    assert (len(train), len(held)) == (58, 6)
    file_prompts = {json.loads(line)["question"] for line in my_jsonl.read_text().splitlines()}
    assert {r["prompt"] for r in held} <= file_prompts  # not the preset's tiny_math:test
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    name = eval_set_name(cfg, str(my_jsonl))
    assert describe_eval_set(cfg, name, held, len(train)) == (
        f"the held-out slice of {my_jsonl} (6 rows, not trained on; 58 rows left to train on), greedy "
        "pass@1, before, every 20 steps, after training"
    )


def test_the_python_api_with_its_own_training_data_does_not_evaluate_on_the_builtin_set():
    questions = [f"What is {i} + 1?" for i in range(20)]
    dataset = SimplePromptDataset(questions, answer=[f"#### {i + 1}" for i in range(20)])
    cfg = GRPOConfig(eval_before=True)
    train, held, _, decided = load_data_and_rewards(cfg, train_dataset=dataset)
    assert decided["data.eval_dataset"] == "holdout" and (len(train), len(held)) == (18, 2)
    assert {r["prompt"] for r in held} <= set(questions)


def test_training_data_that_cannot_be_scored_runs_without_evaluation_and_says_so(caplog):
    cfg = GRPOConfig(eval_before=True)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        train, held, _, decided = load_data_and_rewards(
            cfg,
            train_dataset=SimplePromptDataset(["a", "b", "c"]),
            reward_funcs=[lambda p, c, **_: [0.0] * len(c)],
        )
    assert (len(train), held, decided["data.eval_dataset"]) == (3, [], None)
    assert "No evaluation: the training data cannot be scored" in caplog.text


def test_a_local_ifeval_file_under_the_ifeval_preset_needs_no_hub(monkeypatch):
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args[:1]}")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    fixture = str(Path(__file__).parents[1] / "fixtures" / "ifeval_sample.jsonl")
    cfg = load_config("grpo_ifeval", {"env.dataset": fixture})
    train, held, _, _ = load_data_and_rewards(cfg)
    assert (len(train), len(held)) == (3, 1) and "instruction_id_list" in held[0]


def test_an_evaluation_set_that_fails_to_load_is_named_as_the_evaluation_set(tmp_path):
    cfg = load_config("tiny_math", {"data.eval_dataset": str(tmp_path / "gone.jsonl")})
    with pytest.raises(ConfigError) as error:
        load_data_and_rewards(cfg)
    message = str(error.value)
    assert message.startswith(
        f"Could not load the evaluation set data.eval_dataset = {tmp_path / 'gone.jsonl'}: "
    )
    assert "or to none (no evaluation)" in message


def test_the_report_names_the_evaluation_set(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "config.yaml").write_text("data: {dataset: tiny_math, hf_path: my.jsonl, eval_dataset: holdout}\n")
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('\n{"step": 10, "eval/accuracy_after": 0.5, "eval/n": 6}\n')
    page = write_report(run).read_text(encoding="utf-8")
    assert "<th>evaluation set</th><td>a held-out slice of my.jsonl, not trained on (6 rows)</td>" in page
    assert "<th>dataset</th><td>my.jsonl</td>" in page
