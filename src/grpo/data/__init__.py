"""Prompt data: where rows come from (sources), the task registry (tasks), and rows → PromptBatch
(prompts)."""

from grpo.data.prompts import PromptFormatter, PromptStream, make_prompt_batch, prompt_text
from grpo.data.sources import (
    ANSWER_COLUMNS,
    LOCAL_FORMATS,
    PROMPT_COLUMNS,
    SimplePromptDataset,
    load_rows,
    normalise_rows,
    rows_from_dataset,
)
from grpo.data.tasks import TASKS, Task, find_task

__all__ = [
    "ANSWER_COLUMNS",
    "LOCAL_FORMATS",
    "PROMPT_COLUMNS",
    "TASKS",
    "PromptFormatter",
    "PromptStream",
    "SimplePromptDataset",
    "Task",
    "find_task",
    "load_rows",
    "make_prompt_batch",
    "normalise_rows",
    "prompt_text",
    "rows_from_dataset",
]
