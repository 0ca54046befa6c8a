"""The identity of a dataset's data: its shards' names, sample counts and SHA-256s, and stream weights.

Saved loader states record it (`LoaderState.dataset`), so its value is fixed forever: the first 32
hex digits of the SHA-256 of

    json.dumps([[[[name, samples, sha256], ...] per manifest], weights])

with json's defaults (", " separators, ASCII output). Written that way it costs a `json.dumps` per
shard (several seconds at a million shards). Here the same bytes are produced a few thousand shards
at a time with numpy, for every name that `json.dumps` writes unchanged between its quotes (printable
ASCII without `"` or a backslash: every name a build writes); any other name takes `json.dumps`
itself, so escapes and non-ASCII text come out exactly as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit.manifest import Manifest
from shardkit.shard_columns import ShardColumns

_CHUNK = 1 << 13  # shards per numpy pass: a ~1 MB byte matrix for 25-byte names (stays in cache; 4 MB: 2x slower)
_PAD = 0xFF  # fills the matrix around names and counts, removed after; never in plain output (<= 0x7E)
_POWERS = 10 ** np.arange(18, -1, -1, dtype=np.int64)  # 19 decimal digits hold any int64 >= 0


def data_fingerprint(manifests: Sequence[Manifest], weights: list[Any]) -> str:
    """SHA-256 (32 hex digits) of json.dumps([[[[name, samples, sha256], ...] per manifest], weights]),
    fed a chunk of shards at a time: no million-entry list in memory at a million shards."""
    digest = hashlib.sha256(b"[[")
    for s, manifest in enumerate(manifests):
        digest.update(b"[" if s == 0 else b", [")
        columns = manifest.columns
        for first in range(0, len(columns), _CHUNK):
            digest.update(b", " if first else b"")
            digest.update(shard_entries(columns, first, min(first + _CHUNK, len(columns))))
        digest.update(b"]")
    digest.update(b"], " + json.dumps(weights).encode() + b"]")
    return digest.hexdigest()[:32]


def shard_entries(columns: ShardColumns, first: int, end: int) -> bytes:
    """`", ".join(json.dumps([name, samples, sha256]) for shards first..end-1)`, as bytes."""
    offsets = columns.name_offsets[first:end + 1]
    raw = np.frombuffer(columns.names, dtype=np.uint8, count=int(offsets[-1] - offsets[0]), offset=int(offsets[0]))
    # json.dumps escapes a quote, a backslash and every byte outside printable ASCII (with
    # ensure_ascii, non-ASCII text becomes \\uXXXX): names holding one take the slow path.
    escaped = np.flatnonzero((raw < 0x20) | (raw > 0x7E) | (raw == ord('"')) | (raw == ord("\\")))
    # The shards holding them rise with `escaped`: dict.fromkeys keeps each once, in order. Not np.unique, which
    # imports numpy.ma on its first call (numpy 2.4, ~10 ms): a resumed loader's first batch paid it.
    special = dict.fromkeys((np.searchsorted(offsets, escaped + offsets[0], side="right") - 1 + first).tolist())
    parts, start = [], first
    for i in special:
        if start < i:
            parts.append(_plain_entries(columns, start, i))
        parts.append(json.dumps([columns.name(i), int(columns.samples[i]), columns.sha256[i].tobytes().hex()]).encode())
        start = i + 1
    if start < end:
        parts.append(_plain_entries(columns, start, end))
    return b", ".join(parts)


def _plain_entries(columns: ShardColumns, first: int, end: int) -> bytes:
    """The entries of shards whose names json.dumps leaves unchanged (counts are non-negative in
    any manifest that loaded: `ShardColumns.check`, `ShardInfo`).

    One row per shard of a byte matrix, laid out as the entry `["name", 123, "hex"], `: the name
    left-aligned and the count right-aligned in fixed-width fields padded with `_PAD`; dropping the
    padding bytes (row after row) leaves exactly the entries one after another.
    """
    offsets = columns.name_offsets[first:end + 1]
    lengths = np.diff(offsets)
    rows, longest = end - first, int(lengths.max())
    matrix = np.empty((rows, 2 + longest + 3 + len(_POWERS) + 3 + 64 + 4), dtype=np.uint8)
    at = 0

    def put(text: bytes) -> None:
        nonlocal at
        matrix[:, at:at + len(text)] = np.frombuffer(text, dtype=np.uint8)
        at += len(text)

    put(b'["')
    names = matrix[:, at:at + longest]
    inside = np.arange(longest) < lengths[:, None]
    names[~inside] = _PAD
    # Row-major order of the cells inside the names is the order of the concatenated names.
    names[inside] = np.frombuffer(columns.names, dtype=np.uint8, count=int(offsets[-1] - offsets[0]),
                                  offset=int(offsets[0]))
    at += longest
    put(b'", ')
    values, which = np.unique(columns.samples[first:end], return_inverse=True)  # usually one or a few counts
    digits = (values[:, None] // _POWERS % 10 + ord("0")).astype(np.uint8)
    digits[(values[:, None] < _POWERS) & (_POWERS > 1)] = _PAD  # leading zeros (0 itself keeps its digit)
    matrix[:, at:at + len(_POWERS)] = digits[which.reshape(-1)]
    at += len(_POWERS)
    put(b', "')
    hexes = columns.sha256[first:end].tobytes().hex().encode()
    matrix[:, at:at + 64] = np.frombuffer(hexes, dtype=np.uint8).reshape(rows, 64)
    at += 64
    put(b'"], ')
    return matrix[matrix != _PAD].tobytes()[:-2]  # no separator after the last entry
