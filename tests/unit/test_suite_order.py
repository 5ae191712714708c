"""`make test` runs the longest test files first (tests/conftest.py, LONGEST_FIRST): that order only holds
if xdist keeps it and if the names in the list are still the suite's files."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[2]


def test_make_test_keeps_the_collection_order():
    # xdist's default (--loadscope-reorder) hands out files by their number of tests, not in this order.
    parallel = re.search(r"^PYTEST_PARALLEL \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert parallel and "--dist loadfile" in parallel.group(1)
    assert "--no-loadscope-reorder" in parallel.group(1).split()


def test_every_file_in_the_longest_first_list_exists_once():
    # A renamed or deleted file would silently fall back to collection order.
    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
