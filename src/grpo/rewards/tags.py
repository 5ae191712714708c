"""The reasoning and answer blocks that prompts ask for (`<think>…</think>`, `<answer>…</answer>`), one
definition for every reward that reads them. DOTALL: a block may span lines."""

import re

THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)  # group 1: the reasoning
ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)  # group 1: the answer
