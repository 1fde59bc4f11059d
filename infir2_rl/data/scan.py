"""A quick pass over a data file, before Ray starts: are there enough usable rows for one batch?

The stage itself loads its data with the tokenizer (``datasets.py``); that needs the stage's model, which
for every stage but the first is the previous stage's output. This scan needs no tokenizer: it applies
every row check that does not depend on token counts (readable UTF-8 JSON object, the configured keys,
chat-message shape, a string or number label) and counts what passes, so that a pipeline refuses a data
file of stage 4 in seconds instead of after stages 1-3. Rows too long in tokens are only known at load
time: the count here is an upper bound, and the stage checks again after loading.
"""

from __future__ import annotations

from pathlib import Path

from infir2_rl.data.datasets import (
    LoadReport,
    _check_messages,
    _finish,
    _get,
    _label_text,
    _record_skip,
    _Skip,
)
from infir2_rl.data.readers import FileFormat, read_records


def scan_sft_rows(
    path: str | Path, *, messages_key: str = "messages", format: FileFormat = "auto"
) -> LoadReport:
    """Rows of an SFT file with a usable chat (an assistant turn to train on); raises if none is usable."""
    report = LoadReport(path=str(path))
    for row in read_records(path, format):
        report.num_rows += 1
        try:
            messages = _check_messages(_get(row, messages_key), messages_key)
            if not any(m["role"] == "assistant" for m in messages):
                raise _Skip("bad_format", f"{messages_key!r} has no assistant message to train on")
        except _Skip as skip:
            _record_skip(report, row, skip)
            continue
        report.num_kept += 1
    _finish(report, "SFT")
    return report


def scan_prompt_rows(
    path: str | Path, *, input_key: str = "prompt", label_key: str = "label", format: FileFormat = "auto"
) -> LoadReport:
    """Rows of an RL prompt file with a usable prompt and label; raises if none is usable."""
    report = LoadReport(path=str(path))
    for row in read_records(path, format):
        report.num_rows += 1
        try:
            prompt = _get(row, input_key)
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise _Skip("empty_text", f"{input_key!r} is empty")
            else:
                _check_messages(prompt, input_key)
            if not _label_text(_get(row, label_key), label_key):
                raise _Skip("empty_text", f"{label_key!r} is empty")
        except _Skip as skip:
            _record_skip(report, row, skip)
            continue
        report.num_kept += 1
    _finish(report, "prompt")
    return report


def check_fills_batch(report: LoadReport, batch_size: int, batch_field: str, *, loaded: bool = False) -> None:
    """Raise ValueError when the usable rows of ``report`` cannot fill one batch of ``batch_size``."""
    if report.num_kept >= batch_size:
        return
    what = "usable rows" if loaded else "rows that can be used (at most)"
    raise ValueError(
        f"data.train_path={report.path!r}: {report.num_kept} {what} of {report.num_rows} (skipped:"
        f" {report.skip_counts()}), fewer than one batch of {batch_field}={batch_size}: the stage would"
        f" train nothing; add rows or lower {batch_field}"
    )
