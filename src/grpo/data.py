"""Prompt sources → rows → PromptBatch.

A row is a dict with a `prompt` string plus the dataset's other columns (e.g. `answer`), which reach
reward functions as keyword arguments. Sources: the bundled `tiny_math` task, GSM8K and IFEval from the hub,
local JSONL/JSON/Parquet/CSV files, any hub dataset (through `datasets`), or a Python list
(`SimplePromptDataset`).
"""

from __future__ import annotations

import logging
import random
from importlib import resources
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from grpo.batch import PromptBatch
from grpo.config import ConfigError, DataConfig

log = logging.getLogger(__name__)

PROMPT_COLUMNS = ("prompt", "question", "problem", "instruction", "query", "input")
ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "target")
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
BUNDLED_TASKS = ("tiny_math",)


class SimplePromptDataset(Dataset):
    """Prompts from a Python list; extra keyword lists become columns (e.g. `answer=[...]`)."""

    def __init__(self, prompts: list[str], **columns: list[Any]):
        if isinstance(prompts, str):
            raise TypeError("SimplePromptDataset takes a list of prompts, not a single string.")
        self.prompts = list(prompts)
        for name, values in columns.items():
            if len(values) != len(self.prompts):
                raise ValueError(f"Column '{name}' has {len(values)} values for {len(self.prompts)} prompts.")
        self.columns = {k: list(v) for k, v in columns.items()}

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"prompt": self.prompts[i], **{k: v[i] for k, v in self.columns.items()}}


def bundled_task_file(name: str, split: str) -> Path:
    path = resources.files("grpo.assets").joinpath(name, f"{split}.jsonl")
    if not path.is_file():
        raise ConfigError(f"The bundled task '{name}' has no split '{split}' (have: train, test).")
    return Path(str(path))


def load_rows(spec: str | None, cfg: DataConfig, split: str | None = None,
              token: str | None = None) -> list[dict[str, Any]]:
    """Resolve a dataset spec to rows with a `prompt` key. `spec` may end in ':split'."""
    spec = spec or "tiny_math"
    name, _, spec_split = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    split = spec_split or split or cfg.hf_data_split
    if name in BUNDLED_TASKS:
        records = _read_local(bundled_task_file(name, split))
    elif name == "gsm8k":
        records = _read_hub("openai/gsm8k", "main", split, None, token)
    elif name == "ifeval":  # google/IFEval: key, prompt, instruction_id_list, kwargs; one split, "train"
        records = _read_hub("google/IFEval", None, "train", None, token)
    elif Path(name).suffix in LOCAL_FORMATS or Path(name).exists():
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"Dataset file {path} does not exist (or is not a file).")
        records = _read_local(path)
    else:
        records = _read_hub(name, cfg.hf_name, split, cfg.hf_data_files, token)
    return normalise_rows(records, cfg.prompt_field, cfg.answer_field, source=spec)


def _read_local(path: Path) -> list[dict[str, Any]]:
    import datasets

    fmt = LOCAL_FORMATS.get(path.suffix)
    if fmt is None:
        raise ConfigError(f"Cannot read {path}: use one of {', '.join(LOCAL_FORMATS)}.")
    if fmt != "parquet" and not path.read_bytes().strip():
        raise ConfigError(f"Dataset file {path} is empty: it has no rows to train or evaluate on.")
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not valid UTF-8 text ({e}). Re-encode it as UTF-8.") from e
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise ConfigError(f"Could not read {path} as {fmt}: {e}") from e
    return ds.to_list()


def _read_hub(path: str, name: str | None, split: str, data_files: str | None,
              token: str | None) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(path, name, split=split, data_files=data_files, token=token)
    except Exception as e:
        raise ConfigError(f"Could not load dataset '{path}' (config {name!r}, split {split!r}) with the "
                          f"`datasets` library: {type(e).__name__}: {e}") from e
    return ds.to_list()


def _pick(columns: list[str], wanted: str | None, candidates: tuple[str, ...], what: str,
          source: str) -> str | None:
    if wanted:
        if wanted not in columns:
            raise ConfigError(f"{source}: no column '{wanted}' for the {what}; columns are {columns}.")
        return wanted
    return next((c for c in candidates if c in columns), None)


def normalise_rows(records: list[dict[str, Any]], prompt_field: str | None, answer_field: str | None,
                   source: str) -> list[dict[str, Any]]:
    if not records:
        raise ConfigError(f"Dataset {source} is empty: it has no rows to train or evaluate on.")
    columns = list(records[0])
    prompt_col = _pick(columns, prompt_field, PROMPT_COLUMNS, "prompt", source)
    if prompt_col is None:
        raise ConfigError(f"{source}: no prompt column among {columns}; set data.prompt_field to the "
                          f"column that holds the prompt (looked for {', '.join(PROMPT_COLUMNS)}).")
    answer_col = _pick(columns, answer_field, ANSWER_COLUMNS, "answer", source)
    bad = [i for i, r in enumerate(records) if not isinstance(r.get(prompt_col), (str, list)) or not r[prompt_col]]
    if bad:
        raise ConfigError(f"{source}: rows {_rows(bad)} have an empty or missing '{prompt_col}' field.")
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k not in (prompt_col, answer_col)}
        row["prompt"] = r[prompt_col]
        if answer_col is not None:
            row["answer"] = r[answer_col]
        rows.append(row)
    return rows


def _rows(indices: list[int], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f" and {len(indices) - limit} more" if len(indices) > limit else "")


def rows_from_dataset(dataset: Any) -> list[dict[str, Any]]:
    """Rows from a SimplePromptDataset, a `datasets.Dataset`, a list of dicts or a list of strings."""
    if isinstance(dataset, SimplePromptDataset):
        return [dataset[i] for i in range(len(dataset))]
    if hasattr(dataset, "to_list"):
        dataset = dataset.to_list()
    dataset = list(dataset)
    if dataset and isinstance(dataset[0], str):
        return [{"prompt": p} for p in dataset]
    return normalise_rows(dataset, None, None, source="train_dataset")


class PromptFormatter:
    """Prompt text → token ids: chat template when the tokenizer has one, plus the length policy."""

    def __init__(self, tokenizer: Any, cfg: DataConfig):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.templated = cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.truncated_count = 0

    def text(self, prompt: str | list[dict[str, str]]) -> str:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not self.templated:
            return "\n".join(m["content"] for m in messages)
        if self.cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, prompts: list, indices: list[int] | None = None) -> list[list[int]]:
        # The chat template already places any BOS token; adding special tokens again would double it.
        texts = [self.text(p) for p in prompts]
        ids = self.tokenizer(texts, add_special_tokens=not self.templated)["input_ids"]
        limit = self.cfg.max_prompt_length
        too_long = [i for i, x in enumerate(ids) if len(x) > limit]
        if too_long and self.cfg.long_prompt_policy == "error":
            where = [indices[i] for i in too_long] if indices else too_long
            raise ConfigError(f"{len(too_long)} prompt(s) are longer than data.max_prompt_length = {limit} "
                              f"tokens (dataset rows {_rows(where)}; longest {max(len(ids[i]) for i in too_long)}"
                              "). Raise data.max_prompt_length or set data.long_prompt_policy=truncate_left.")
        if too_long:
            self.truncated_count += len(too_long)
            log.warning("Left-truncated %d prompt(s) to %d tokens (%d so far).", len(too_long), limit,
                        self.truncated_count)
            ids = [x[-limit:] for x in ids]
        return ids


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    """What reward functions see as the prompt: the text itself, or the last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


class PromptStream:
    """Rows in seeded, per-epoch shuffled order; state is (epoch, position) so a resume continues
    mid-epoch exactly where it stopped. The last batch of an epoch may be smaller than P."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool = True):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def steps_per_epoch(self, batch: int) -> int:
        return -(-len(self.rows) // batch)

    def next_rows(self, batch: int) -> tuple[list[int], list[dict[str, Any]]]:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        picked = self._order[self.position:self.position + batch]
        self.position += len(picked)
        return picked, [self.rows[i] for i in picked]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != len(self.rows):
            raise ConfigError(f"The checkpoint was trained on {state['num_rows']} prompts, this dataset has "
                              f"{len(self.rows)}: resume with the same dataset.")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)


def make_prompt_batch(indices: list[int], rows: list[dict[str, Any]], formatter: PromptFormatter) -> PromptBatch:
    columns = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"}
    return PromptBatch(
        prompts=[prompt_text(r["prompt"]) for r in rows],
        prompt_token_ids=formatter.encode([r["prompt"] for r in rows], indices),
        columns=columns, indices=indices,
    )
