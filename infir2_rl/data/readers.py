"""Row readers for jsonl and parquet files, yielding every row with its parse error (if any).

Readers never drop rows themselves: a row that is not valid JSON, or a jsonl line that is not valid
UTF-8, comes back as a `RawRow` with `error` and `reason` set, so the dataset builders can count and log
every skipped row by reason. (Replacing undecodable bytes with U+FFFD would train on corrupted text
without a trace.) Parquet strings are UTF-8 by the format, checked by pyarrow.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

FileFormat = Literal["auto", "jsonl", "parquet"]
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class RawRow:
    """One row of an input file: `data` when it parsed as an object, else `error` says why not."""

    # 1-based line number (jsonl) or row number (parquet), for log messages.
    row: int
    data: dict[str, Any] | None
    error: str | None = None
    # The skip counter an unreadable row goes to: "invalid_json" or "bad_encoding".
    reason: str = "invalid_json"


def resolve_format(path: str | Path, format: FileFormat = "auto") -> Literal["jsonl", "parquet"]:
    """The concrete format of `path`: `format` itself, or guessed from the file extension."""
    if format == "jsonl" or format == "parquet":
        return format
    if format != "auto":
        raise ValueError(f"format={format!r} is not supported: use 'auto', 'jsonl' or 'parquet'")
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(
            f"path={str(path)!r} has extension {suffix!r}: rename it to .jsonl or .parquet or set the format"
        )
    return _SUFFIXES[suffix]  # type: ignore[return-value]


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.start + 4]
                yield RawRow(
                    row=line_no,
                    data=None,
                    error=f"not UTF-8 (byte {bad[:1].hex()} at column {exc.start + 1}: {exc.reason})",
                    reason="bad_encoding",
                )
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                yield RawRow(row=line_no, data=None, error=f"invalid JSON ({exc.msg})")
                continue
            if not isinstance(value, dict):
                yield RawRow(row=line_no, data=None, error=f"a JSON {type(value).__name__}, not an object")
                continue
            yield RawRow(row=line_no, data=value)


def _read_parquet(path: Path, batch_size: int = 4096) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    row_no = 0
    # Batches keep memory bounded on large files; nested columns (list<struct>) become lists of dicts.
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        for value in batch.to_pylist():
            row_no += 1
            yield RawRow(row=row_no, data=value)


def read_records(path: str | Path, format: FileFormat = "auto") -> Iterator[RawRow]:
    """Yield every row of a jsonl or parquet file (blank jsonl lines are not rows)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"path={str(p)!r} does not exist or is not a file: check the data path")
    if resolve_format(p, format) == "parquet":
        return _read_parquet(p)
    return _read_jsonl(p)
