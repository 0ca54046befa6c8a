"""The raw-text loader's work units, listed without reading the corpus, and read one at a time.

Listing (`list_units`) costs a stat per file and, for Parquet, its footer (and a small read per byte range):
- an uncompressed JSONL file is cut into byte ranges of `unit_bytes`; a line belongs to the range its first byte
  lies in, so range k is found by seeking to its start and reading on to the next newline (at most one line before
  it is read), and ends with the line that crosses its end (`read_range`). Listing finds each range's first line
  start so (a small read per range of the file, `_range_bounds`): a range holding none (a line longer than a unit
  runs across it) is merged into the range before it, whose line it belongs to, so every unit holds a line,
  identically on every rank. Its documents are numbered from the range's first line's byte offset (unique in the
  file and found without counting the lines before it; the build numbers lines), so their tokens are the build's,
  and a rejected one is named by the exact byte offset of its line (`record_place`);
- a Parquet file gives one unit per row group (its rows numbered as the build numbers them);
- a .gz / .zst file (not seekable) and a .txt file read by paragraphs are one *streamed* unit each, sized by
  the file's bytes: the lane reader cuts it while reading it once into the build's own units of ~unit_bytes of
  text (`shardkit.text.inputs.iter_units`: line or paragraph aligned), the unit's *segments*. Resuming into
  segment s decompresses and splits the file up to s without tokenizing it;
- a .txt file read whole is one unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.text.documents import record_label
from shardkit.text.inputs import InputFile, WorkUnit, iter_units, long_line_reason, max_line_bytes, open_input

RANGE, ROW_GROUP, STREAMED = "range", "row-group", "streamed"
_SCAN = 1 << 16  # bytes read at a time while looking for a line's end


@dataclass(frozen=True)
class UnitTable:
    """The corpus's units: per unit its file, its kind, its part (range or row group number) and its size."""

    source: np.ndarray
    part: np.ndarray
    size: np.ndarray
    kinds: tuple[str, ...]  # per file: RANGE, ROW_GROUP or STREAMED
    first_rows: tuple[tuple[int, ...], ...]  # per file: the first row of each row group (Parquet only)
    # per file: why its Parquet footer could not be read ("" when it could): the file is one unit whose read
    # fails, so the lane that reaches it raises or skips it under on_corrupt, as the build does
    footer_errors: tuple[str, ...]


def unit_kind(file: InputFile) -> str:
    """How a file is cut into units: RANGE, ROW_GROUP or STREAMED."""
    if file.kind == "parquet":
        return ROW_GROUP
    if file.kind == "jsonl" and file.compression is None:
        return RANGE
    return STREAMED  # compressed JSONL, and .txt (a paragraph stream, or one whole-file unit)


def list_units(files: list[InputFile], *, unit_bytes: int, text_field: str,
               storage_options: dict[str, Any] | None) -> UnitTable:
    """Every file's units in corpus order, from the files' sizes (and Parquet footers).

    A Parquet file whose footer cannot be read is one unit that fails when read (`UnitTable.footer_errors`).

    Raises:
        ValueError: a Parquet file has no `text_field` column.
    """
    sources, parts, sizes, kinds, first_rows, footer_errors = [], [], [], [], [], []
    for source, file in enumerate(files):
        kind = unit_kind(file)
        kinds.append(kind)
        rows: tuple[int, ...] = ()
        footer_error = ""
        if kind == RANGE:
            bounds = _range_bounds(file, unit_bytes, storage_options)
            unit_sizes = [end - begin for _, begin, end in bounds]
        elif kind == ROW_GROUP:
            try:
                groups = _row_groups(file, text_field, storage_options)
            except OSError as err:
                groups, footer_error = [], str(err)
            rows = tuple(np.concatenate([[0], np.cumsum([n for n, _ in groups])[:-1]]).astype(int).tolist()) \
                if groups else ()
            unit_sizes = [size for _, size in groups] or [file.size]
        else:
            unit_sizes = [file.size]
        first_rows.append(rows)
        footer_errors.append(footer_error)
        numbers = [part for part, _, _ in bounds] if kind == RANGE else range(len(unit_sizes))
        for part, size in zip(numbers, unit_sizes):
            sources.append(source)
            parts.append(part)
            sizes.append(max(1, int(size)))
    return UnitTable(source=np.array(sources, dtype=np.int64), part=np.array(parts, dtype=np.int64),
                     size=np.array(sizes, dtype=np.int64), kinds=tuple(kinds), first_rows=tuple(first_rows),
                     footer_errors=tuple(footer_errors))


def _range_bounds(file: InputFile, unit_bytes: int, storage_options: dict[str, Any] | None
                  ) -> list[tuple[int, int, int]]:
    """(range number, first byte, end) of each byte range of an uncompressed JSONL file that holds a line start:
    ranges of `unit_bytes`, those without a line start merged into the range before them. A file that cannot be
    read here keeps its plain ranges (its reads fail, and say so, when a lane reaches them)."""
    count = max(1, -(-file.size // unit_bytes))
    bounds = [[0, 0, min(unit_bytes, file.size)]]
    if count == 1:
        return [tuple(bounds[0])]
    try:
        with open_input(file.url, storage_options) as raw:
            part = 1
            while part < count:
                first = _line_start(raw, part * unit_bytes)
                holder = count if first >= file.size else first // unit_bytes  # the range of the next line start
                if holder > part:  # ranges part .. holder - 1 hold none: the line crossing them is the range's before
                    bounds[-1][2] = min(holder * unit_bytes, file.size)
                    part = holder
                    if part == count:
                        break
                bounds.append([part, part * unit_bytes, min((part + 1) * unit_bytes, file.size)])
                part += 1
    except OSError:
        return [(k, k * unit_bytes, min((k + 1) * unit_bytes, file.size)) for k in range(count)]
    return [tuple(b) for b in bounds]


def _row_groups(file: InputFile, text_field: str, storage_options: dict[str, Any] | None) -> list[tuple[int, int]]:
    """(rows, bytes) of each row group of a Parquet file, from its footer."""
    import pyarrow.parquet as pq

    try:
        with open_input(file.url, storage_options, listed=file) as raw:
            parquet = pq.ParquetFile(raw)
            names = parquet.schema_arrow.names
            meta = parquet.metadata
            groups = [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size)
                      for i in range(meta.num_row_groups)]
    except (OSError, ValueError, RuntimeError) as err:  # pyarrow raises ArrowInvalid (a ValueError) on a bad footer
        raise OSError(f"cannot read its Parquet footer: {type(err).__name__}: {err}") from err
    if text_field not in names:
        raise ValueError(f"{file.url}: no column {text_field!r} (columns: {', '.join(names)}); choose one with "
                         "text_field")
    return groups


def few_lanes_advice(table: UnitTable, files: list[InputFile], num_lanes: int, *, readers: int,
                     lanes_asked: int) -> str | None:
    """Why fewer lanes than readers (ranks x workers) and what to do, or None when there are enough: a reader
    without a lane reads nothing, so those ranks or workers idle."""
    if num_lanes >= readers:
        return None
    streamed = [f for f, kind in zip(files, table.kinds) if kind == STREAMED]
    if num_lanes < lanes_asked and streamed:
        cause = (f"{len(streamed)} of its {len(files)} files are compressed (.gz / .zst) or .txt files, each read "
                 "as one streamed unit")
        fix = ("split the corpus into at least that many files, or give plain .jsonl or Parquet inputs (cut into "
               "byte ranges / row groups of unit_bytes)")
    elif num_lanes < lanes_asked:
        cause = f"its {len(files)} files make only {len(table.size)} units of unit_bytes"
        fix = "give a smaller unit_bytes or more input"
    else:
        cause = f"lanes={lanes_asked}"
        fix = f"give lanes >= {readers}"
    return (f"raw text: the corpus gives {num_lanes} lanes for {readers} readers (ranks x DataLoader workers), so "
            f"at least {readers - num_lanes} of them read nothing: {cause}; for more lanes {fix}")


def unit_place(table: UnitTable, files: list[InputFile], number: int, *, unit_bytes: int) -> str:
    """A unit's file and part, for messages: 'FILE bytes A-B', 'FILE row group G' or 'FILE' (a streamed unit)."""
    source, part = int(table.source[number]), int(table.part[number])
    file, kind = files[source], table.kinds[source]
    if kind == RANGE:
        return f"{file.url} bytes {part * unit_bytes}-{part * unit_bytes + int(table.size[number])}"
    if kind == ROW_GROUP:
        return f"{file.url} row group {part}"
    return file.url


def record_place(unit: WorkUnit, record: int, *, byte_range: bool) -> str:
    """Where record `record` of `unit` is, as the build's report names it ('line N', 'row N', 1-based), but
    'byte offset N' (0-based, the start of its line) in a byte-range unit, whose records are numbered from its
    first line's byte offset: a line number would cost reading the file up to the range."""
    if not byte_range:
        return f"{record_label(unit.kind)} {record + 1}"
    index = record - unit.first_record  # the line's index in the unit's payload
    payload = np.frombuffer(unit.payload, dtype=np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(payload == ord("\n")) + 1])
    return f"byte offset {unit.first_record + int(starts[min(index, len(starts) - 1)])}"


def read_segments(table: UnitTable, files: list[InputFile], number: int, *, skip: int, unit_bytes: int,
                  txt_mode: str, text_field: str, max_doc_chars: int,
                  storage_options: dict[str, Any] | None) -> Iterator[WorkUnit]:
    """Unit `number`'s segments from segment `skip` on, as the build's `WorkUnit`s (one segment unless the unit
    is streamed). A segment's `file_error` is left for the caller to raise."""
    source, part = int(table.source[number]), int(table.part[number])
    file, kind = files[source], table.kinds[source]
    if kind == STREAMED:
        # Only this file (the list ends with it), from its segment `skip`: the build's own units of it.
        yield from iter_units(files[:source + 1], text_field=text_field, txt_mode=txt_mode, unit_bytes=unit_bytes,
                              max_doc_chars=max_doc_chars, storage_options=storage_options,
                              start=(number, source, skip))
        return
    if skip:
        return
    if kind == RANGE:
        yield read_range(file, source, number, part, unit_bytes=unit_bytes, size=int(table.size[number]),
                         line_limit=max_line_bytes(max_doc_chars), storage_options=storage_options)
    else:
        footer_error = table.footer_errors[source]
        if footer_error:
            yield WorkUnit(index=number, source=source, file_unit=0, kind="parquet", first_record=0,
                           file_error=footer_error)
        else:
            yield _read_row_group(file, source, number, part, table.first_rows[source], text_field,
                                  storage_options)


def read_range(file: InputFile, source: int, number: int, part: int, *, unit_bytes: int, size: int, line_limit: int,
               storage_options: dict[str, Any] | None) -> WorkUnit:
    """The lines of an uncompressed JSONL file that start in bytes [part * unit_bytes, part * unit_bytes + size)."""
    begin = part * unit_bytes
    end = min(begin + size, file.size)
    rejected: tuple[tuple[int, str], ...] = ()
    try:
        with open_input(file.url, storage_options, listed=file) as raw:
            first = begin if part == 0 else _line_start(raw, begin)
            if first >= end:  # one line runs across the whole range: it belongs to an earlier one
                return WorkUnit(index=number, source=source, file_unit=part, kind="jsonl", first_record=first)
            raw.seek(first)
            body = raw.read(end - first)
            held = len(body) - (body.rfind(b"\n") + 1)  # the last line's bytes read so far
            tail, complete = _rest_of_line(raw, line_limit - held) if held else (b"", True)
    except OSError as err:
        return WorkUnit(index=number, source=source, file_unit=part, kind="jsonl", first_record=begin,
                        file_error=f"read failed: {type(err).__name__}: {err}")
    if not complete:  # the last line is too long to read whole: rejected as the build rejects it
        cut = body.rfind(b"\n") + 1
        rejected = ((first + body.count(b"\n"), long_line_reason(line_limit)),)
        body = body[:cut]
    else:
        body += tail
    return WorkUnit(index=number, source=source, file_unit=part, kind="jsonl", first_record=first, payload=body,
                    rejected=rejected, records_in_payload=body.count(b"\n") + (not body.endswith(b"\n")))


def _line_start(raw, begin: int) -> int:
    """The offset of the first line that starts at or after `begin` (the file's size when none does)."""
    raw.seek(begin - 1)
    position = begin - 1
    while True:
        block = raw.read(_SCAN)
        if not block:
            return position
        newline = block.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(block)


def _rest_of_line(raw, limit: int) -> tuple[bytes, bool]:
    """The bytes up to and including the next newline (or the file's end); (b"", False) when they are over
    `limit` (the line is not held whole)."""
    pieces, held = [], 0
    while True:
        block = raw.read(_SCAN)
        newline = block.find(b"\n")
        piece = block[:newline + 1] if newline >= 0 else block
        held += len(piece)
        if held > limit:
            return b"", False
        pieces.append(piece)
        if newline >= 0 or not block:
            return b"".join(pieces), True


def _read_row_group(file: InputFile, source: int, number: int, group: int, first_rows: tuple[int, ...],
                    text_field: str, storage_options: dict[str, Any] | None) -> WorkUnit:
    import pyarrow.parquet as pq

    if not first_rows:  # a file without rows: nothing to read
        return WorkUnit(index=number, source=source, file_unit=0, kind="parquet", first_record=0, payload=())
    try:
        with open_input(file.url, storage_options, listed=file) as raw:
            column = pq.ParquetFile(raw).read_row_group(group, columns=[text_field]).column(0)
    except (OSError, ValueError, RuntimeError) as err:
        return WorkUnit(index=number, source=source, file_unit=group, kind="parquet", first_record=first_rows[group],
                        file_error=f"read failed: {type(err).__name__}: {err}")
    return WorkUnit(index=number, source=source, file_unit=group, kind="parquet", first_record=first_rows[group],
                    payload=column, records_in_payload=len(column))
