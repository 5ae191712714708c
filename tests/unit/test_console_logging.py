"""The "grpo" console handler follows sys.stderr, so a replaced-and-closed stream (pytest capture, a
notebook cell, a second trainer in one process) cannot turn log lines into logging-error tracebacks."""

import io
import logging
import sys

from grpo.run.assemble import setup_logging


def test_log_lines_go_to_the_current_stderr_after_the_first_one_closes(monkeypatch):
    logger = logging.getLogger("grpo")
    monkeypatch.setattr(logger, "handlers", [])  # as in a fresh process: set-up adds its console handler
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging()
    logger.warning("first run")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    setup_logging()  # a second run in the same process keeps the handler it finds
    logger.warning("second run")
    assert second.getvalue() == "second run\n"
