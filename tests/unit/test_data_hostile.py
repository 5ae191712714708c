"""A dataset file of hostile rows stops the run with one line naming the row (issue 32 §3)."""

import pytest

from grpo.config import ConfigError, DataConfig
from grpo.data import load_rows
from grpo.data.sources import MAX_ROW_DEPTH

DEEP = "[" * 100_000 + "]" * 100_000
OK_ROW = '{"prompt": "2+2?", "answer": "4"}'


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("d.jsonl", f'{OK_ROW}\n{{"prompt": "x", "answer": {DEEP}}}\n', "line 2"),
        ("d.jsonl", f"{OK_ROW}\n{DEEP}\n", "line 2"),
        ("d.json", f'[{OK_ROW}, {{"prompt": "x", "answer": {DEEP}}}]', "not valid JSON"),
        ("d.jsonl", f'{OK_ROW}\n{{"prompt": "x", "answer": {"9" * 5000}}}\n', "line 2"),
        ("d.jsonl", f'{OK_ROW}\n{{"prompt": "x", "answer": {"[" * 500 + "]" * 500}}}\n', "line 2"),
        ("d.json", f'[{OK_ROW}, {{"prompt": "x", "answer": {"[" * 500 + "]" * 500}}}]', "row 1"),
    ],
)
def test_hostile_rows_are_one_line_naming_the_row(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_rows(str(path), DataConfig())
    message = str(caught.value)
    assert where in message and "\n" not in message and len(message) < 600


def test_rows_at_the_depth_limit_load(tmp_path):
    path = tmp_path / "d.jsonl"
    nested = "[" * (MAX_ROW_DEPTH - 1) + "]" * (MAX_ROW_DEPTH - 1)
    path.write_text(f'{{"prompt": "x", "answer": "4", "extra": {nested}}}\n', encoding="utf-8")
    assert load_rows(str(path), DataConfig())[0]["prompt"] == "x"
