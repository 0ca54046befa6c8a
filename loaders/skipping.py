"""`skip_samples`: an epoch order with chosen samples left out, exactly and balanced.

The filter works on the *global* order, before anything is cut into steps, ranks or workers: the
remaining positions keep their original order, renumbered 0..K-1 with the skipped ones removed.
Everything downstream (rank slices, partial-batch policies, resume positions) then sees an ordinary,
shorter order, so every rank still gets the same number of samples and a resume on another world size
continues the same filtered sequence.

Only the skipped positions are held (found through the order's inverse, `positions_of`), so a filter
costs O(skipped) memory and time, never O(samples).

Entries are sample ids (global, in manifest order) or documents `(source, doc)`: `source` is an input
name of the manifest's `sources`, `doc` the document's index in it; a document leaves out every sample
holding any piece of it (resolved through the shards' provenance, `shardkit.lineage`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

SkipEntry = int | tuple[str, int]
_RANGE = re.compile(r"^(\d+)-(\d+)$")


def _entry_error(entry: Any) -> ValueError:
    return ValueError(f"skip_samples entry {entry!r:.80}: expected a sample id (N), a range of ids (A-B) or a "
                      "document SOURCE#DOC (an input name of the manifest and a document index)")


def _text_entries(text: str) -> list[SkipEntry]:
    """'5,17 100-120 web.jsonl#3' -> [5, 17, 100, ..., 120, ('web.jsonl', 3)]."""
    entries: list[SkipEntry] = []
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        if item.isdigit():
            entries.append(int(item))
        elif match := _RANGE.match(item):
            first, last = int(match[1]), int(match[2])
            if first > last:
                raise ValueError(f"skip_samples range {item!r}: the first id is larger than the last")
            entries.extend(range(first, last + 1))
        elif "#" in item and (source := item.rpartition("#")[0]) and item.rpartition("#")[2].isdigit():
            entries.append((source, int(item.rpartition("#")[2])))
        else:
            raise _entry_error(item)
    return entries


def _entry(entry: Any) -> SkipEntry:
    if isinstance(entry, (int, np.integer)) and not isinstance(entry, bool):
        if entry < 0:
            raise ValueError(f"skip_samples: sample id {entry} is negative")
        return int(entry)
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        source, doc = entry
        if isinstance(source, str) and source and isinstance(doc, (int, np.integer)) and not isinstance(doc, bool) \
                and doc >= 0:
            return (source, int(doc))
    raise _entry_error(entry)


def normalize_skip(value: Any) -> tuple[SkipEntry, ...]:
    """The canonical form of a `skip_samples` value: sorted unique ids, then sorted unique documents.

    Accepts an iterable of ids and `(source, doc)` pairs, or the command line's text form
    (`"5,17 100-120 web.jsonl#3"`: ids, inclusive ranges, SOURCE#DOC documents).

    Raises:
        ValueError: an entry that is none of these, naming it.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        entries: Iterable[Any] = _text_entries(value)
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        entries = [value]
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, dict)):
        entries = value
    else:
        raise ValueError(f"skip_samples must be a set of sample ids and (source, doc) documents, "
                         f"got {type(value).__name__}")
    normal = {_entry(e) for e in entries}
    ids = sorted(e for e in normal if isinstance(e, int))
    docs = sorted(e for e in normal if isinstance(e, tuple))
    return (*ids, *docs)


def split_entries(entries: tuple[SkipEntry, ...]) -> tuple[list[int], list[tuple[str, int]]]:
    """(sample ids, documents) of a normalized `skip_samples` value."""
    return [e for e in entries if isinstance(e, int)], [e for e in entries if isinstance(e, tuple)]


def kept_positions(positions: np.ndarray, skipped: np.ndarray) -> np.ndarray:
    """Original positions of filtered positions, given the sorted unique `skipped` original positions.

    The p-th kept position is p + (skipped positions at or before it); with t_i = skipped_i - i
    (non-decreasing), that count is the number of t_i <= p.
    """
    positions = np.asarray(positions, dtype=np.int64)
    shift = skipped - np.arange(len(skipped), dtype=np.int64)
    return positions + np.searchsorted(shift, positions, side="right")


class SkippingOrder:
    """An epoch order (`EpochOrder`) without the positions of `skipped_ids`, renumbered 0..K-1.

    Args:
        base: the full order; it must offer `positions_of` (its inverse).
        skipped_ids: sample ids to leave out (each occurs once per epoch in `base`).
    """

    def __init__(self, base: Any, skipped_ids: np.ndarray):
        self.base = base
        self.skipped = np.unique(base.positions_of(np.asarray(skipped_ids, dtype=np.int64)))
        self.num_positions = base.num_positions - len(self.skipped)

    def __len__(self) -> int:
        return self.num_positions

    def original(self, positions: np.ndarray) -> np.ndarray:
        """Positions of the full order."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_positions):
            raise IndexError(f"position out of range for an epoch of {self.num_positions} positions "
                             f"({len(self.skipped)} skipped)")
        return kept_positions(positions, self.skipped)

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        return self.base.sample_ids(self.original(positions))

    def partition_of(self, positions: np.ndarray) -> np.ndarray:
        return self.base.partition_of(self.original(positions))


def resolve_skipped(entries: tuple[SkipEntry, ...], manifest: Any, cache: Any) -> np.ndarray:
    """The sorted unique sample ids a `skip_samples` value names: its ids, and every sample holding a
    piece of one of its documents (read from the shards' provenance through the node-local `cache`).

    Raises:
        ValueError: an id outside the dataset, or a document whose source is not an input of it or
            that no sample holds (a typo would otherwise skip nothing, silently).
    """
    from shardkit.lineage import find_documents, source_index

    ids, documents = split_entries(entries)
    too_large = [i for i in ids if i >= manifest.num_samples]
    if too_large:
        raise ValueError(f"skip_samples: sample id {too_large[0]} is out of range: the dataset holds "
                         f"{manifest.num_samples} samples")
    found = np.asarray(ids, dtype=np.int64)
    if documents:
        wanted = {(source_index(manifest, source), doc): f"{source}#{doc}" for source, doc in documents}

        def doc_arrays(position: int):
            handle = cache.open(position)
            try:  # copies: the handle's lock is released before the arrays are read
                arrays = handle.reader.arrays
                return dataclasses.replace(arrays, doc_offsets=np.array(arrays.doc_offsets),
                                           doc_source=np.array(arrays.doc_source), doc_index=np.array(arrays.doc_index))
            finally:
                handle.close()

        holders = find_documents(manifest, wanted, doc_arrays)
        missing = [name for document, name in wanted.items() if holders[document].size == 0]
        if missing:
            raise ValueError(f"skip_samples: no sample holds document {missing[0]} (is the document index right?)")
        found = np.concatenate([found, *holders.values()])
    return np.unique(found)
