"""The task registry (data/tasks.py): a task registered in one entry is loaded, configured and evaluated
through the same paths as the built-in ones; rows are matched to tasks by their columns."""

import json

import pytest

from grpo.config import DataConfig, load_config
from grpo.data import PromptFormatter, load_rows
from grpo.data.tasks import (
    ANSWER_SCORER,
    IFEVAL_SCORER,
    TASKS,
    RowScore,
    Task,
    find_task,
    scorer_for_rows,
    task_of_rows,
)
from grpo.evaluation import evaluate
from tests.helpers import CannedEngine, CannedTokenizer


class _WordScorer:
    """Correct when the completion contains the row's word."""

    columns = ("word",)

    def score(self, row, prompt, completions):
        hits = [float(row["word"] in text) for text in completions]
        return RowScore(hits, {"word": row["word"]}, majority_correct=hits.count(1.0) > len(hits) / 2)

    def summary(self, details):
        return {"echo/rows": float(len(details))}


@pytest.fixture
def echo_task(tmp_path, monkeypatch):
    for split, words in (("train", ["red", "blue"]), ("test", ["cat", "dog", "owl"])):
        lines = [json.dumps({"prompt": f"Say {w}.", "word": w}) for w in words]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    task = Task(
        name="echo",
        source=str(tmp_path / "{split}.jsonl"),
        reward_funcs=("gsm8k_format",),
        reward_weights=None,
        eval_dataset="echo:test",
        scorer=_WordScorer(),
        columns=("word",),
        system_prompt="Repeat the word.",
    )
    monkeypatch.setitem(TASKS, "echo", task)
    return task


def test_a_registered_task_is_loaded_by_name_and_split(echo_task):
    assert [r["word"] for r in load_rows("echo", DataConfig())] == ["red", "blue"]
    assert [r["word"] for r in load_rows("echo:test", DataConfig())] == ["cat", "dog", "owl"]
    assert find_task("echo:test") is echo_task and find_task(echo_task.source) is echo_task


def test_switching_to_a_registered_task_brings_its_settings(echo_task):
    cfg = load_config(None, {"data.dataset": "echo"})
    assert cfg.algorithm.reward_funcs == ["gsm8k_format"] and cfg.data.eval_dataset == "echo:test"
    assert cfg.data.system_prompt == "Repeat the word."


def test_a_registered_task_is_evaluated_with_its_scorer(echo_task):
    rows = load_rows("echo:test", DataConfig())
    assert task_of_rows(rows) is echo_task and scorer_for_rows(rows) is echo_task.scorer
    tokenizer = CannedTokenizer([r["prompt"] for r in rows], ["a cat", "no", "owl!"])
    result = evaluate(CannedEngine(), PromptFormatter(tokenizer, DataConfig()), rows, max_new_tokens=4, k=2)
    assert result.accuracy == pytest.approx(2 / 3) and result.pass_at_k == pytest.approx(2 / 3)
    assert result.maj_at_k == pytest.approx(2 / 3)
    assert result.extra["echo/rows"] == 3.0
    assert result.records[1] == {
        "prompt": "Say dog.",
        "completions": ["no", "no"],
        "word": "dog",
        "correct": [0.0, 0.0],
    }


def test_rows_are_matched_to_the_most_specific_task_by_their_columns():
    answer_rows = [{"prompt": "1+1?", "answer": "2"}]
    ifeval_rows = [{"prompt": "p", "instruction_id_list": ["x"], "kwargs": [{}], "answer": "2"}]
    assert task_of_rows(answer_rows) is None  # tiny_math and gsm8k both fit: no local copy of one task
    assert task_of_rows(ifeval_rows) is TASKS["ifeval"]
    assert scorer_for_rows(answer_rows) is ANSWER_SCORER and scorer_for_rows(ifeval_rows) is IFEVAL_SCORER


def test_rows_no_task_can_score_are_refused_with_what_each_task_needs():
    with pytest.raises(
        ValueError, match=r"answer \(tiny_math, tiny_tools, gsm8k\) or instruction_id_list \(ifeval\)"
    ):
        scorer_for_rows([{"prompt": "p", "label": 1}])
