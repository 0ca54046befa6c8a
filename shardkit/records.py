"""Reading the append-only JSONL logs a run writes (`metrics.jsonl`, sample-id logs), as a crash leaves them.

A process killed while appending leaves its last line cut short (no newline at its end, not valid JSON):
that record was never complete, so it is dropped with a warning naming the file, and the run can resume.
Damage anywhere else (a line in the middle that is not a JSON object) was not made by a crash: it raises a
`ValueError` naming the file and the line, rather than being skipped silently.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def read_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number from 1, record) for every record of the JSONL file at `path`; blank lines are skipped.

    Raises:
        ValueError: a line other than a torn last one is not a JSON object (the message names file and line).
        OSError: the file cannot be read.
    """
    lines = Path(path).read_bytes().split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
            if number == len(lines):  # no newline after it: a write cut short by a crash
                logger.warning("%s: dropping its last line, a record a crash left half-written (%d bytes)",
                               path, len(raw))
                continue
            raise ValueError(f"{path} line {number} is damaged ({err}): only a torn last line is "
                             "tolerated; repair or remove that line") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number} is damaged (a JSON {type(record).__name__}, not an object)")
        records.append((number, record))
    return records
