"""Fuzzing the config parser and the dataset loaders: whatever arrives, the answer is a loaded value or
a ConfigError with a message — never another exception (hypothesis, bounded examples)."""

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo.config import ALIASES, ConfigError, DataConfig, GRPOConfig, all_paths, flatten, read_config_file
from grpo.data import PromptStream, load_rows, normalise_rows

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYS = st.one_of(st.sampled_from(sorted(set(all_paths()) | set(ALIASES))), st.text(max_size=20))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
VALUES = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=5), SCALARS, max_size=2)
)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@FAST
@given(st.dictionaries(KEYS, VALUES, max_size=4))
def test_any_overrides_give_a_config_or_a_config_error(overrides):
    try:
        GRPOConfig(**overrides).validate()
    except ConfigError as e:
        assert str(e)


@FAST
@given(st.text(max_size=200))
def test_any_yaml_text_gives_settings_or_a_config_error(text):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            GRPOConfig().update(read_config_file(str(path))).validate()
        except ConfigError as e:
            assert str(e)


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["train", "optim", "model", "x", 1]),
        st.one_of(VALUES, st.dictionaries(KEYS, VALUES, max_size=3)),
        max_size=3,
    )
)
def test_any_yaml_tree_gives_settings_or_a_config_error(tree):
    try:
        GRPOConfig().update(flatten(tree)).validate()
    except ConfigError as e:
        assert str(e)


@FAST
@given(
    st.one_of(
        st.binary(max_size=200),
        st.lists(JSON, max_size=4).map(lambda rows: "\n".join(json.dumps(r) for r in rows).encode()),
    )
)
def test_any_jsonl_file_gives_valid_rows_or_a_config_error(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "d.jsonl"
        path.write_bytes(data)
        try:
            rows = load_rows(str(path), DataConfig())
        except ConfigError as e:
            assert str(e)
            return
    assert rows and all(isinstance(r["prompt"], (str, list)) and r["prompt"] for r in rows)


@FAST
@given(st.lists(JSON, max_size=6), st.booleans())
def test_any_records_give_valid_rows_or_a_config_error(records, skip):
    try:
        rows = normalise_rows(records, None, None, source="fuzz", skip_invalid=skip)
    except ConfigError as e:
        assert str(e)
        return
    assert rows and all(r["prompt"] for r in rows) and len(rows) <= len(records)


@FAST
@given(st.integers(1, 9), st.integers(1, 4), st.integers(0, 12), st.integers(1, 12), st.booleans())
def test_stream_resumed_anywhere_continues_the_same_order(n, batch, stop, more, shuffle):
    rows = [{"prompt": str(i)} for i in range(n)]
    straight = PromptStream(rows, seed=3, shuffle=shuffle)
    expected = [straight.next_rows(batch)[0] for _ in range(stop + more)]
    first = PromptStream(rows, seed=3, shuffle=shuffle)
    got = [first.next_rows(batch)[0] for _ in range(stop)]
    resumed = PromptStream(rows, seed=3, shuffle=shuffle)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.next_rows(batch)[0] for _ in range(more)]
    assert got == expected
