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
memory-maps chunks and cannot read them either.
"""

from __future__ import annotations

import numpy as np

from shardkit.storage import open_filesystem, redact_url, retry_call
from shardkit.tools.convert.documents import TokenSettings, read_index_json, source_files, token_documents
from shardkit.tools.documents import UnitResult
from shardkit.tools.inputs import InputFile, WorkUnit

TENSOR_DTYPES = {11: "uint8", 12: "int8", 13: "int16", 14: "int16", 15: "int32", 16: "int32", 17: "int64",
                 18: "int64", 20: "uint16"}


def expand_sources(inputs: tuple[str, ...], storage_options) -> list[tuple[InputFile, tuple[str, str, int], int]]:
    """(chunk file, (its URL, dtype, items), items) of each chunk of each SRC (a directory holding `index.json`)."""
    found = []
    for spec in inputs:
        fs, path, where, index = read_index_json(spec, storage_options, fields=("config", "chunks"), what="LitData")
        config, chunks = index["config"], index["chunks"]
        formats = config.get("data_format") or []
        if config.get("compression"):
            raise ValueError(f"{where}: chunks compressed with {config['compression']!r}; only uncompressed "
                             "TokensLoader chunks are read")
        kind, _, code = formats[0].partition(":") if len(formats) == 1 else ("", "", "")
        dtype = TENSOR_DTYPES.get(int(code)) if kind == "no_header_tensor" and code.isdigit() else None
        if dtype is None:
            raise ValueError(f"{where}: items are {formats}, not one integer tensor each (write them with "
                             "litdata.optimize(..., item_loader=TokensLoader()))")
        files = source_files([(fs, f"{path}/{chunk['filename']}") for chunk in chunks], "litdata")
        for file, chunk in zip(files, chunks):
            found.append((file, (file.url, dtype, int(chunk["chunk_size"])), int(chunk["chunk_size"])))
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
