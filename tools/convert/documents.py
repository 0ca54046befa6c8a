"""Worker side of `shardkit convert`: documents that are already token ids, checked, as a `UnitResult`.

Every source format reads its unit into (tokens, lengths, record indices) plus the records it could not
read, and `token_documents` does the rest the same way for all: a document holding a negative id or one
at or beyond the vocabulary, or no token at all, is rejected with its reason (counted, or the error
under `--on-error fail`), the others are cast to the dataset's token dtype. The result is what the
build's tokenizer step hands the packer, so packing, shards, accounting and resume are the build's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardkit.text.documents import UnitResult
from shardkit.text.inputs import WorkUnit


@dataclass(frozen=True, kw_only=True)
class TokenSettings:
    """What a convert worker needs (small and picklable).

    Attributes:
        vocab_size: every id must be below it.
        token_dtype: "uint16" or "uint32", the dataset's token dtype.
        storage_options: fsspec options for reading the sources (never logged).
    """

    vocab_size: int
    token_dtype: str
    storage_options: dict[str, Any] | None = field(default=None, repr=False)


def token_documents(unit: WorkUnit, tokens: np.ndarray, lengths: np.ndarray, records: np.ndarray,
                    settings: TokenSettings, *, rejected: list[tuple[int, str]] | None = None) -> UnitResult:
    """The unit's documents, checked against the vocabulary, as the packer's input.

    Args:
        unit: the work unit (its index, source, position and accounting fields are copied).
        tokens: the documents' ids concatenated (any integer dtype).
        lengths: ids per document.
        records: each document's index in its source (row, document or sample number).
        rejected: (record, reason) of records the reader could not read.
    """
    rejected = list(rejected or ())
    lengths = np.asarray(lengths, dtype=np.int64)
    records = np.asarray(records, dtype=np.int64)
    keep = lengths > 0
    for record in records[~keep].tolist():
        rejected.append((record, "empty document (no token ids)"))
    if tokens.size and (int(tokens.max()) >= settings.vocab_size or int(tokens.min()) < 0):
        keep &= _in_vocabulary(tokens, lengths, records, settings.vocab_size, rejected)
    if not keep.all():
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        tokens = np.concatenate([tokens[s:s + n] for s, n in zip(starts[keep].tolist(), lengths[keep].tolist())]
                                ) if keep.any() else tokens[:0]
        lengths, records = lengths[keep], records[keep]
    rejected.sort(key=lambda item: item[0])
    return UnitResult(index=unit.index, source=unit.source, file_unit=unit.file_unit, kind=unit.kind,
                      tokens=tokens.astype(settings.token_dtype, copy=False), doc_lengths=lengths,
                      doc_index=records, rejected=tuple(rejected), documents_in=unit.records_in_payload,
                      text_chars=0, file_error=unit.file_error, input_offset=unit.input_offset)


def _in_vocabulary(tokens: np.ndarray, lengths: np.ndarray, records: np.ndarray, vocab_size: int,
                   rejected: list[tuple[int, str]]) -> np.ndarray:
    """Which documents hold only ids in [0, vocab_size); a reason for each that does not."""
    bad = (tokens >= vocab_size) | (tokens < 0) if np.issubdtype(tokens.dtype, np.signedinteger) \
        else tokens >= vocab_size
    ends = np.cumsum(lengths)
    owners = np.searchsorted(ends, np.flatnonzero(bad), side="right")
    ok = np.ones(len(lengths), dtype=bool)
    for doc in np.unique(owners).tolist():
        start = int(ends[doc] - lengths[doc])
        position = int(np.argmax(bad[start:ends[doc]]))
        rejected.append((int(records[doc]), f"token id outside the vocabulary: {int(tokens[start + position])} at "
                                            f"position {position}, the vocabulary is [0, {vocab_size})"))
        ok[doc] = False
    return ok


def file_units(sources, *, kind: str, start: tuple[int, int, int]):
    """One work unit per file, from a resume position, for formats read a whole file at a time (MDS
    shards, LitData chunks). `sources` holds (InputFile, payload, records in the file) triples."""
    index, first_source, skip = start
    for source in range(first_source, len(sources)):
        if source == first_source and skip:
            continue
        file, payload, records = sources[source]
        yield WorkUnit(index=index, source=source, file_unit=0, kind=kind, first_record=0, payload=payload,
                       input_offset=file.size, records_in_payload=records)
        index += 1


def source_files(located: list[tuple[Any, str]], kind: str) -> list:
    """The `InputFile` of each (filesystem, path), in order: its URL, size and content SHA-256 (the fingerprint
    holds it, so a resumed conversion notices a source edited in place). Files are hashed by a few threads
    at once: reading and SHA-256 release the GIL, and hashing is a full read of the source before the first
    unit."""
    from concurrent.futures import ThreadPoolExecutor

    from shardkit.text.inputs import InputFile, _display, content_sha256

    def record(item):
        fs, path = item
        return InputFile(url=_display(fs, path), kind=kind, compression=None, size=int(fs.size(path)),
                         sha256=content_sha256(fs, path))

    if len(located) < 2:
        return [record(item) for item in located]
    with ThreadPoolExecutor(min(4, len(located)), thread_name_prefix="source-hash") as pool:
        return list(pool.map(record, located))
