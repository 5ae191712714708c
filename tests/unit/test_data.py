"""Prompt sources, column detection, clear errors, the long-prompt policy and resumable order."""

import json

import pandas as pd
import pytest

from grpo.config import ConfigError, DataConfig
from grpo.data import PromptFormatter, PromptStream, SimplePromptDataset, load_rows, make_prompt_batch


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_simple_prompt_dataset_and_columns():
    ds = SimplePromptDataset(["a", "b"], answer=["1", "2"])
    assert len(ds) == 2 and ds[1] == {"prompt": "b", "answer": "2"}
    with pytest.raises(ValueError, match="Column 'answer' has 1 values for 2 prompts"):
        SimplePromptDataset(["a", "b"], answer=["1"])


def test_local_formats_and_gsm8k_columns(tmp_path):
    rows = [
        {"question": "1+1?", "answer": "1+1=2\n#### 2", "source": "x"},
        {"question": "2+2?", "answer": "#### 4", "source": "y"},
    ]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    for path in (jsonl, tmp_path / "d.parquet", tmp_path / "d.csv"):
        loaded = load_rows(str(path), DataConfig())
        assert loaded[0] == {"prompt": "1+1?", "answer": "1+1=2\n#### 2", "source": "x"}


def test_bundled_task_is_gsm8k_schema():
    train = load_rows("tiny_math", DataConfig())
    test = load_rows("tiny_math:test", DataConfig())
    assert len(test) == 500 and len(train) > 1000
    assert all("####" in r["answer"] for r in test)
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}


@pytest.mark.parametrize(
    "rows,message",
    [
        ([], "empty"),
        ([{"text": "no prompt column"}], "no prompt column"),
        (
            [{"prompt": "ok"}, {"prompt": ""}, {"prompt": None}],
            r"rows 1, 2 \(counting from 0\) have an empty or missing 'prompt'",
        ),
    ],
)
def test_bad_datasets_are_refused_with_the_reason(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=message):
        load_rows(str(path), DataConfig())


def test_missing_file_and_non_utf8(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"), DataConfig())
    bad = tmp_path / "latin1.csv"
    bad.write_bytes("prompt\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"UTF-8|Could not read"):
        load_rows(str(bad), DataConfig())


class WordTokenizer:
    chat_template = None

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[len(w) for w in t.split()] for t in texts]}


def test_long_prompt_policy():
    prompts = ["one two three", "a b c d e f g h", "x"]
    strict = PromptFormatter(WordTokenizer(), DataConfig(max_prompt_length=4))
    with pytest.raises(
        ConfigError, match=r"1 prompt\(s\) are longer than data.max_prompt_length = 4.*rows 11"
    ):
        strict.encode(prompts, indices=[10, 11, 12])
    lenient = PromptFormatter(
        WordTokenizer(), DataConfig(max_prompt_length=4, long_prompt_policy="truncate_left")
    )
    ids = lenient.encode(prompts)
    assert ids[1] == [1, 1, 1, 1] and lenient.truncated_count == 1 and ids[0] == [3, 3, 5]


def test_prompt_batch_carries_columns():
    rows = [{"prompt": "p one", "answer": "1"}, {"prompt": "p two", "answer": "2"}]
    batch = make_prompt_batch([0, 1], rows, PromptFormatter(WordTokenizer(), DataConfig()))
    assert batch.prompts == ["p one", "p two"] and batch.columns == {"answer": ["1", "2"]}


def test_stream_is_seeded_covers_each_epoch_and_resumes_mid_epoch():
    rows = [{"prompt": str(i)} for i in range(10)]
    a = PromptStream(rows, seed=1)
    first_epoch = [i for _ in range(3) for i in a.next_rows(4)[0]]
    assert sorted(first_epoch) == list(range(10))  # last batch of the epoch is the 2 left over
    b = PromptStream(rows, seed=1)
    b.next_rows(4)
    state = b.state_dict()
    c = PromptStream(rows, seed=1)
    c.load_state_dict(state)
    assert c.next_rows(4) == b.next_rows(4)
    assert PromptStream(rows, seed=2).next_rows(10)[0] != PromptStream(rows, seed=1).next_rows(10)[0]
    with pytest.raises(ConfigError, match="same dataset"):
        PromptStream(rows[:5], seed=1).load_state_dict(state)
