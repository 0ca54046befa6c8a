"""`skip_samples`: an epoch order with chosen samples left out, exactly and balanced.

The filter works on the *global* order, before anything is cut into steps, ranks or workers: the
remaining positions keep their original order, renumbered 0..K-1 with the skipped ones removed.
Everything downstream (rank slices, partial-batch policies, resume positions) then sees an ordinary,
shorter order, so every rank still gets the same number of samples and a resume on another world size
continues the same filtered sequence.

The filter is an `ExcludedOrder` (`shardkit.loaders.order.epochs`); this module only decides which positions
leave. Only the skipped positions are held (found through the order's inverse, `positions_of`), so a
filter costs O(skipped) memory and time, never O(samples); ranges stay intervals until then.

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

SkipEntry = int | tuple[int, int] | tuple[str, int]  # an id, an inclusive id range, a document
_RANGE = re.compile(r"^(\d+)-(\d+)$")


def _entry_error(entry: Any) -> ValueError:
    return ValueError(f"skip_samples entry {entry!r:.80}: expected a sample id (N), a range of ids (A-B) or a "
                      "document SOURCE#DOC (an input name of the manifest and a document index)")


def _text_entries(text: str) -> list[Any]:
    """'5,17 100-120 web.jsonl#3' -> [5, 17, (100, 120), ('web.jsonl', 3)] (a range stays two numbers)."""
    entries: list[Any] = []
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        if item.isdigit():
            entries.append(int(item))
        elif match := _RANGE.match(item):
            first, last = int(match[1]), int(match[2])
            if first > last:
                raise ValueError(f"skip_samples range {item!r}: the first id is larger than the last")
            entries.append((first, last))
        elif "#" in item and (source := item.rpartition("#")[0]) and item.rpartition("#")[2].isdigit():
            entries.append((source, int(item.rpartition("#")[2])))
        else:
            raise _entry_error(item)
    return entries


def _is_id(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _entry(entry: Any) -> tuple[int, int] | tuple[str, int]:
    """An entry as an inclusive id interval (first, last) or a document (source, doc)."""
    if _is_id(entry):
        if entry < 0:
            raise ValueError(f"skip_samples: sample id {entry} is negative")
        return (int(entry), int(entry))
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        first, second = entry
        if _is_id(first) and _is_id(second):
            if first < 0 or second < first:
                raise ValueError(f"skip_samples range {first}-{second}: ids must be >= 0 and the first no larger "
                                 "than the last")
            return (int(first), int(second))
        if isinstance(first, str) and first and _is_id(second) and second >= 0:
            return (first, int(second))
    raise _entry_error(entry)


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-adjacent inclusive intervals covering the same ids."""
    merged: list[list[int]] = []
    for first, last in sorted(intervals):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return [(a, b) for a, b in merged]


def normalize_skip(value: Any) -> tuple[SkipEntry, ...]:
    """The canonical form of a `skip_samples` value: sorted disjoint id intervals (a single id as N, a run
    as (first, last)), then sorted unique documents. Ranges are never expanded: `0-2000000000` is two
    numbers here, in the loader state and in checkpoints.

    Accepts an iterable of ids, (first, last) ranges and `(source, doc)` pairs, or the command line's text
    form (`"5,17 100-120 web.jsonl#3"`: ids, inclusive ranges, SOURCE#DOC documents).

    Raises:
        ValueError: an entry that is none of these, naming it.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        entries: Iterable[Any] = _text_entries(value)
    elif _is_id(value):
        entries = [value]
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, dict)):
        entries = value
    else:
        raise ValueError(f"skip_samples must be a set of sample ids and (source, doc) documents, "
                         f"got {type(value).__name__}")
    normal = [_entry(e) for e in entries]
    intervals = _merged([e for e in normal if not isinstance(e[0], str)])
    docs = sorted({e for e in normal if isinstance(e[0], str)})
    return (*(a if a == b else (a, b) for a, b in intervals), *docs)


def split_entries(entries: tuple[SkipEntry, ...]) -> tuple[list[tuple[int, int]], list[tuple[str, int]]]:
    """(inclusive id intervals, documents) of a normalized `skip_samples` value."""
    intervals = [(e, e) if isinstance(e, int) else e for e in entries if not isinstance(e, tuple) or
                 not isinstance(e[0], str)]
    return intervals, [e for e in entries if isinstance(e, tuple) and isinstance(e[0], str)]


def skipped_count(entries: tuple[SkipEntry, ...]) -> int:
    """Sample ids the intervals of a normalized value name (documents not counted)."""
    return sum(last - first + 1 for first, last in split_entries(entries)[0])


def resolve_skipped(entries: tuple[SkipEntry, ...], manifest: Any, cache: Any) -> np.ndarray:
    """The sorted unique sample ids a `skip_samples` value names: its ids, and every sample holding a
    piece of one of its documents (read from the shards' provenance through the node-local `cache`).

    Raises:
        ValueError: an id outside the dataset, or a document whose source is not an input of it or
            that no sample holds (a typo would otherwise skip nothing, silently).
    """
    from shardkit.lineage import find_documents, source_index

    intervals, documents = split_entries(entries)
    # Checked on the intervals, before any id is expanded: a range past the end is refused at once.
    too_large = [last for _, last in intervals if last >= manifest.num_samples]
    if too_large:
        raise ValueError(f"skip_samples: sample id {too_large[0]} is out of range: the dataset holds "
                         f"{manifest.num_samples} samples")
    found = (np.concatenate([np.arange(a, b + 1, dtype=np.int64) for a, b in intervals]) if intervals
             else np.zeros(0, dtype=np.int64))
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
