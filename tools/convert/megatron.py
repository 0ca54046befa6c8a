"""Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`): the on-disk layout, read and written.

The layout is megatron-core's (`megatron/core/datasets/indexed_dataset.py`, `MMIDIDX` version 1), as
written by Megatron's `preprocess_data.py`, datatrove's Megatron tokenizer and NeMo. `.idx`, all
little-endian:

    9 bytes   b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code of the .bin's ids: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
              7 float32, 8 uint16
    u64       S, the number of sequences
    u64       D, the number of document-index entries (documents + 1)
    S x i32   sequence lengths, in ids
    S x i64   sequence pointers: byte offset of each sequence in the .bin
    D x i64   document indices: document d is sequences [idx[d], idx[d+1]); idx[0] = 0, idx[-1] = S
    (S x i8   sequence modes, only in multimodal datasets; ignored here)

`.bin` is the ids, one sequence after another. A shardkit document is a Megatron document (all its
sequences, joined); its `doc_index` is the document's number. Reading is done here rather than by
megatron-core's `IndexedDataset` because the source may be any fsspec URL (megatron-core reads local
files, or S3 through its own client); tests check this reader and writer against megatron-core's
`IndexedDatasetBuilder` and `IndexedDataset`.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shardkit.manifest import TokenizerInfo
from shardkit.storage import open_filesystem, redact_url, retry_call
from shardkit.text.documents import UnitResult
from shardkit.text.inputs import InputFile, WorkUnit, _display

from .documents import TokenSettings, source_files, token_documents

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index entries
METADATA_SUFFIX = ".shardkit.json"


def export_dtype(vocab_size: int) -> np.dtype:
    """The .bin dtype megatron-core picks for a vocabulary (`DType.optimal_dtype`): uint16 below 65,500 ids."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


@dataclass(frozen=True)
class MegatronIndex:
    """A parsed `.idx`: the .bin's dtype and the three arrays."""

    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def documents(self) -> int:
        return len(self.document_indices) - 1


def parse_index(data: bytes, *, name: str) -> MegatronIndex:
    """Parse and check an `.idx` file's bytes.

    Raises:
        ValueError: the bytes are not a Megatron index or contradict themselves (names `name`).
    """
    if len(data) < _HEADER.size:
        raise ValueError(f"{name}: not a Megatron index ({len(data)} bytes, shorter than its header)")
    magic, version, code, sequences, entries = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"{name}: not a Megatron index (starts with {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"{name}: Megatron index version {version}; only version {VERSION} is known")
    dtype = DTYPE_CODES.get(code)
    if dtype is None or not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{name}: dtype code {code} is not an integer token type (known: 1-5, 8)")
    body = _HEADER.size + 12 * sequences + 8 * entries
    if len(data) not in (body, body + sequences):  # the second: with multimodal sequence modes
        raise ValueError(f"{name}: holds {len(data)} bytes, but its header ({sequences} sequences, {entries} "
                         f"document-index entries) needs {body} (truncated or not an index)")
    offset = _HEADER.size
    lengths = np.frombuffer(data, dtype="<i4", count=sequences, offset=offset)
    pointers = np.frombuffer(data, dtype="<i8", count=sequences, offset=offset + 4 * sequences)
    documents = np.frombuffer(data, dtype="<i8", count=entries, offset=offset + 12 * sequences)
    if entries < 1 or documents[0] != 0 or documents[-1] != sequences or np.any(np.diff(documents) < 0):
        raise ValueError(f"{name}: the document index must start at 0, never decrease and end at the sequence "
                         f"count {sequences}")
    if np.any(lengths < 0):
        raise ValueError(f"{name}: sequence {int(np.argmax(lengths < 0))} has a negative length")
    return MegatronIndex(np.dtype(dtype).newbyteorder("<"), lengths, pointers, documents)


def encode_index(dtype: np.dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> bytes:
    """The `.idx` bytes for sequences stored back to back in the .bin (pointers are their running sums)."""
    code = {np.dtype(v): k for k, v in DTYPE_CODES.items()}[np.dtype(dtype)]
    lengths = np.asarray(sequence_lengths, dtype="<i4")
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    header = _HEADER.pack(MAGIC, VERSION, code, len(lengths), len(document_indices))
    return b"".join([header, lengths.tobytes(), pointers.tobytes(), np.asarray(document_indices, dtype="<i8").tobytes()])


# -- the source side of `shardkit convert --from megatron` ---------------------------------------------
def expand_sources(inputs: tuple[str, ...], storage_options) -> list[tuple[InputFile, InputFile]]:
    """(.bin, .idx) of each SRC (a prefix, PREFIX.bin / PREFIX.idx, or a directory of them), in order."""
    pairs = []
    for spec in inputs:
        fs, path = open_filesystem(spec, storage_options)
        path = path[:-4] if path.endswith((".bin", ".idx")) else path
        if fs.isdir(path):
            prefixes = sorted(p[:-4] for p in fs.find(path) if p.endswith(".idx"))
            if not prefixes:
                raise FileNotFoundError(f"SRC {spec}: a directory holding no Megatron .idx file")
        else:
            prefixes = [path]
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                if not fs.exists(prefix + suffix):
                    raise FileNotFoundError(f"SRC {spec}: {_display(fs, prefix + suffix)} does not exist "
                                            "(a Megatron dataset is PREFIX.bin + PREFIX.idx)")
            pairs.append((fs, prefix))
    files = source_files([(fs, prefix + suffix) for fs, prefix in pairs for suffix in (".bin", ".idx")], "megatron")
    return list(zip(files[0::2], files[1::2]))


def read_metadata(bin_file: InputFile, storage_options) -> TokenizerInfo | None:
    """The tokenizer identity `shardkit export` wrote beside the dataset (PREFIX.shardkit.json), if any."""
    fs, path = open_filesystem(bin_file.url[:-4] + METADATA_SUFFIX, storage_options)
    if not fs.exists(path):
        return None
    try:
        return TokenizerInfo(**json.loads(fs.cat_file(path))["tokenizer"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{_display(fs, path)}: unreadable tokenizer identity ({err}); pass --tokenizer") from err


def load_index(index_file: InputFile, storage_options) -> MegatronIndex:
    fs, path = open_filesystem(index_file.url, storage_options)
    data = retry_call(lambda: fs.cat_file(path), url=redact_url(index_file.url), what="read")
    return parse_index(data, name=index_file.url)


@dataclass(frozen=True)
class MegatronSlice:
    """A run of documents of one .bin: what a worker reads (bytes [start, end), clamped to the file)."""

    url: str
    dtype: str
    file_size: int
    start: int
    end: int
    first_document: int
    pointers: np.ndarray
    lengths: np.ndarray
    sequences_per_document: np.ndarray


def units(pairs: list[tuple[InputFile, InputFile]], indexes: list[MegatronIndex], *, unit_bytes: int,
          start: tuple[int, int, int]) -> Iterator[WorkUnit]:
    """Work units of about `unit_bytes` of .bin each (whole documents), from a resume position."""
    index, first_source, skip = start
    for source in range(first_source, len(pairs)):
        bin_file, megatron = pairs[source][0], indexes[source]
        cuts = _cuts(megatron, unit_bytes)
        for file_unit in range(skip if source == first_source else 0, len(cuts) - 1):
            yield _unit(bin_file, megatron, source, file_unit, index, cuts[file_unit], cuts[file_unit + 1],
                        last=file_unit == len(cuts) - 2)
            index += 1


def _cuts(megatron: MegatronIndex, unit_bytes: int) -> list[int]:
    """Document numbers where units begin (and the end): each unit holds >= 1 document, ~unit_bytes."""
    per_sequence = megatron.sequence_lengths.astype(np.int64) * megatron.dtype.itemsize
    ends = np.concatenate([[0], np.cumsum(per_sequence)])[megatron.document_indices[1:]]
    cuts = [0]
    while cuts[-1] < megatron.documents:
        reached = int(ends[cuts[-1] - 1]) if cuts[-1] else 0
        cuts.append(max(int(np.searchsorted(ends, reached + unit_bytes, side="right")), cuts[-1] + 1))
    return cuts if len(cuts) > 1 else [0, 0]  # an empty dataset still gets one unit: it accounts the file


def sequence_ends(pointers: np.ndarray, lengths: np.ndarray, itemsize: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(byte end of each sequence, whether it lies within the first `size` bytes), without int64 overflow.

    `pointer + length * itemsize` wraps for a pointer near 2**63 and would then look like a sequence
    inside the file; here a pointer is first bounded by `size`, and a length by the room left after it,
    so no sum ever exceeds `size`. A sequence outside gets its pointer as its end (never read).
    """
    pointers = np.asarray(pointers, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    inside = (pointers >= 0) & (pointers <= size)
    room = (size - np.where(inside, pointers, size)) // itemsize  # in [0, size]: no overflow
    inside &= (lengths >= 0) & (lengths <= room)
    ends = np.where(inside, pointers + np.where(inside, lengths, 0) * itemsize, pointers)
    return ends, inside


def _unit(bin_file: InputFile, megatron: MegatronIndex, source: int, file_unit: int, index: int, first: int,
          last_document: int, *, last: bool) -> WorkUnit:
    a, b = int(megatron.document_indices[first]), int(megatron.document_indices[last_document])
    pointers, lengths = megatron.sequence_pointers[a:b], megatron.sequence_lengths[a:b].astype(np.int64)
    itemsize = megatron.dtype.itemsize
    ends, inside = sequence_ends(pointers, lengths, itemsize, bin_file.size)
    start = int(pointers[inside].min()) if inside.any() else 0
    end = int(ends[inside].max()) if inside.any() else 0
    reached = end
    file_error = None
    if last:
        all_ends, all_inside = sequence_ends(megatron.sequence_pointers, megatron.sequence_lengths, itemsize,
                                             bin_file.size)
        final = int(all_ends[all_inside].max()) if all_inside.any() else 0
        if final < bin_file.size:
            reached = max(reached, final)
            file_error = f"{bin_file.size - final} bytes after the last sequence are referenced by no .idx entry"
        elif b == a:
            reached = bin_file.size
    payload = MegatronSlice(url=bin_file.url, dtype=megatron.dtype.str, file_size=bin_file.size, start=start,
                            end=end, first_document=first, pointers=pointers,
                            lengths=lengths, sequences_per_document=np.diff(megatron.document_indices[first:last_document + 1]))
    return WorkUnit(index=index, source=source, file_unit=file_unit, kind="megatron", first_record=first,
                    payload=payload, input_offset=reached, file_error=file_error,
                    records_in_payload=last_document - first)


# -- worker ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _filesystem(url: str, options: str):
    return open_filesystem(url, json.loads(options) or None)


def read_unit(unit: WorkUnit, settings: TokenSettings) -> UnitResult:
    """Read one slice of a .bin into documents (runs in a worker process or a Ray task)."""
    part: MegatronSlice = unit.payload
    dtype = np.dtype(part.dtype)
    fs, path = _filesystem(part.url, json.dumps(settings.storage_options or {}, sort_keys=True, default=str))
    data = b""
    if part.end > part.start:
        data = retry_call(lambda: fs.cat_file(path, start=part.start, end=part.end), url=redact_url(part.url),
                          what="read")
    available = part.start + len(data) - len(data) % dtype.itemsize
    ids = np.frombuffer(data, dtype=dtype, count=(available - part.start) // dtype.itemsize)
    documents = len(part.sequences_per_document)
    records = part.first_document + np.arange(documents, dtype=np.int64)
    ends, inside = sequence_ends(part.pointers, part.lengths, dtype.itemsize, available)
    broken = ~inside | (part.pointers < part.start) | ((part.pointers - part.start) % dtype.itemsize != 0)
    owner = np.repeat(np.arange(documents), part.sequences_per_document)
    contiguous = not broken.any() and np.array_equal(part.pointers[1:], ends[:-1]) and \
        (len(part.pointers) == 0 or part.pointers[0] == part.start)
    lengths = np.bincount(owner, weights=part.lengths, minlength=documents).astype(np.int64)
    if contiguous:  # the common case: the unit's sequences lie back to back, the bytes are the documents
        return token_documents(unit, ids[:int(lengths.sum())], lengths, records, settings)
    rejected = []
    bad_documents = np.unique(owner[broken])
    for doc in bad_documents.tolist():
        sequence = int(np.flatnonzero(broken & (owner == doc))[0])
        begin = int(part.pointers[sequence])  # Python ints: the end is exact even where int64 would wrap
        finish = begin + int(part.lengths[sequence]) * dtype.itemsize
        rejected.append((int(records[doc]), "bytes outside the .bin (a truncated .bin, or .idx offsets past the "
                                            f"data): [{begin}, {finish}) of {part.file_size} bytes"))
    keep = np.ones(documents, dtype=bool)
    keep[bad_documents] = False
    pieces = [ids[(p - part.start) // dtype.itemsize:(p - part.start) // dtype.itemsize + n]
              for p, n, o in zip(part.pointers.tolist(), part.lengths.tolist(), owner.tolist()) if keep[o]]
    tokens = np.concatenate(pieces) if pieces else ids[:0]
    return token_documents(unit, tokens, lengths[keep], records[keep], settings, rejected=rejected)
