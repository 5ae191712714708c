"""Prompt sources → rows.

A row is a dict with a `prompt` (text, or a list of chat messages as TRL's conversational datasets have
it) plus the dataset's other columns, which reach reward functions as keyword arguments under their own
names. A reference-answer column named otherwise (`solution`, `ground_truth`, `target`) is also copied
to `answer`, the name this package's rewards read. Sources: a task of the registry (data/tasks.py: the
bundled `tiny_math` and `tiny_tools`, GSM8K and IFEval from the hub), local JSONL/JSON/Parquet/CSV files
or hub-layout folders, any hub dataset (through `datasets`), or a Python list (`SimplePromptDataset`).
"""

from __future__ import annotations

import json
import logging
import random
from importlib import resources
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from grpo.config import ConfigError, DataConfig
from grpo.config.errors import clause
from grpo.data.tasks import Task, find_task

log = logging.getLogger(__name__)

PROMPT_COLUMNS = ("prompt", "question", "problem", "instruction", "query", "input")
ANSWER_COLUMNS = ("answer", "solution", "ground_truth", "target")
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


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


# data.eval_dataset = holdout: this share of the training rows (at least one, at most HOLDOUT_MAX) is
# evaluated on and never trained on, drawn with its own fixed seed so every run (and every resume) on the
# same data holds out the same rows, whatever train.seed is.
HOLDOUT_FRACTION, HOLDOUT_MAX, HOLDOUT_SEED = 0.1, 500, 0


def split_holdout(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows to train on, held-out rows), both in their original order."""
    if len(rows) < 2:
        raise ConfigError(
            f"data.eval_dataset = holdout needs at least 2 training rows to hold one out (have {len(rows)}); "
            "set data.eval_dataset to an evaluation set, or to none."
        )
    count = min(HOLDOUT_MAX, max(1, round(len(rows) * HOLDOUT_FRACTION)))
    held = set(random.Random(HOLDOUT_SEED).sample(range(len(rows)), count))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def bundled_task_file(name: str, split: str) -> Path:
    path = resources.files("grpo.assets").joinpath(name, f"{split}.jsonl")
    if not path.is_file():
        raise ConfigError(f"The bundled task '{name}' has no split '{split}' (have: train, test).")
    return Path(str(path))


def load_rows(
    spec: str | None, cfg: DataConfig, split: str | None = None, token: str | None = None
) -> list[dict[str, Any]]:
    """Resolve a dataset spec to rows with a `prompt` key. `spec` may end in ':split'. A task's name or
    source (`gsm8k`, `openai/gsm8k`) reads the task's data (TASKS); anything else is a folder, a file or a
    hub dataset."""
    spec = spec or "tiny_math"
    name, _, spec_split = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    split = spec_split or split or cfg.hf_data_split
    task = find_task(name)
    records = (
        _read_task(task, split, cfg, token) if task else _read_source(name, cfg.hf_name, split, cfg, token)
    )
    return normalise_rows(
        records, cfg.prompt_field, cfg.answer_field, source=spec, skip_invalid=cfg.skip_invalid_rows
    )


def _read_task(task: Task, split: str, cfg: DataConfig, token: str | None) -> list[dict[str, Any]]:
    split = task.fixed_split or split  # google/IFEval has one split ("train")
    if task.source is None:
        return _read_local(bundled_task_file(task.name, split))
    # openai/gsm8k needs its config "main"
    source = task.source.format(split=split)
    return _read_source(source, cfg.hf_name or task.hub_config, split, cfg, token)


def _read_source(
    name: str, config_name: str | None, split: str, cfg: DataConfig, token: str | None
) -> list[dict[str, Any]]:
    """A local folder in the hub's layout, a local file, or else a hub dataset id."""
    if Path(name).is_dir():  # a dataset folder in the hub's layout (a downloaded or saved copy)
        return _read_folder(Path(name), config_name, split, cfg.hf_data_files, token)
    if Path(name).suffix in LOCAL_FORMATS or Path(name).exists():
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"Dataset file {path} does not exist (or is not a file).")
        if cfg.hf_data_files:
            raise ConfigError(
                f"data.hf_data_files = {cfg.hf_data_files!r} picks files inside a dataset folder or "
                f"hub repository, but the dataset is the file {path} itself. Drop --hf_data_files, "
                "or point --hf_path at the folder that holds the files."
            )
        return _read_local(path)
    return _read_hub(name, config_name, split, cfg.hf_data_files, token)


def _read_local(path: Path) -> list[dict[str, Any]]:
    fmt = LOCAL_FORMATS.get(path.suffix)
    if fmt is None:
        raise ConfigError(f"Cannot read {path}: use one of {', '.join(LOCAL_FORMATS)}.")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"Cannot read dataset file {path}: {e.strerror}. Check its permissions.") from e
    if fmt != "parquet":
        text = _utf8(data, path)
        if not text.strip():
            raise ConfigError(f"Dataset file {path} is empty: it has no rows to train or evaluate on.")
        if fmt == "json":
            return _parse_json(text, path)
    import datasets

    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not valid UTF-8 text ({e}). Re-encode it as UTF-8.") from e
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise ConfigError(f"Could not read {path} as {fmt}: {e}") from e
    return ds.to_list()


def _utf8(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} is not valid UTF-8: line {line} has the byte 0x{data[e.start]:02x}. Re-encode the "
            f"file as UTF-8 (e.g. iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix})."
        ) from e


def _parse_json(text: str, path: Path) -> list[Any]:
    """A JSON array of objects (a .json file may also hold one pretty-printed object), or JSON Lines (one
    object per line; blank lines are skipped)."""
    document_error = None
    if text.lstrip().startswith("[") or path.suffix == ".json":
        try:
            records = _json_value(text)
        except ValueError as e:
            if text.lstrip().startswith("["):
                raise ConfigError(f"{path} is not valid JSON: {clause(e)}.") from e
            document_error = e  # a .json file may still be JSON Lines
        else:
            records = records if isinstance(records, list) else _rows_of_object(records)
            deep = next((i for i, r in enumerate(records) if _nests_past(r, MAX_ROW_DEPTH)), None)
            if deep is not None:
                raise ConfigError(f"{path}: row {deep} (counting from 0) {_TOO_DEEP}")
            return records
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(_json_value(line))
        except ValueError as e:
            if document_error is not None:  # neither one JSON document nor JSON Lines: blame the document
                raise ConfigError(
                    f"{path} is not valid JSON ({document_error}). A .json file must hold one JSON "
                    'array of objects, e.g. [{"prompt": "...", "answer": "..."}], or one '
                    "object per line."
                ) from e
            raise ConfigError(
                f"{path}: line {number} is not valid JSON ({e}). Each line of a .jsonl file must "
                'be one JSON object, e.g. {"prompt": "...", "answer": "..."}.'
            ) from e
        if _nests_past(records[-1], MAX_ROW_DEPTH):
            raise ConfigError(f"{path}: line {number} {_TOO_DEEP}")
    return records


# A row holds a prompt, an answer and a few columns; deeper values are a broken or hostile file, and every
# later walk of a row (collation, samples.jsonl, error messages) is recursive.
MAX_ROW_DEPTH = 100
_TOO_DEEP = f"nests more than {MAX_ROW_DEPTH} levels deep; a row is a prompt, an answer and a few columns."


def _json_value(text: str) -> Any:
    """`json.loads` whose every failure is a ValueError: JSON nested past the recursion limit raises
    RecursionError, which would otherwise escape as a traceback."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"it nests deeper than Python's recursion limit; {_TOO_DEEP}") from None


def _nests_past(value: Any, limit: int) -> bool:
    """Whether `value` nests more than `limit` lists/objects deep (iteratively)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > limit:
            return True
        if isinstance(item, dict | list):
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _rows_of_object(document: Any) -> list[Any]:
    """One JSON object: a single row, or (`{"data": [...]}`) the one list of rows it wraps."""
    if isinstance(document, dict):
        lists = [
            v for v in document.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)
        ]
        if len(lists) == 1 and not any(k in document for k in PROMPT_COLUMNS):
            return lists[0]
    return [document]


def _read_hub(
    path: str, name: str | None, split: str, data_files: str | None, token: str | None
) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(path, name, split=split, data_files=data_files, token=token)
    except Exception as e:
        raise ConfigError(
            f"Could not load dataset '{path}' (config {name!r}, split {split!r}) with the "
            f"`datasets` library: {type(e).__name__}: {e}"
        ) from e
    return ds.to_list()


def _read_folder(
    path: Path, name: str | None, split: str, data_files: str | None, token: str | None
) -> list[dict[str, Any]]:
    """A local folder laid out as on the hub (`data/train-*.parquet`, `main/test-*.parquet`, `train.jsonl`,
    or `hf_data_files` inside it); a config name (`hf_name`) picks its sub-folder when there is one."""
    if name and (path / name).is_dir() and not data_files:
        path = path / name
        name = None
    if data_files and not any(path.glob(data_files)):
        raise ConfigError(
            f"data.hf_data_files = {data_files!r} matches no file in {path}; files there: "
            f"{', '.join(sorted(p.name for p in path.iterdir())[:10]) or 'none'}."
        )
    return _read_hub(str(path), name, split, data_files, token)


def _pick(
    columns: list[str], wanted: str | None, candidates: tuple[str, ...], what: str, source: str
) -> str | None:
    if wanted:
        if wanted not in columns:
            raise ConfigError(f"{source}: no column '{wanted}' for the {what}; columns are {columns}.")
        return wanted
    return next((c for c in candidates if c in columns), None)


def normalise_rows(
    records: list[dict[str, Any]],
    prompt_field: str | None,
    answer_field: str | None,
    source: str,
    skip_invalid: bool = False,
) -> list[dict[str, Any]]:
    """Rename the prompt column to `prompt`; the answer column keeps its name and is also copied to
    `answer`. Rows whose prompt (or, when there is an answer column, answer) is missing or empty stop the
    run with their row numbers, or with `skip_invalid` are dropped and counted."""
    if not records:
        raise ConfigError(f"Dataset {source} is empty: it has no rows to train or evaluate on.")
    not_objects = [i for i, r in enumerate(records) if not isinstance(r, dict)]
    if not_objects:
        raise ConfigError(
            f"{source}: rows {row_numbers(not_objects)} (counting from 0) are not objects with named "
            'fields (e.g. {"prompt": "...", "answer": "..."}).'
        )
    columns = list(dict.fromkeys(k for r in records for k in r))
    prompt_col = _pick(columns, prompt_field, PROMPT_COLUMNS, "prompt", source)
    if prompt_col is None:
        raise ConfigError(
            f"{source}: no prompt column among {columns}; set data.prompt_field to the "
            f"column that holds the prompt (looked for {', '.join(PROMPT_COLUMNS)})."
        )
    answer_col = _pick(columns, answer_field, ANSWER_COLUMNS, "answer", source)
    bad = _invalid_rows(records, prompt_col, answer_col, source, skip_invalid)
    if bad:
        fields = " or ".join(f"'{c}'" for c in dict.fromkeys(bad.values()))
        if not skip_invalid:
            raise ConfigError(
                f"{source}: rows {row_numbers(sorted(bad))} (counting from 0) have an empty or missing "
                f"{fields} field. Fix them, or set data.skip_invalid_rows=true to drop such rows "
                "(they are counted in the log)."
            )
        if len(bad) == len(records):
            raise ConfigError(
                f"{source}: all {len(records)} rows have an empty or missing {fields} field, so "
                "nothing is left to train on."
            )
        log.warning(
            "%s: skipped %d of %d rows with an empty or missing %s field (rows %s, counting from 0).",
            source,
            len(bad),
            len(records),
            fields,
            row_numbers(sorted(bad)),
        )
        records = [r for i, r in enumerate(records) if i not in bad]
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k != prompt_col}
        row["prompt"] = r[prompt_col]
        if answer_col is not None:
            # TRL's reward functions read the column under its own name (`solution`); ours read `answer`.
            row.pop("answer", None)
            row["answer"] = r[answer_col]
        rows.append(row)
    return rows


def _invalid_rows(
    records: list[dict[str, Any]], prompt_col: str, answer_col: str | None, source: str, skip_invalid: bool
) -> dict[int, str]:
    """Row number -> the first field (prompt, then answer) that is empty or missing in it. A prompt that
    is not text at all is a wrong column or a broken file, not a gap, so it stops the run unless
    `skip_invalid`."""
    bad = {i: prompt_col for i, r in enumerate(records) if not _valid_prompt(r.get(prompt_col))}
    not_text = [i for i in bad if not isinstance(records[i].get(prompt_col), str | list | None)]
    if not_text and not skip_invalid:
        value = records[not_text[0]][prompt_col]
        raise ConfigError(
            f"{source}: rows {row_numbers(not_text)} (counting from 0) have a '{prompt_col}' that is not "
            f"text (row {not_text[0]}: {value!r}). A prompt is a string, or "
            'a list of chat messages {"role": ..., "content": ...}. Fix them, or set '
            "data.skip_invalid_rows=true to drop such rows."
        )
    if answer_col is not None:
        for i, r in enumerate(records):
            if r.get(answer_col) is None or (isinstance(r[answer_col], str) and not r[answer_col].strip()):
                bad.setdefault(i, answer_col)
    return bad


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return bool(prompt.strip())
    # Chat format: a non-empty list of {"role": ..., "content": ...} messages.
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in prompt)
    )


def row_numbers(indices: list[int], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f" and {len(indices) - limit} more" if len(indices) > limit else "")


def rows_from_dataset(dataset: Any, skip_invalid: bool = False, split: str = "train") -> list[dict[str, Any]]:
    """Rows from a SimplePromptDataset, a `datasets.Dataset` or `DatasetDict` (its `split`, or its only
    split), a list of dicts or a list of strings."""
    if _is_dataset_dict(dataset):
        splits = list(dataset.keys())
        chosen = split if split in splits else splits[0] if len(splits) == 1 else None
        if chosen is None:
            raise ConfigError(
                f"The DatasetDict has splits {splits} and none is named '{split}': pass one split, "
                f"e.g. dataset['{splits[0]}']."
            )
        dataset = dataset[chosen]
    if isinstance(dataset, SimplePromptDataset):
        dataset = [dataset[i] for i in range(len(dataset))]
    if hasattr(dataset, "to_list"):
        dataset = dataset.to_list()
    dataset = [{"prompt": r} if isinstance(r, str) else r for r in dataset]
    return normalise_rows(dataset, None, None, source="train_dataset", skip_invalid=skip_invalid)


def _is_dataset_dict(dataset: Any) -> bool:
    return (
        hasattr(dataset, "keys")
        and hasattr(dataset, "values")
        and all(hasattr(part, "to_list") for part in dataset.values())
    )
