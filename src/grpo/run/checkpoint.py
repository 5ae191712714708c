"""The old import path of grpo/checkpoint/store.py, kept for code written against it."""

from grpo.checkpoint.store import *  # noqa: F403
from grpo.checkpoint.store import CheckpointError  # noqa: F401 - the name most callers import
