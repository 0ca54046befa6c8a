"""Text inputs: expand INPUT arguments into files, and cut each file into ordered work units.

Recognised by name: ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (one JSON object per line, the text in
``--text-field``), ``.parquet`` (the ``--text-field`` column) and ``.txt``. A ``.txt`` document is the
whole file (``--txt-mode file``, the default) or each paragraph, i.e. each run of lines separated by
one or more blank lines, with ``\\n`` or ``\\r\\n`` line ends (``--txt-mode paragraph``). A record is held whole only up
to a bound (a JSONL line: `max_line_bytes`; a .txt file or paragraph: `max_text_bytes`); a longer one is rejected
while it is read.

In the build this module runs in the parent process only: it reads and decompresses the files and hands raw
line ranges (or Parquet column slices) to workers, which parse and tokenize them
(`shardkit.text.documents`). Work units depend only on the file contents and `unit_bytes`, never
on the number of workers, so the build's output does not either.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import posixpath
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec

from shardkit.hashing import read_pieces, sha256_pieces
from shardkit.storage import open_filesystem, redact_url, retry_call
from shardkit.wording import inputs_name, option

logger = logging.getLogger(__name__)

SUFFIXES = {".jsonl": ("jsonl", None), ".jsonl.gz": ("jsonl", "gzip"), ".jsonl.zst": ("jsonl", "zstd"),
            ".parquet": ("parquet", None), ".txt": ("txt", None)}
TXT_MODES = ("file", "paragraph")
_GLOB_CHARS = "*?["


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One input file: its URL (a plain path for local files), reader kind, compression, size and the
    SHA-256 of its bytes (None unless asked for: it costs one read of the file).

    Attributes:
        name: the file's path relative to the root of the INPUT that named it (a directory, a glob's directory,
            or a named file's directory): the same wherever the corpus is mounted.
        change_marker: what the store says changes with the file's content, as listed: 'etag:...' (object
            stores), 'mtime:...' (file systems), or None where it gives neither. Every read checks the size and
            this against the file it opens (`InputChangedError`).
    """

    url: str
    kind: str
    compression: str | None
    size: int
    sha256: str | None = None
    name: str = ""
    change_marker: str | None = None

    def record(self) -> dict[str, Any]:
        """The file as the build record names it: an edit of any byte changes the record."""
        return {"url": self.url, "bytes": self.size, "sha256": self.sha256}

    def listing(self) -> dict[str, Any]:
        """What the listing saw, as plain data: {"name", "size", "change_marker"}."""
        return {"name": self.name, "size": self.size, "change_marker": self.change_marker}


class InputChangedError(OSError):
    """An input file is not the one listed: its size or change marker differs (it was cut, appended to or
    replaced since), so the units cut from the listing would read short, past its end or other bytes."""


def change_marker(info: dict[str, Any]) -> str | None:
    """What changes with a file's content in a store's `info()`: its ETag, else its modification time."""
    for key in ("ETag", "etag", "e_tag"):
        if info.get(key):
            return f"etag:{str(info[key]).strip(chr(34))}"
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) is not None:
            return f"mtime:{info[key]}"
    return None


@dataclass(frozen=True, kw_only=True)
class WorkUnit:
    """A slice of one input file, the unit of parallel work.

    Attributes:
        index: position in the build's unit sequence (results are consumed in this order).
        source: index of the file in the build's input list (the manifest's `sources`).
        file_unit: position of this unit within its file (resumption skips this many).
        kind: "jsonl", "parquet", "txt" or "txt-paragraph".
        first_record: index (0-based) of the first line / row / paragraph in `payload`.
        payload: raw bytes of whole lines (jsonl, txt) or a list of column values (parquet).
        rejected: records rejected while reading, as (record index, reason), e.g. an oversized line.
        file_error: a read error that ended this file early (truncated, corrupt, unreadable).
        input_offset: bytes of the (compressed) input file consumed once this unit is read.
    """

    index: int
    source: int
    file_unit: int
    kind: str
    first_record: int
    payload: Any = b""
    rejected: tuple[tuple[int, str], ...] = ()
    file_error: str | None = None
    input_offset: int = 0
    records_in_payload: int = field(default=0)


def classify(name: str) -> tuple[str, str | None] | None:
    """(kind, compression) of a file name, or None when it is not a recognised input."""
    lower = name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return SUFFIXES[suffix]
    return None


def _display(fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocol or "local" in protocol:
        return path
    return fs.unstrip_protocol(path)


def content_sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """SHA-256 of a file's bytes, read in pieces (memory stays flat whatever the file's size)."""
    with _RetryingInput(fs, path, redact_url(_display(fs, path))) as fh:
        return sha256_pieces(read_pieces(fh))[1].hexdigest()


def expand_inputs(patterns: Sequence[str], storage_options: dict[str, Any] | None = None, *,
                  content_hashes: bool = False) -> list[InputFile]:
    """Expand files, directories (recursively), globs and fsspec URLs into a deterministic file list.

    Inputs keep the order they are given in; the files of one directory or glob are sorted by path.
    With `content_hashes`, each file's SHA-256 is computed (one streaming read): the build fingerprint
    holds it, so a resumed build notices an input edited in place even when its size is unchanged.

    Raises:
        FileNotFoundError: an input matches nothing.
        ValueError: an explicitly named file has an unrecognised suffix, or a file is named twice.
    """
    if not patterns:
        raise ValueError(f"give at least one of {inputs_name()} (file, directory, glob or URL)")
    files: list[InputFile] = []
    seen: dict[str, str] = {}
    for pattern in patterns:
        fs, path = open_filesystem(pattern, storage_options)
        matches, explicit = retry_call(functools.partial(_matches, fs, path), url=redact_url(pattern), what="list")
        if matches is None:
            raise FileNotFoundError(f"{inputs_name()} {pattern}: no such file, directory or URL")
        chosen = []
        for match in matches:
            kind = classify(match)
            if kind is None:
                if explicit:
                    raise ValueError(f"{inputs_name()} {pattern}: unrecognised file type (expected one of "
                                     f"{', '.join(SUFFIXES)})")
                logger.info("skipping %s: not a recognised input type", match)
                continue
            chosen.append((match, kind))
        if not chosen:
            raise FileNotFoundError(f"{inputs_name()} {pattern}: matches no {'/'.join(SUFFIXES)} file")
        for match, (kind, compression) in chosen:
            url = _display(fs, match)
            if url in seen:
                raise ValueError(f"{inputs_name()} {url} is named twice (by {seen[url]!r} and {pattern!r}); "
                                 "each file may appear once")
            seen[url] = pattern
            try:
                digest = content_sha256(fs, match) if content_hashes else None
            except OSError as err:
                raise OSError(f"{inputs_name()} {url}: cannot read it to fingerprint its content: "
                              f"{_describe(err)}") from err
            info = retry_call(functools.partial(fs.info, match), url=redact_url(url), what="stat")
            files.append(InputFile(url=url, kind=kind, compression=compression, size=int(info["size"]),
                                   sha256=digest, name=posixpath.relpath(match, _input_root(fs, path, explicit)),
                                   change_marker=change_marker(info)))
    return files


def _input_root(fs: fsspec.AbstractFileSystem, path: str, explicit: bool) -> str:
    """The directory an INPUT's files are named relative to: a named file's, a directory itself, a glob's
    directory before its first wildcard."""
    glob_at = min((path.index(c) for c in _GLOB_CHARS if c in path), default=None)
    if glob_at is not None:
        return posixpath.dirname(path[:glob_at]) or "."
    return (posixpath.dirname(path) or ".") if explicit else path


def _matches(fs: fsspec.AbstractFileSystem, path: str) -> tuple[list[str] | None, bool]:
    """(files that `path` names, whether it named one file explicitly); None when it names nothing."""
    if any(c in path for c in _GLOB_CHARS):
        return sorted(p for p in fs.glob(path) if not fs.isdir(p)), False
    if fs.isdir(path):
        return sorted(fs.find(path)), False
    if fs.exists(path):
        return [path], True
    return None, False


def open_input(url: str, storage_options: dict[str, Any] | None = None, *,
               listed: InputFile | None = None) -> _RetryingInput:
    """An input file opened for seekable binary reads through the core's retry policy (local or fsspec): the
    build's reader, `shardkit convert`'s and the raw-text loader's. With `listed`, the file's first read raises
    `InputChangedError` when it is not the file listed (its size or change marker differs)."""
    fs, path = open_filesystem(url, storage_options)
    return _RetryingInput(fs, path, redact_url(url), listed=listed)


def max_line_bytes(max_doc_chars: int) -> int:
    """The longest JSON line read whole: up to 6 bytes per character (\\uXXXX escapes) plus other fields."""
    return 6 * max_doc_chars + (1 << 16)


def max_text_bytes(max_doc_chars: int) -> int:
    """The most bytes of plain text read whole for one document (a .txt file or paragraph): up to 4 bytes per
    character in UTF-8, so anything longer is over `max_doc_chars` whatever it holds."""
    return 4 * max_doc_chars


def long_line_reason(limit: int, record: str = "line") -> str:
    """Why a line (or paragraph) longer than `limit` bytes is rejected (the build's and the raw-text loader's
    words)."""
    return f"{record} is longer than {limit} bytes (raise {option('max_doc_chars')} to accept it)"


class _RetryingInput(io.RawIOBase):
    """An input file read through the core's `retry_call`, like every other storage call: a transient
    failure reopens the file at the offset already reached and reads again, so a long streaming read
    of a remote input gets the same retry policy and deadline as the shards (and s3fs's and botocore's
    own retries stay off, see `shardkit.storage.open_filesystem`)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, url: str, *, listed: InputFile | None = None):
        super().__init__()
        self._fs, self._path, self._url = fs, path, url
        self._file = None
        self._position = 0
        self._listed = listed
        self._unchecked = False  # opened since the last check against `listed`

    def _attempt(self, operation):
        def call():
            if self._file is None:
                self._file = self._fs.open(self._path, "rb")
                self._unchecked = self._listed is not None
                if self._position:
                    self._file.seek(self._position)
            try:
                return operation(self._file)
            except Exception:
                self._discard()  # the next try reopens at self._position
                raise
        result = retry_call(call, url=self._url, what="read")
        if self._unchecked:  # outside the retries: a changed file is no transient failure
            self._unchecked = False
            self._check_listed()
        return result

    def _check_listed(self) -> None:
        """Raise `InputChangedError` when the opened file is not the one listed (an object store's open file
        holds its details already; elsewhere one stat)."""
        listed = self._listed
        info = getattr(self._file, "details", None) or retry_call(
            functools.partial(self._fs.info, self._path), url=self._url, what="stat")
        size, marker = int(info.get("size", listed.size)), change_marker(info)
        if size != listed.size:
            change = f"{listed.size:,} bytes when listed, {size:,} now"
        elif marker != listed.change_marker and None not in (marker, listed.change_marker):
            change = f"same size, but {listed.change_marker} when listed, {marker} now"
        else:
            return
        raise InputChangedError(f"it changed since it was listed ({change}): its units were cut from the listing; "
                                "restore the file, or list the inputs as they are now (a new loader)")

    def _discard(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(Exception):
                file.close()

    def read(self, size: int = -1) -> bytes:
        data = self._attempt(lambda file: file.read(size))
        self._position += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        def seek(file) -> int:
            file.seek(offset, whence)
            return file.tell()
        self._position = self._attempt(seek)
        return self._position

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self._discard()
        super().close()


def _decompressing(raw, compression: str | None):
    if compression == "gzip":
        return _FrameStream(raw, "gzip")
    if compression == "zstd":
        return _FrameStream(raw, "zstd")
    return raw


class TruncatedInputError(EOFError):
    """A compressed input ends in the middle of a frame."""


class _FrameStream:
    """Reads concatenated gzip members or zstd frames and raises when the input ends inside one (a
    truncated download or copy would otherwise look like a shorter file). Unlike `gzip.GzipFile`, it
    hands over every byte decompressed before an error, so every complete record of a damaged file is
    read (and counted) before the file is reported unreadable: a failed call to the decompressor returns
    nothing, so the frame it failed in is decompressed again from its start, the failed chunk in small steps,
    up to the damage (`_salvage`)."""

    _STEP = 64  # compressed bytes per call when the failed chunk is decompressed again

    def __init__(self, raw, codec: str, chunk: int = 1 << 20):
        if codec == "zstd":
            import zstandard

            self._new = lambda: zstandard.ZstdDecompressor().decompressobj()
            self._errors: tuple[type[BaseException], ...] = (zstandard.ZstdError,)
        else:
            import zlib

            self._new = lambda: zlib.decompressobj(wbits=31)  # 31: the gzip container
            self._errors = (zlib.error,)
        self._codec = codec
        self._raw = raw
        self._chunk = chunk
        self._obj = self._new()
        self._in_frame = False
        self._raw_pos = 0  # compressed bytes read
        self._frame_start, self._frame_out = 0, 0  # where the current frame began, what it gave so far
        self._data = b""
        self._pos = 0
        self._pieces: list[bytes] = []
        self._failure: BaseException | None = None

    def read(self, size: int) -> bytes:
        while len(self._data) - self._pos < size and self._failure is None:
            start = self._raw_pos
            data = self._raw.read(self._chunk)
            self._raw_pos += len(data)
            if not data:
                if self._in_frame:
                    self._failure = TruncatedInputError(f"{self._codec} stream ends inside a frame (file truncated)")
                break
            try:
                self._feed(data, start)
            except ValueError as err:
                self._salvage(data, start)
                self._failure = err  # raised once what was decompressed before it has been read
            self._data = b"".join([self._data[self._pos:], *self._pieces])
            self._pos = 0
            self._pieces = []
        out = self._data[self._pos:self._pos + size]
        self._pos += len(out)
        if not out and self._failure is not None:
            raise self._failure
        return out

    def _feed(self, data: bytes, start: int) -> None:
        offset = 0
        while offset < len(data):
            if not self._in_frame:
                self._frame_start, self._frame_out = start + offset, 0
                self._in_frame = True
            try:
                piece = self._obj.decompress(data[offset:] if offset else data)
            except self._errors as err:
                raise ValueError(f"corrupt {self._codec} data: {err}") from err
            self._pieces.append(piece)
            self._frame_out += len(piece)
            if not self._obj.eof:
                return
            offset = len(data) - len(self._obj.unused_data)
            self._obj = self._new()
            self._in_frame = False

    def _salvage(self, data: bytes, start: int) -> None:
        """Add what the failed frame decompresses to before the damage, past what it gave already: the frame's
        bytes before the failed chunk (read again) in large calls, the chunk's in `_STEP`-byte calls."""
        if not (hasattr(self._raw, "seek") and self._raw.seekable()):
            return
        obj, recovered = self._new(), []
        try:
            self._raw.seek(self._frame_start)
            while self._raw.tell() < start:
                recovered.append(obj.decompress(self._raw.read(min(self._chunk, start - self._raw.tell()))))
            tail = data[max(0, self._frame_start - start):]
            for offset in range(0, len(tail), self._STEP):
                recovered.append(obj.decompress(tail[offset:offset + self._STEP]))
                if obj.eof:
                    break
        except (*self._errors, OSError):
            pass  # the damage: everything before it is in `recovered`
        self._pieces.append(b"".join(recovered)[self._frame_out:])


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


@dataclass
class _Cursor:
    """Where the reader is in the global unit sequence."""

    next_index: int


class _LineEnds:
    """Where a JSONL record ends: at each line end."""

    record = "line"

    @staticmethod
    def last_end(data: bytes, carried: int) -> int:
        """The offset just past the last record end in `data`, 0 when there is none; its first `carried` bytes
        (the carry, which begins at a record start) hold none."""
        return data.rfind(b"\n", carried) + 1

    @staticmethod
    def first_end(data: bytes, line_start: bool) -> int:
        """The offset just past the first record end in `data`, 0 when there is none."""
        return data.find(b"\n") + 1

    @staticmethod
    def line_start_after(data: bytes, line_start: bool) -> bool:
        return False  # a line ends at its newline, whatever came before it

    @staticmethod
    def count(body: bytes) -> int:
        return body.count(b"\n")


# A line end, then a line that is empty or holds only whitespace (what bytes.strip() removes), up to its own end.
_BLANK_LINE = re.compile(rb"\n[ \t\r\x0b\x0c]*(?=\n)")
_LEADING_BLANK_LINE = re.compile(rb"[ \t\r\x0b\x0c]*\n")


class _ParagraphEnds:
    """Where a .txt paragraph ends: at a blank line, as `_paragraphs` splits them, so `\\n\\n`, `\\r\\n\\r\\n`,
    their mixtures and whitespace-only lines alike. `data` begins at a line start where `line_start` says so (a
    carry always does)."""

    record = "paragraph"

    @staticmethod
    def last_end(data: bytes, carried: int) -> int:
        # The carry holds no blank line, so one ending in the new bytes begins at its last line end at the earliest.
        start = data.rfind(b"\n", 0, carried)
        end = 0
        if start < 0 and (leading := _LEADING_BLANK_LINE.match(data)):
            end = leading.end()
        for match in _BLANK_LINE.finditer(data, max(start, 0)):
            end = match.end() + 1
        return end

    @staticmethod
    def first_end(data: bytes, line_start: bool) -> int:
        if line_start and (leading := _LEADING_BLANK_LINE.match(data)):
            return leading.end()
        match = _BLANK_LINE.search(data)
        return match.end() + 1 if match else 0

    @staticmethod
    def line_start_after(data: bytes, line_start: bool) -> bool:
        """Whether bytes after `data` stand at a line start as far as blank lines can tell: its last line so far
        is empty or whitespace only (that whitespace cannot make the line non-blank), so it need not be kept."""
        last = data.rfind(b"\n")
        return (last >= 0 or line_start) and not data[last + 1:].strip()

    @staticmethod
    def count(body: bytes) -> int:
        return len(_paragraphs(body))


def _line_units(file: InputFile, source: int, cursor: _Cursor, *, kind: str, unit_bytes: int, limit: int,
                storage_options: dict[str, Any] | None, skip_units: int) -> Iterator[WorkUnit]:
    """Units of whole lines (jsonl) or whole paragraphs (txt paragraph mode).

    A record longer than `limit` bytes is rejected while it is read, never held whole: its bytes are dropped up to
    its end, so memory stays within `limit` plus a unit whatever the input holds."""
    ends = _LineEnds if kind == "jsonl" else _ParagraphEnds
    file_unit = 0
    record = 0  # lines for jsonl, paragraphs for txt-paragraph

    def unit(**kwargs) -> WorkUnit | None:
        nonlocal file_unit
        file_unit += 1
        if file_unit <= skip_units:
            return None
        made = WorkUnit(index=cursor.next_index, source=source, file_unit=file_unit - 1, kind=kind, **kwargs)
        cursor.next_index += 1
        return made

    raw = None
    carry = b""
    discarding = False  # inside an oversized record, dropping bytes until its end
    line_start = True  # while discarding: the bytes dropped so far end at a line start (or in whitespace after one)
    reached = 0  # input bytes consumed as of the last unit: the report checks they add up to the file's size
    try:
        raw = open_input(file.url, storage_options, listed=file)
        stream = _decompressing(raw, file.compression)
        while True:
            block = stream.read(unit_bytes)
            if not block:
                break
            if discarding:
                end = ends.first_end(block, line_start)
                if not end:
                    line_start = ends.line_start_after(block, line_start)
                    continue
                discarding = False
                block = block[end:]
            data = carry + block if carry else block
            cut = ends.last_end(data, len(carry))
            if cut:
                body, carry = data[:cut], data[cut:]
                n = ends.count(body)
                reached = raw.tell()
                made = unit(first_record=record, payload=body, input_offset=reached, records_in_payload=n)
                record += n
                if made is not None:
                    yield made
            else:
                carry = data
            if len(carry) > limit:
                discarding, line_start = True, ends.line_start_after(carry, True)
                carry = b""
                reached = raw.tell()
                reason = long_line_reason(limit, ends.record)
                made = unit(first_record=record, payload=b"", rejected=((record, reason),), input_offset=reached,
                            records_in_payload=0)
                record += 1
                if made is not None:
                    yield made
        end = raw.tell()
        if carry or end > reached:
            n = ends.count(carry if carry.endswith(b"\n") else carry + b"\n") if carry else 0
            made = unit(first_record=record, payload=carry, input_offset=end, records_in_payload=n)
            record += n
            if made is not None:
                yield made
    except (OSError, EOFError, ValueError, RuntimeError) as err:
        # zstandard raises ZstdError (a RuntimeError/ValueError subclass by version), gzip EOFError.
        partial = ((record, f"incomplete record at the end of a truncated or corrupt file ({_describe(err)})"),) \
            if carry else ()
        made = unit(first_record=record, payload=b"", rejected=partial, records_in_payload=0,
                    file_error=f"read failed after {record} complete records: {_describe(err)}",
                    input_offset=reached)
        if made is not None:
            yield made
    finally:
        if raw is not None:
            raw.close()


def _paragraphs(body: bytes) -> list[bytes]:
    """Split text into paragraphs: runs of lines separated by lines that are empty or whitespace (so `\\r\\n`
    line ends split alike; a paragraph's last line end, `\\r` included, is not part of it)."""
    paragraphs, current = [], []
    for line in body.split(b"\n"):
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append(_joined(current))
            current = []
    if current:
        paragraphs.append(_joined(current))
    return paragraphs


def _joined(lines: list[bytes]) -> bytes:
    paragraph = b"\n".join(lines)
    return paragraph[:-1] if paragraph.endswith(b"\r") else paragraph


def _whole_file_unit(file: InputFile, source: int, cursor: _Cursor, *, max_bytes: int,
                     storage_options: dict[str, Any] | None, skip_units: int) -> Iterator[WorkUnit]:
    if skip_units:
        return
    index = cursor.next_index
    cursor.next_index += 1
    if file.size > max_bytes:
        reason = f"file is {file.size} bytes, over the {max_bytes} allowed for one document ({option('max_doc_chars')})"
        yield WorkUnit(index=index, source=source, file_unit=0, kind="txt", first_record=0,
                       rejected=((0, reason),), input_offset=file.size)
        return
    try:
        with open_input(file.url, storage_options, listed=file) as raw:
            data = raw.read()
    except OSError as err:
        yield WorkUnit(index=index, source=source, file_unit=0, kind="txt", first_record=0,
                       file_error=f"read failed: {_describe(err)}", input_offset=0)
        return
    yield WorkUnit(index=index, source=source, file_unit=0, kind="txt", first_record=0, payload=data,
                   input_offset=len(data), records_in_payload=1)


def _parquet_units(file: InputFile, source: int, cursor: _Cursor, *, text_field: str, rows_per_unit: int,
                   storage_options: dict[str, Any] | None, skip_units: int) -> Iterator[WorkUnit]:
    import pyarrow.parquet as pq

    file_unit = 0
    record = 0
    reached = 0
    pending: WorkUnit | None = None  # held back one batch: the last one says the whole file was read
    try:
        with open_input(file.url, storage_options, listed=file) as raw:
            parquet = pq.ParquetFile(raw)
            if text_field not in parquet.schema_arrow.names:
                raise ValueError(f"no column {text_field!r} (columns: {', '.join(parquet.schema_arrow.names)}); "
                                 f"choose one with {option('text_field')}")
            for batch in parquet.iter_batches(batch_size=rows_per_unit, columns=[text_field]):
                rows = batch.num_rows
                file_unit += 1
                if pending is not None:
                    yield pending
                    reached = pending.input_offset
                    pending = None
                if file_unit > skip_units:
                    pending = WorkUnit(index=cursor.next_index, source=source, file_unit=file_unit - 1,
                                       kind="parquet", first_record=record, payload=batch.column(0),
                                       input_offset=min(file.size, raw.tell()), records_in_payload=rows)
                    cursor.next_index += 1
                record += rows
            if pending is None and file_unit == 0:  # no rows at all: one empty unit says the file was read
                file_unit += 1
                if file_unit > skip_units:
                    pending = WorkUnit(index=cursor.next_index, source=source, file_unit=0, kind="parquet",
                                       first_record=0, payload=(), input_offset=file.size)
                    cursor.next_index += 1
        if pending is not None:
            yield replace(pending, input_offset=file.size)
    except (OSError, ValueError, RuntimeError) as err:
        if pending is not None:  # read, but the file failed after it: the rows count, the bytes do not
            yield pending
            reached = pending.input_offset
        file_unit += 1
        if file_unit > skip_units:
            yield WorkUnit(index=cursor.next_index, source=source, file_unit=file_unit - 1, kind="parquet",
                           first_record=record, file_error=f"read failed after {record} rows: {_describe(err)}",
                           input_offset=reached)
            cursor.next_index += 1


def iter_units(files: Sequence[InputFile], *, text_field: str = "text", txt_mode: str = "file",
               unit_bytes: int = 1 << 20, max_doc_chars: int = 10_000_000,
               storage_options: dict[str, Any] | None = None,
               start: tuple[int, int, int] = (0, 0, 0)) -> Iterator[WorkUnit]:
    """Yield the work units of `files`, in order.

    Args:
        files: from `expand_inputs`.
        text_field: JSON key / Parquet column holding the text.
        txt_mode: "file" (a .txt file is one document) or "paragraph".
        unit_bytes: approximate decompressed bytes per unit (a unit always ends at a record boundary).
        max_doc_chars: documents longer than this are rejected; lines far longer are dropped while reading.
        storage_options: fsspec options for remote inputs.
        start: (unit index, file index, units to skip in that file) to resume from.
    """
    if txt_mode not in TXT_MODES:
        raise ValueError(f"{option('txt_mode')} must be one of {TXT_MODES}, got {txt_mode!r}")
    first_index, first_file, skip = start
    cursor = _Cursor(first_index)
    line_limit = max_line_bytes(max_doc_chars)
    rows_per_unit = max(64, unit_bytes // 2048)
    for source in range(first_file, len(files)):
        file = files[source]
        skip_units = skip if source == first_file else 0
        if file.kind == "jsonl" or (file.kind == "txt" and txt_mode == "paragraph"):
            kind = "jsonl" if file.kind == "jsonl" else "txt-paragraph"
            limit = line_limit if kind == "jsonl" else max_text_bytes(max_doc_chars)
            yield from _line_units(file, source, cursor, kind=kind, unit_bytes=unit_bytes, limit=limit,
                                   storage_options=storage_options, skip_units=skip_units)
        elif file.kind == "txt":
            yield from _whole_file_unit(file, source, cursor, max_bytes=max_text_bytes(max_doc_chars),
                                        storage_options=storage_options, skip_units=skip_units)
        else:
            yield from _parquet_units(file, source, cursor, text_field=text_field, rows_per_unit=rows_per_unit,
                                      storage_options=storage_options, skip_units=skip_units)
