"""Parse one work unit into documents, check them, tokenize them (the build's worker side).

`tokenize_unit(unit, settings)` is a pure function of its arguments (the tokenizer is loaded once
per process from `settings.tokenizer` and cached), so local processes and Ray tasks give the
same `UnitResult` for the same unit. Results carry numpy arrays, never big Python lists, so
sending them back to the parent is cheap.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from shardkit.text.inputs import WorkUnit, _paragraphs
from shardkit.text.tokenizers import Tokenizer, load_tokenizer
from shardkit.wording import option


@dataclass(frozen=True, kw_only=True)
class DocumentSettings:
    """What a worker needs to turn a unit into tokens (small and picklable).

    Attributes:
        tokenizer: tokenizer spec (see `load_tokenizer`).
        token_dtype: "uint16" or "uint32", the dtype of the returned tokens.
        text_field: JSON key / Parquet column of the text.
        eos_id: appended after every document, or None.
        bos_id: prepended to every document, or None.
        max_doc_chars: longer documents are rejected.
    """

    tokenizer: str
    token_dtype: str
    text_field: str = "text"
    eos_id: int | None = None
    bos_id: int | None = None
    max_doc_chars: int = 10_000_000


@dataclass(frozen=True, kw_only=True)
class UnitResult:
    """The tokenized documents of one unit.

    Attributes:
        index: the unit's index.
        source: the unit's input file index.
        file_unit: the unit's position within its file.
        tokens: every accepted document's tokens (with BOS/EOS), concatenated.
        doc_lengths: tokens per accepted document.
        doc_index: record index (line, row or paragraph, 0-based) of each accepted document.
        rejected: (record index, reason) of each rejected document, in record order.
        documents_in: records seen (accepted + rejected).
        text_chars: characters of accepted text.
        file_error: copied from the unit.
        input_offset: copied from the unit.
    """

    index: int
    source: int
    file_unit: int
    kind: str
    tokens: np.ndarray
    doc_lengths: np.ndarray
    doc_index: np.ndarray
    rejected: tuple[tuple[int, str], ...]
    documents_in: int
    text_chars: int
    file_error: str | None
    input_offset: int


try:  # optional: about 3x faster than json on JSONL lines
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = json.loads

_TOKENIZERS: dict[tuple[str, tuple[int, int] | None], Tokenizer] = {}


def warm_up(spec: str) -> None:
    """Load the tokenizer into this worker process ahead of the first unit."""
    _tokenizer(spec)


def cached_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer for `spec`, loaded once per process."""
    return _tokenizer(spec)


def _tokenizer(spec: str) -> Tokenizer:
    # A tokenizer file replaced in place (retrained) is loaded again: its identity is its content.
    key = (spec, _file_signature(spec))
    cached = _TOKENIZERS.get(key)
    if cached is None:
        # One tokenizer thread per worker process: parallelism comes from the processes.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        cached = _TOKENIZERS[key] = load_tokenizer(spec)
    return cached


def _file_signature(spec: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(spec)
    except (OSError, ValueError):  # a named tokenizer (byte, tiktoken:NAME), not a file
        return None
    return stat.st_mtime_ns, stat.st_size


def unit_records(unit: WorkUnit, text_field: str) -> list[tuple[int, object]]:
    """(record index, raw record) of every record of a unit's payload, in order, without parsing them (a JSONL
    line stays a string; a rejection already found is an `_Reject`): cheap, so a reader that tokenizes a few
    documents at a time parses (`check_records`) only those."""
    if unit.kind == "parquet":
        return [(unit.first_record + i, v if v is not None else _Reject(f"'{text_field}' is null"))
                for i, v in enumerate(_column_values(unit.payload))]
    data: bytes = unit.payload
    if not data:
        return []
    if unit.kind == "txt":
        return [(unit.first_record, _decode(data))]
    if unit.kind == "txt-paragraph":
        return [(unit.first_record + i, _decode(p)) for i, p in enumerate(_paragraphs(data))]
    # jsonl: decode the whole unit at once (fast path); on invalid UTF-8 decode line by line to
    # reject only the bad lines.
    try:
        texts: list = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        texts = [_decode(line) for line in data.split(b"\n")]
    if texts and texts[-1] == "":
        texts.pop()
    return list(enumerate(texts, unit.first_record))


def _value(kind: str, raw: object, text_field: str) -> object:
    """A raw record's text or rejection: a JSONL line parsed, anything else as it is."""
    if kind == "jsonl" and not isinstance(raw, _Reject):
        return _parse_json_line(raw, text_field)
    return raw


def check_records(kind: str, records: list[tuple[int, object]], *, text_field: str, max_doc_chars: int
                  ) -> tuple[list[int], list[str], list[tuple[int, str]]]:
    """(record indices of the accepted documents, their texts, (record, reason) of the rejected ones) of raw
    records of a unit of `kind` (`unit_records`)."""
    settings = DocumentSettings(tokenizer="", token_dtype="uint16", text_field=text_field,
                                max_doc_chars=max_doc_chars)
    accepted_ids: list[int] = []
    texts: list[str] = []
    rejected: list[tuple[int, str]] = []
    for record, raw in records:
        checked = _check(_value(kind, raw, text_field), settings)
        if isinstance(checked, _Reject):
            rejected.append((record, str(checked)))
        else:
            accepted_ids.append(record)
            texts.append(checked)
    return accepted_ids, texts, rejected


def _column_values(column) -> list:
    """The values of a Parquet text column; a row that is not valid UTF-8 becomes a rejection.

    pyarrow does not validate string pages when it reads them, and `to_pylist()` fails for the whole
    batch at the first bad row (a bare UnicodeDecodeError naming no file or row): decode row by row
    then, as the JSONL reader does line by line, so only the bad rows are rejected."""
    if not hasattr(column, "to_pylist"):
        return list(column)
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        import pyarrow as pa

        binary = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
        return [raw if raw is None else _decode(raw) for raw in column.view(binary).to_pylist()]


def reason_category(reason: str) -> str:
    """The kind of a rejection reason, without its specifics ("malformed JSON", "invalid UTF-8", ...): what
    the build's report and a raw-text loader count rejections by."""
    head = reason.split(":", 1)[0].split(" (", 1)[0]
    for marker in (" at byte", " at column", " at character"):
        head = head.split(marker, 1)[0]
    return head.strip()


def record_label(kind: str) -> str:
    """What one record of a unit of this kind is called in messages (`shardkit convert`'s kinds included): the
    build's report and a raw-text loader name records with it."""
    return {"parquet": "row", "txt": "document", "txt-paragraph": "paragraph", "megatron": "document",
            "hf": "row", "mds": "sample", "litdata": "item"}.get(kind, "line")


class _Reject(str):
    """A rejection reason (a str subclass so it travels in the same lists as texts)."""


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        return _Reject(f"invalid UTF-8 at byte {err.start}: {err.reason}")


def _parse_json_line(line: str, text_field: str) -> object:
    if not line or line.isspace():
        return _Reject("blank line (no JSON object)")
    try:
        obj = _fast_loads(line)
    except RecursionError:  # the standard parser's, when orjson is not installed (orjson's is a ValueError)
        return _Reject("malformed JSON: nested too deeply")
    except ValueError:
        # orjson is stricter than json (NaN, huge integers, lone surrogates): the standard parser has the
        # last word, so what is accepted and the reasons given never depend on orjson being installed.
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            return _Reject(f"malformed JSON: {err.msg} at column {err.colno}")
        except RecursionError:
            return _Reject("malformed JSON: nested too deeply")
        except (ValueError, OverflowError) as err:
            # Valid JSON that Python cannot hold: an integer past sys.get_int_max_str_digits() (4,300 digits by
            # default). One such record must not end the build or the loader: it is rejected like any other.
            return _Reject(f"undecodable JSON: {str(err).split(';', 1)[0]}")
    if not isinstance(obj, dict):
        return _Reject(f"not a JSON object (got {type(obj).__name__})")
    if text_field not in obj:
        return _Reject(f"no '{text_field}' field (fields: {', '.join(list(obj)[:8]) or 'none'})")
    text = obj[text_field]
    if not isinstance(text, str):
        return _Reject(f"'{text_field}' is {type(text).__name__}, not a string")
    if "\\ud" in line or "\\uD" in line:  # only escapes can smuggle lone surrogates into a str
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            return _Reject(f"'{text_field}' holds a lone surrogate at character {err.start} (invalid Unicode)")
    return text


def _check(value: object, settings: DocumentSettings) -> str | _Reject:
    if isinstance(value, _Reject):
        return value
    if not isinstance(value, str):
        return _Reject(f"'{settings.text_field}' is {type(value).__name__}, not a string")
    if not value or value.isspace():
        return _Reject("empty document (no text or only whitespace)")
    if len(value) > settings.max_doc_chars:
        return _Reject(f"enormous document: {len(value)} characters, over {option('max_doc_chars')} "
                       f"{settings.max_doc_chars}")
    return value


def parse_unit(unit: WorkUnit, *, text_field: str, max_doc_chars: int
               ) -> tuple[list[int], list[str], list[tuple[int, str]], int]:
    """Split a unit into documents and check them.

    Returns:
        (record indices of accepted documents, their texts, (record, reason) of rejected ones,
        number of records seen).
    """
    records = unit_records(unit, text_field)
    accepted_ids, texts, rejected = check_records(unit.kind, records, text_field=text_field,
                                                  max_doc_chars=max_doc_chars)
    return accepted_ids, texts, [*unit.rejected, *rejected], len(records) + len(unit.rejected)


def tokenize_unit(unit: WorkUnit, settings: DocumentSettings) -> UnitResult:
    """Parse, check and tokenize one unit (runs in a worker process or a Ray task)."""
    accepted_ids, texts, rejected, documents_in = parse_unit(unit, text_field=settings.text_field,
                                                             max_doc_chars=settings.max_doc_chars)
    documents = tokenize_texts(accepted_ids, texts, settings)
    rejected.extend(documents.rejected)
    rejected.sort(key=lambda item: item[0])
    return UnitResult(index=unit.index, source=unit.source, file_unit=unit.file_unit, kind=unit.kind,
                      tokens=documents.tokens, doc_lengths=documents.lengths, doc_index=documents.doc_index,
                      rejected=tuple(rejected), documents_in=documents_in, text_chars=documents.text_chars,
                      file_error=unit.file_error, input_offset=unit.input_offset)


@dataclass(frozen=True)
class TokenizedDocuments:
    """Checked documents tokenized: every kept document's tokens (BOS/EOS included) joined, their lengths and
    record indices, the documents the tokenizer refused or encoded to nothing as (record, reason), and the
    characters of the kept texts."""

    tokens: np.ndarray
    lengths: np.ndarray
    doc_index: np.ndarray
    rejected: list[tuple[int, str]]
    text_chars: int


def tokenize_texts(ids: list[int], texts: list[str], settings: DocumentSettings) -> TokenizedDocuments:
    """Tokenize checked documents (`parse_unit`'s accepted ones, or any run of them: a document's tokens never
    depend on the others in the call, so the build tokenizes a unit at once and the raw-text loader a few
    documents at a time, with the same result)."""
    tokenizer = _tokenizer(settings.tokenizer)
    rejected: list[tuple[int, str]] = []
    try:
        encoded = tokenizer.encode_batch(texts)
    except Exception:  # noqa: BLE001 - find the document(s) the tokenizer refuses, reject only those
        encoded = []
        keep_ids, keep_texts = [], []
        for record, text in zip(ids, texts):
            try:
                encoded.append(tokenizer.encode(text))
                keep_ids.append(record)
                keep_texts.append(text)
            except Exception as err:  # noqa: BLE001
                rejected.append((record, f"tokenizer failed: {type(err).__name__}: {err}"))
        ids, texts = keep_ids, keep_texts
    extra = (settings.bos_id is not None) + (settings.eos_id is not None)
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        for i in empty:
            rejected.append((ids[i], "text encodes to no tokens"))
        keep = lengths > 0
        encoded = [e for e, k in zip(encoded, keep) if k]
        texts = [t for t, k in zip(texts, keep) if k]
        ids = [r for r, k in zip(ids, keep) if k]
        lengths = lengths[keep]
    tokens = _join(encoded, lengths, settings)
    return TokenizedDocuments(tokens=tokens, lengths=lengths + extra, doc_index=np.asarray(ids, dtype=np.int64),
                              rejected=rejected, text_chars=sum(len(t) for t in texts))


def _join(encoded: list[np.ndarray], lengths: np.ndarray, settings: DocumentSettings) -> np.ndarray:
    """Concatenate documents into one array, with BOS before and EOS after each."""
    dtype = np.dtype(settings.token_dtype)
    extra = (settings.bos_id is not None) + (settings.eos_id is not None)
    total = int(lengths.sum()) + extra * len(encoded)
    out = np.empty(total, dtype=dtype)
    if not encoded:
        return out
    if extra == 0:
        np.concatenate(encoded, out=out, casting="unsafe")
        return out
    pieces: list[np.ndarray] = []
    bos = np.array([settings.bos_id], dtype=dtype) if settings.bos_id is not None else None
    eos = np.array([settings.eos_id], dtype=dtype) if settings.eos_id is not None else None
    for e in encoded:
        if bos is not None:
            pieces.append(bos)
        pieces.append(e)
        if eos is not None:
            pieces.append(eos)
    np.concatenate(pieces, out=out, casting="unsafe")
    return out
