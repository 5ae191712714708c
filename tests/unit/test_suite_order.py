"""tests/conftest.py's LONGEST_FIRST orders a one-process run: it only holds if the names in the list are
still the suite's files."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_in_the_longest_first_list_exists_once():
    # A renamed or deleted file would silently fall back to collection order.
    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
