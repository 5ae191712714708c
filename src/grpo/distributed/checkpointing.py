"""The old import path of grpo/checkpoint/policy.py, kept for code written against it."""

from grpo.checkpoint.policy import *  # noqa: F403
