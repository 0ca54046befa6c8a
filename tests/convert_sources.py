"""Source datasets written by the formats' own libraries, and readers of them, for the convert tests.

Megatron datasets are written with megatron-core's `IndexedDatasetBuilder` and read with its
`IndexedDataset`; Hugging Face datasets with `datasets.Dataset.save_to_disk` / `to_parquet`.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest


def megatron():
    """megatron-core's indexed-dataset module (skips the test when it is not installed)."""
    module = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                 reason="megatron-core is needed (pip install 'shardkit[convert]')")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    return module


def random_documents(count: int, *, vocab: int = 256, seed: int = 0, longest: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, longest))).astype(np.int64) for _ in range(count)]


def write_megatron(prefix, documents, *, dtype=np.uint16, split_every: int = 0) -> None:
    """`documents` as a Megatron dataset written by megatron-core; every `split_every`-th document is
    stored as two sequences (a sentence-split document), the others as one."""
    import torch

    builder = megatron().IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for number, tokens in enumerate(documents):
        if split_every and number % split_every == 1 and len(tokens) > 1:
            builder.add_document(torch.from_numpy(tokens), [len(tokens) // 2, len(tokens) - len(tokens) // 2])
        else:
            builder.add_document(torch.from_numpy(tokens), [len(tokens)])
    builder.finalize(f"{prefix}.idx")


def read_megatron(prefix) -> list[np.ndarray]:
    """The documents of a Megatron dataset as megatron-core's reader gives them (sequences joined)."""
    dataset = megatron().IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [np.concatenate([dataset[i] for i in range(bounds[d], bounds[d + 1])]) if bounds[d + 1] > bounds[d]
            else np.zeros(0, dtype=np.int64) for d in range(len(bounds) - 1)]


def write_hf(directory, documents, *, column: str = "input_ids", num_shards: int = 2):
    """`documents` as a `datasets` dataset saved with `save_to_disk` in `num_shards` Arrow files (datasets
    writes record batches of up to 1,000 rows, so a file of more rows holds several)."""
    datasets = pytest.importorskip("datasets", reason="datasets is needed (pip install 'shardkit[convert]')")
    dataset = datasets.Dataset.from_dict({column: [d.tolist() for d in documents],
                                          "id": list(range(len(documents)))})
    dataset.save_to_disk(str(directory), num_shards=num_shards)
    return dataset


_MDS_WRITER = """
import json, sys
import numpy as np
from streaming import MDSWriter
spec = json.loads(sys.stdin.read())
columns = {"input_ids": spec["encoding"], "id": "int"}
with MDSWriter(out=spec["out"], columns=columns, compression=spec["compression"], hashes=spec["hashes"],
               size_limit=spec["size_limit"]) as writer:
    for i, ids in enumerate(spec["documents"]):
        writer.write({"input_ids": np.asarray(ids, dtype=spec["dtype"]), "id": i})
"""

# MosaicML Streaming imports torchvision for its vision datasets only; torchvision's wheels need a CUDA
# torch, so the writer runs in a subprocess that finds this stand-in after every real package
# (benchmarks/peers.py uses the same one).
_TORCHVISION_STAND_IN = {
    "torchvision/__init__.py": "",
    "torchvision/datasets/__init__.py": "class VisionDataset:  # stand-in: streaming only subclasses it\n    pass\n",
    "torchvision/transforms/__init__.py": "",
    "torchvision/transforms/functional.py": "def to_tensor(image):\n    raise NotImplementedError('stand-in')\n",
}


def write_mds(directory, documents, *, encoding="ndarray:uint16", dtype="uint16", compression="zstd",
              hashes=("sha1", "xxh64"), size_limit=1 << 14) -> None:
    """`documents` as an MDS dataset written by MosaicML Streaming's `MDSWriter` (skips when not installed)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("streaming") is None:
        pytest.skip("mosaicml-streaming is needed (pip install --no-deps mosaicml-streaming, see benchmarks/peers.py)")
    stand_in = directory.parent / f"{directory.name}-stand-in"
    for name, text in _TORCHVISION_STAND_IN.items():
        (stand_in / name).parent.mkdir(parents=True, exist_ok=True)
        (stand_in / name).write_text(text)
    spec = {"out": str(directory), "documents": [d.tolist() for d in documents], "encoding": encoding, "dtype": dtype,
            "compression": compression, "hashes": list(hashes), "size_limit": size_limit}
    code = ("import sys; sys.path.append(sys.argv[1])\n" + _MDS_WRITER)
    run = subprocess.run([sys.executable, "-c", code, str(stand_in)], input=json.dumps(spec), capture_output=True,
                         text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if run.returncode != 0:
        raise RuntimeError(f"MDSWriter failed: {run.stderr[-2000:]}")


_LITDATA_WRITER = """
import json, os, sys
os.environ["LITDATA_DISABLE_VERSION_CHECK"] = "1"
import numpy as np
import torch
from litdata import TokensLoader, optimize

SPEC = json.loads(open(sys.argv[1]).read())


def item(i):
    yield torch.tensor(SPEC["documents"][i], dtype=getattr(torch, SPEC["dtype"]))


if __name__ == "__main__":
    optimize(fn=item, inputs=list(range(len(SPEC["documents"]))), output_dir=SPEC["out"], chunk_bytes=SPEC["chunk_bytes"],
             item_loader=TokensLoader(), num_workers=1, mode="overwrite")
"""


def write_litdata(directory, documents, *, dtype="int32", chunk_bytes=8000) -> None:
    """`documents` as a LitData dataset written by `litdata.optimize` with `TokensLoader` (skips when absent)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("litdata") is None:
        pytest.skip("litdata is needed (pip install --no-deps litdata lightning-utilities, see benchmarks/peers.py)")
    script = directory.parent / f"{directory.name}-writer.py"
    spec = directory.parent / f"{directory.name}-spec.json"
    script.write_text(_LITDATA_WRITER)
    spec.write_text(json.dumps({"out": str(directory), "documents": [d.tolist() for d in documents], "dtype": dtype,
                                "chunk_bytes": chunk_bytes}))
    run = subprocess.run([sys.executable, str(script), str(spec)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=str(directory.parent))
    if run.returncode != 0:
        raise RuntimeError(f"litdata.optimize failed: {run.stderr[-2000:]}")


# -- hand-made sources (a few bytes each, for hostile and damaged variants) ------------------------------
def mds_shard_bytes(documents, *, dtype: str = "uint16") -> bytes:
    """One raw MDS shard (MDSWriter's layout) of a single column `input_ids` encoded `ndarray:DTYPE`:
    u32 count, u32 offsets[count + 1], the writer's JSON config, then per sample its u32 size and the
    value (one byte `ndim << 2 | 2`, a u32 length, the ids)."""
    import struct

    config = b'{"version": 2}'
    samples = []
    for ids in documents:
        value = bytes([1 << 2 | 2]) + struct.pack("<I", len(ids)) + np.asarray(ids, dtype=dtype).tobytes()
        samples.append(struct.pack("<I", len(value)) + value)
    start = 4 * (len(samples) + 2) + len(config)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in samples])]).astype(np.int64) + start
    return struct.pack("<I", len(samples)) + offsets.astype("<u4").tobytes() + config + b"".join(samples)


def mds_entry(raw: bytes, samples: int, *, stored: bytes | None = None, basename: str = "shard.00000.mds",
              dtype: str = "uint16") -> dict:
    """The index.json entry of a hand-made shard (`stored`: its zstd form, when compressed)."""
    import hashlib

    entry = {"format": "mds", "version": 2, "column_names": ["input_ids"], "column_encodings": [f"ndarray:{dtype}"],
             "column_sizes": [None], "samples": samples, "compression": None, "hashes": ["sha1"],
             "size_limit": 1 << 26,
             "raw_data": {"basename": basename, "bytes": len(raw), "hashes": {"sha1": hashlib.sha1(raw).hexdigest()}},
             "zip_data": None}
    if stored is not None:
        entry["compression"] = "zstd"
        entry["zip_data"] = {"basename": f"{basename}.zstd", "bytes": len(stored),
                             "hashes": {"sha1": hashlib.sha1(stored).hexdigest()}}
    return entry


def write_hand_made_mds(directory, documents, *, compressed: bool = False) -> dict:
    """A one-shard MDS dataset written without MosaicML Streaming; returns its index."""
    import json

    import zstandard

    directory.mkdir(parents=True, exist_ok=True)
    raw = mds_shard_bytes(documents)
    stored = zstandard.ZstdCompressor().compress(raw) if compressed else None
    entry = mds_entry(raw, len(documents), stored=stored)
    name = entry["zip_data"]["basename"] if compressed else entry["raw_data"]["basename"]
    (directory / name).write_bytes(stored if compressed else raw)
    index = {"version": 2, "shards": [entry]}
    (directory / "index.json").write_text(json.dumps(index))
    return index


def litdata_chunk_bytes(documents, *, dtype: str = "int32") -> bytes:
    """One LitData chunk of TokensLoader items: u32 count, u32 offsets[count + 1] (absolute), the ids."""
    import struct

    items = [np.asarray(ids, dtype=dtype).tobytes() for ids in documents]
    start = 4 * (len(items) + 2)
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in items])]).astype(np.int64) + start
    return struct.pack("<I", len(items)) + offsets.astype("<u4").tobytes() + b"".join(items)


def write_hand_made_litdata(directory, documents) -> dict:
    """A one-chunk LitData dataset (int32 ids, `no_header_tensor:15`) written without litdata; returns its index."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    chunk = litdata_chunk_bytes(documents)
    (directory / "chunk-0-0.bin").write_bytes(chunk)
    index = {"chunks": [{"filename": "chunk-0-0.bin", "chunk_size": len(documents), "chunk_bytes": len(chunk),
                         "dim": sum(len(d) for d in documents)}],
             "config": {"data_format": ["no_header_tensor:15"], "compression": None, "item_loader": "TokensLoader",
                        "chunk_bytes": 8000, "chunk_size": None, "data_spec": None}}
    (directory / "index.json").write_text(json.dumps(index))
    return index


def write_hand_made_hf(directory, documents) -> dict:
    """A `save_to_disk` directory (one Arrow stream file and its state.json) written with pyarrow alone;
    returns the state."""
    import json

    import pyarrow as pa

    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": pa.array([list(map(int, d)) for d in documents], pa.list_(pa.int32()))})
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (directory / "state.json").write_text(json.dumps(state))
    return state
