"""The console log handler: it writes to whatever `sys.stderr` is when a line is logged.

A `StreamHandler(sys.stderr)` keeps the stream it was built with. When that stream is later replaced and
closed (pytest's capture between tests, a notebook cell's output, a second `GRPOTrainer` in the same
process), every log line becomes a "--- Logging error ---" traceback instead of a message.
"""

from __future__ import annotations

import logging
import sys


class StderrHandler(logging.StreamHandler):
    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        # StreamHandler.__init__ and setStream assign the stream; the property always reads it afresh.
        pass
