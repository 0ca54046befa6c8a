"""The first batch imports only what reading needs (issue 36): no pandas and no pyarrow.compute, which pyarrow's
`to_numpy`/`flatten` pulled in (0.2-0.3 s of a fresh process's first batch) whenever pandas is installed; no
prometheus_client (50-130 ms; the metrics wait in a dict until someone asks for the registry) and no numpy.ma
(which numpy 2.4's `np.unique` imports on its first call, ~20 ms); and it starts no thread it does not use (the
manifest's copy from a local store, a prefetch of a shard this process already reads block by block). The buffer
reads that replaced pyarrow's conversions give the same arrays. Nor does the first batch import anything at all:
numpy.random, which the order's permutations need, comes with the loaders. A resumed loader's first batch the same
(its state's data fingerprint used np.unique, which imported numpy.ma)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pytest

from loader_helpers import write_fixed
from shardkit.errors import CorruptShardError
from shardkit.formats.arrow_format import _flat

# Runs in a fresh interpreter: the whole-shard path (the decoded cache), the cold path (block by block,
# WHOLE_READ_BYTES 0 as in test_blocks) and the cold path after `load_state_dict` (argv[3], a saved state), each
# through StreamingDataLoader; sys.modules is read after each.
CHILD = """
import json, sys, tempfile, threading
from shardkit.loaders import StreamingDataLoader, StreamingDataset
import shardkit.loaders.cache.shard_cache as cache_module

started = []
start_thread = threading.Thread.start
def counted_start(thread):
    started.append(thread.name)
    return start_thread(thread)
threading.Thread.start = counted_start

def first_batch(url, cold, state=None):
    cache_module.WHOLE_READ_BYTES = 0 if cold else 1 << 40
    started.clear()
    # Chunks of two batches: the next chunk's shards are prefetched while the first is read.
    dataset = StreamingDataset(url, cache_dir=tempfile.mkdtemp(), rank=0, world_size=1, chunk_samples=8)
    loader = StreamingDataLoader(dataset, batch_size=4, num_workers=0)
    if state is not None:
        loader.load_state_dict(state)
    before = set(sys.modules)
    batches = iter(loader)
    assert next(batches)["tokens"].shape[0] == 4
    imported = sorted(set(sys.modules) - before)
    # Read before the iterator goes: closing it completes the shards in the background (threads of their own).
    # The closing thread starts once per process, with its first shard handle (the whole-shard run).
    # The first-batch notice's watcher (loaders.delivery.waiting) only waits on a timer: no read work.
    threads = [name for name in started if name not in ("shardkit-closer", "shardkit-first-batch-notice")]
    return {**{name: name in sys.modules for name in MODULES}, "threads": threads, "imported": imported}

MODULES = json.loads(sys.argv[2])
RUNS = (("whole shard", False, None), ("cold blocks", True, None), ("resumed", True, json.loads(sys.argv[3])))
print(json.dumps({path: first_batch(sys.argv[1], cold, state) for path, cold, state in RUNS}))
"""


UNNEEDED = ["pandas", "pyarrow.compute", "prometheus_client", "numpy.ma"]


@pytest.mark.slow
@pytest.mark.parametrize("shard_format", ["arrow", "tar"])
def test_first_batch_imports_neither_pandas_nor_pyarrow_compute(tmp_path, shard_format):
    if importlib.util.find_spec("pandas") is None:
        pytest.skip("pandas is not installed: the import this test guards against cannot happen here")
    url = str(tmp_path / "ds")
    write_fixed(url, 96, seq_len=16, per_shard=48, shard_format=shard_format)
    result = subprocess.run([sys.executable, "-c", CHILD, url, json.dumps(UNNEEDED), json.dumps(_state_at(url, 5))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert {path: {name: seen[path][name] for name in UNNEEDED} for path in seen} == {
        path: dict.fromkeys(UNNEEDED, False) for path in ("whole shard", "cold blocks", "resumed")}
    # Read whole, the shards are prefetched while the first is read; block by block nothing runs beside the read.
    assert seen["cold blocks"]["threads"] == []
    # Everything the first batch runs is imported with the loaders (numpy.random, for the order's permutations,
    # took 6-20 ms of a fresh process's first batch).
    assert {path: seen[path]["imported"] for path in seen} == {"whole shard": [], "cold blocks": [], "resumed": []}


def _state_at(url: str, batches: int) -> dict:
    """The state of a loader over `url` (batch 4) after `batches` batches, saved in this process."""
    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(url, cache_dir=tempfile.mkdtemp(), rank=0, world_size=1, chunk_samples=8)
    loader = StreamingDataLoader(dataset, batch_size=4, num_workers=0)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    del iterator
    for cache in dataset.caches:
        cache.drain()
    return state


def _reference(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """What `_flat` returned before, through pyarrow's own conversions."""
    offsets = column.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0], column.flatten().to_numpy(zero_copy_only=False)


@pytest.mark.parametrize("value_type", [pa.uint16(), pa.uint32(), pa.int32(), pa.int64()])
def test_buffer_reads_match_pyarrow_on_sliced_and_empty_lists(value_type):
    """`_flat` reads the buffers itself: slice offsets of the lists and of their values must both apply."""
    lists = [[1, 2, 3], [], [4], [5, 6, 7, 8], [9, 10]]
    empty = pa.ListArray.from_arrays(pa.array([0], type=pa.int32()), pa.array([], type=value_type))
    whole = pa.array(lists, type=pa.list_(value_type))
    # A list array over a sliced child: the child's own offset must be applied too.
    shifted_child = pa.ListArray.from_arrays(pa.array([0, 2, 2, 5], type=pa.int32()),
                                             pa.array([99, 1, 2, 3, 4, 5], type=value_type).slice(1))
    for column in (whole, whole.slice(1, 3), whole.slice(3), whole.slice(2, 0), shifted_child, shifted_child.slice(1),
                   empty):
        offsets, values = _flat(column, np.dtype(str(value_type)), shard="s", number=0)
        want_offsets, want_values = _reference(column)
        np.testing.assert_array_equal(offsets, want_offsets)
        np.testing.assert_array_equal(values, want_values)
        assert offsets.dtype == np.int64 and values.dtype == np.dtype(str(value_type))


def test_nulls_in_the_lists_or_their_values_are_corrupt():
    with pytest.raises(CorruptShardError, match="record batch 3 holds nulls"):
        _flat(pa.array([[1, None]], type=pa.list_(pa.uint16())), np.dtype(np.uint16), shard="s", number=3)
    with pytest.raises(CorruptShardError, match="record batch 3 holds nulls"):
        _flat(pa.array([[1], None], type=pa.list_(pa.uint16())), np.dtype(np.uint16), shard="s", number=3)
