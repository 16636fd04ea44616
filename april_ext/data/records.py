"""Reading prompt records (dicts) from JSONL and Parquet files, with errors that name file and line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import IO, Any

from april_ext.errors import InvalidArgumentError

FORMATS = ("jsonl", "parquet")


def detect_format(path: str | os.PathLike[str]) -> str:
    name = os.fspath(path).lower()
    if name.endswith((".jsonl", ".json", ".jsonl.txt", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise InvalidArgumentError(f"cannot tell the format of {os.fspath(path)!r} from its name: expected a "
                               f"name ending in .jsonl / .ndjson / .json (JSON lines) or .parquet / .pq")


def read_records(path: str | os.PathLike[str], fmt: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields (line or row number counted from 1, record) of a JSONL or Parquet file."""
    path = os.fspath(path)
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if not os.path.isfile(path):
        raise InvalidArgumentError(f"prompt file {path!r} does not exist")
    if fmt == "jsonl":
        yield from _read_jsonl(path)
    else:
        yield from _read_parquet(path)


def _read_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as handle:
        for line_no, line in _numbered_lines(handle, path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InvalidArgumentError(f"{path}:{line_no}: invalid JSON ({err.msg} at column {err.colno})") \
                    from None
            if not isinstance(record, dict):
                raise InvalidArgumentError(f"{path}:{line_no}: expected a JSON object per line, got "
                                           f"{type(record).__name__}")
            yield line_no, record


def _numbered_lines(handle: IO[str], path: str) -> Iterator[tuple[int, str]]:
    try:
        yield from enumerate(handle, start=1)
    except UnicodeDecodeError as err:
        raise InvalidArgumentError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _read_parquet(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise InvalidArgumentError("reading Parquet needs pyarrow: pip install 'april_ext[data]'") from err
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types (ArrowInvalid, OSError) for unreadable files
        raise InvalidArgumentError(f"{path}: not a readable Parquet file ({err})") from None
    row = 0
    for batch in parquet.iter_batches():
        for record in batch.to_pylist():
            row += 1
            yield row, record


def lookup(record: dict[str, Any], key: str, *, where: str) -> Any:
    """record[key], where a dotted key ("reward_model.ground_truth") walks nested objects."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            available = sorted(value) if isinstance(value, dict) else []
            raise InvalidArgumentError(f"{where}: record has no key {key!r} (available: {available})")
        value = value[part]
    return value
