"""LitData optimized datasets (`litdata.optimize(..., item_loader=TokensLoader())`): one document an item.

The layout is LitData's, read here from its documented shape (any fsspec URL; litdata itself, whose
requirements replace the CPU torch, is not needed); the tests write sources with `litdata.optimize`.

- `index.json`: `{"chunks": [{"filename", "chunk_size" (items), "chunk_bytes", "dim"}, ...],
  "config": {"data_format": ["no_header_tensor:K"], "compression": null, "item_loader": "TokensLoader", ...}}`;
- a chunk: u32 item count N, u32 offsets[N + 1] (absolute byte offsets of each item), the items; a
  `no_header_tensor:K` item is its ids, raw, in torch dtype number K of LitData's table (11 uint8, 12 int8,
  13/14 int16, 15/16 int32, 17/18 int64, 20 uint16).

Every item yielded to `optimize` is one document (TokensLoader reads blocks across them, but the chunk
keeps each item's extent). A work unit is one chunk file. Compressed chunks are refused: TokensLoader
memory-maps chunks and cannot read them either. `index.json` is checked first (`source_index`): its
shape, chunk names that stay inside the dataset, and item counts the chunk files can hold.
"""

from __future__ import annotations

import numpy as np

from shardkit.storage import open_filesystem, redact_url, retry_call
from shardkit.text.documents import UnitResult
from shardkit.text.inputs import InputFile, WorkUnit

from .documents import TokenSettings, source_files, token_documents
from .source_index import IndexEntry, items_held, read_index_json

TENSOR_DTYPES = {11: "uint8", 12: "int8", 13: "int16", 14: "int16", 15: "int32", 16: "int32", 17: "int64",
                 18: "int64", 20: "uint16"}


def expand_sources(inputs: tuple[str, ...], storage_options) -> list[tuple[InputFile, tuple[str, str, int], int]]:
    """(chunk file, (its URL, dtype, items), items) of each chunk of each SRC (a directory holding `index.json`).

    Raises:
        ValueError: `index.json` is not a readable LitData index of TokensLoader chunks, names a file outside
            the dataset, or declares more items than a chunk's bytes can hold (one line naming it).
    """
    found = []
    for spec in inputs:
        fs, path, where, index = read_index_json(spec, storage_options, fields=("config", "chunks"), what="a LitData")
        top = IndexEntry(index, where="", file=where)
        config, chunks = top.entry("config"), top.list("chunks")
        formats = config.list("data_format") if config.value.get("data_format") is not None else []
        if config.value.get("compression"):
            raise ValueError(f"{where}: chunks compressed with {config.value['compression']!r}; only uncompressed "
                             "TokensLoader chunks are read")
        kind, _, code = formats[0].partition(":") if len(formats) == 1 and isinstance(formats[0], str) else ("", "", "")
        dtype = TENSOR_DTYPES.get(int(code)) if kind == "no_header_tensor" and code.isdigit() else None
        if dtype is None:
            raise ValueError(f"{where}: items are {formats}, not one integer tensor each (write them with "
                             "litdata.optimize(..., item_loader=TokensLoader()))")
        entries = [IndexEntry(chunk, where=f"chunk {number}", file=where) for number, chunk in enumerate(chunks)]
        names = [entry.file_name("filename") for entry in entries]
        counts = [entry.count("chunk_size") for entry in entries]
        files = source_files([(fs, f"{path}/{name}") for name in names], "litdata")
        for number, (file, name, items) in enumerate(zip(files, names, counts)):
            if items > items_held(file.size):  # else a damaged chunk costs a rejection per declared item
                raise ValueError(f"{where}: chunk {number} ({name}) declares {items} items, but its {file.size} bytes "
                                 f"hold at most {items_held(file.size)} (the index does not describe this file)")
            found.append((file, (file.url, dtype, items), items))
    return found


def read_chunk_unit(unit: WorkUnit, settings: TokenSettings) -> UnitResult:
    """The items of one chunk as documents (runs in a worker process or a Ray task)."""
    url, dtype, items = unit.payload
    fs, path = open_filesystem(url, settings.storage_options)
    data = retry_call(lambda: fs.cat_file(path), url=redact_url(url), what="read")
    empty = np.zeros(0, dtype=np.int64)
    width = np.dtype(dtype).itemsize
    problem = None
    if len(data) < 4 * (items + 2) or int(np.frombuffer(data, "<u4", 1)[0]) != items:
        problem = f"the chunk does not hold the {items} items index.json says (truncated or replaced)"
    else:
        offsets = np.frombuffer(data, "<u4", items + 1, 4).astype(np.int64)
        if offsets[0] != 4 * (items + 2) or np.any(np.diff(offsets) < 0) or offsets[-1] != len(data) \
                or np.any(np.diff(offsets) % width):
            problem = f"the chunk's item offsets do not tile its {len(data)} bytes (truncated or corrupt)"
    if problem is not None:
        return token_documents(unit, empty, empty, empty, settings, rejected=[(i, problem) for i in range(items)])
    tokens = np.frombuffer(data, np.dtype(dtype).newbyteorder("<"), offset=int(offsets[0]))
    return token_documents(unit, tokens, np.diff(offsets) // width, np.arange(items, dtype=np.int64), settings)
