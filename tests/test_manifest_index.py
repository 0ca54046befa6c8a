"""The binary manifest index, the declared-count checks and the lazy start of an epoch.

Issue 14 item 3 (many shards, long epochs) and issue 10 item 6 (absurd declared counts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from loader_helpers import write_fixed

from shardkit.errors import ManifestError
from shardkit.loaders.dataset import StreamingDataset
from shardkit.loaders.order.partition import worker_step_chunks
from shardkit.manifest import (
    INDEX_NAME,
    MANIFEST_NAME,
    Manifest,
    TokenizerInfo,
    json_digest,
    load_manifest,
    load_manifest_and_digest,
    write_index,
    write_manifest,
)
from shardkit.shard_columns import ShardColumns
from shardkit.storage import Storage


@pytest.fixture
def indexed(tmp_path):
    url = str(tmp_path / "ds")
    manifest = write_fixed(url, 300, seq_len=8, per_shard=50)
    write_manifest(Storage(url), manifest, index=True)
    return url, manifest


def test_index_loads_the_same_manifest_as_columns(indexed):
    url, manifest = indexed
    loaded = load_manifest(url)
    assert isinstance(loaded.shards, ShardColumns)  # read through the index, not the JSON
    assert loaded == manifest and list(loaded.shards) == list(manifest.shards)
    assert loaded.totals() == manifest.totals() and loaded.to_json() == manifest.to_json()
    assert np.array_equal(loaded.columns.samples, [s.samples for s in manifest.shards])
    # Format version 3 (tar, group layout): every shard's block index location and hash survive the binary index.
    assert loaded.format_version == manifest.format_version == 3 and all(s.has_block_index for s in loaded.shards)


def test_stale_or_damaged_index_falls_back_to_the_json(indexed, caplog):
    url, manifest = indexed
    storage = Storage(url)
    edited = manifest.with_shards(manifest.shards[:-1])  # a JSON rewritten without its index
    storage.write_bytes(MANIFEST_NAME, edited.to_json().encode())
    with caplog.at_level(logging.WARNING, logger="shardkit.manifest"):
        loaded = load_manifest(url)
    assert loaded == edited and not isinstance(loaded.shards, ShardColumns)
    assert "was not made from this" in caplog.text
    write_index(url)
    assert isinstance(load_manifest(url).shards, ShardColumns)
    path = storage.path(INDEX_NAME)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardkit.manifest"):
        assert load_manifest(url) == edited
    assert "index checksum mismatch" in caplog.text and f"{url}/{INDEX_NAME}" in caplog.text


@pytest.mark.parametrize("where", ["local", "memory"])  # a local file is read in parts, a store's object whole
@pytest.mark.parametrize("damage", ["columns", "names", "digest", "truncated"])
def test_any_damaged_byte_of_the_index_is_caught(indexed, tmp_path, caplog, where, damage):
    url, manifest = indexed
    if where == "memory":
        url = f"memory://{tmp_path.name}/ds"
        write_manifest(Storage(url), manifest, index=True)
    storage = Storage(url)
    assert isinstance(load_manifest(url).shards, ShardColumns)
    data = bytearray(storage.read_bytes(INDEX_NAME))
    names = sum(len(s.name.encode()) for s in manifest.shards)
    columns = 16 + int.from_bytes(data[8:16], "little") + 8  # past the header: inside the first column
    at = {"columns": columns + 3, "names": len(data) - 32 - names // 2, "digest": len(data) - 5}.get(damage)
    if at is None:
        del data[-40:]
    else:
        data[at] ^= 1
    storage.write_bytes(INDEX_NAME, bytes(data))
    with caplog.at_level(logging.WARNING, logger="shardkit.manifest"):
        loaded = load_manifest(url)
    assert loaded == manifest and not isinstance(loaded.shards, ShardColumns)  # the JSON decided
    assert "checksum mismatch" in caplog.text or "too short" in caplog.text


def test_small_manifests_get_no_index_and_lose_a_stale_one(indexed):
    url, manifest = indexed
    write_manifest(Storage(url), manifest)  # 6 shards: below INDEX_MIN_SHARDS
    assert not Storage(url).exists(INDEX_NAME)


@pytest.mark.parametrize("bad, match", [
    ("../escape.tar", "has an empty, '.' or '..' component"),
    ("s3://elsewhere/x.tar", "names a drive or a URL scheme"),
    ("C:x.tar", "names a drive or a URL scheme"),
    ("/abs.tar", "is an absolute path"),
    ("dir/", "has an empty, '.' or '..' component"),
    ("dir/..", "has an empty, '.' or '..' component"),
    ("a\x00b", "contains a NUL byte"),
    ("DUPLICATE", "names the same shard twice"),
    (MANIFEST_NAME, f"may not be called {MANIFEST_NAME}"),
])
@pytest.mark.parametrize("chunk", [2, 1 << 17])  # names checked a chunk at a time: the bad one in a later chunk
def test_index_names_are_checked_column_wise(indexed, bad, match, chunk, monkeypatch):
    from shardkit import shard_columns

    monkeypatch.setattr(shard_columns, "_HASH_CHUNK", chunk)
    url, manifest = indexed
    shards = list(manifest.shards)
    name = shards[0].name if bad == "DUPLICATE" else bad
    columns = ShardColumns.from_shards(shards)
    names = [s.name for s in shards]
    names[3] = name  # in the second chunk of 2
    encoded = [n.encode() for n in names]
    offsets = np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype(np.int64)
    forged = ShardColumns(names=b"".join(encoded), name_offsets=offsets, sha256=columns.sha256,
                          has_doc_boundaries=columns.has_doc_boundaries,
                          **{f: getattr(columns, f) for f in ("samples", "tokens", "compressed_bytes", "raw_bytes")})
    from shardkit.shard_columns import encode_index
    storage = Storage(url)
    text = open(storage.path(MANIFEST_NAME), "rb").read()
    storage.write_bytes(INDEX_NAME, encode_index(manifest.to_dict(with_shards=False), forged, json_bytes=text))
    with pytest.raises(ManifestError, match=match):
        load_manifest(url)
    # The node cache skips the checks only for the very index file it checked, never for another one...
    with pytest.raises(ManifestError, match=match):
        load_manifest(url, index_copy=storage.path(INDEX_NAME), checked_index="1:2:3")
    # ...and a remote index (which has no stamp) is always checked.
    with pytest.raises(ManifestError, match=match):
        load_manifest(_copy_to_memory(storage, f"names-{abs(hash(bad))}"))


def _copy_to_memory(storage: Storage, name: str) -> Storage:
    remote = Storage(f"memory://manifest-index/{name}")
    for file in (MANIFEST_NAME, INDEX_NAME):
        remote.write_bytes(file, storage.read_bytes(file))
    return remote


def test_a_remote_index_is_read_as_columns(indexed):
    url, manifest = indexed
    remote = _copy_to_memory(Storage(url), "remote")
    assert json_digest(remote) == json_digest(Storage(url))  # hashed by ranged reads, to the same digest
    loaded = load_manifest(remote)
    assert isinstance(loaded.shards, ShardColumns) and loaded == manifest


def _columns_named(names: list[str]) -> ShardColumns:
    encoded = [n.encode() for n in names]
    n = len(names)
    zeros = np.zeros(n, dtype=np.int64)
    return ShardColumns(names=b"".join(encoded), name_offsets=np.cumsum([0] + [len(e) for e in encoded]),
                        sha256=np.zeros((n, 32), np.uint8), has_doc_boundaries=np.zeros(n, bool), samples=zeros,
                        tokens=zeros, compressed_bytes=zeros, raw_bytes=zeros)


@pytest.mark.parametrize("names, twice", [
    (["a", "b", "a"], "a"),                                             # the whole buffer under 8 bytes
    (["ab", "abc", "abcd"], None),                                      # prefixes are different names
    ([f"s-{i:05d}.tar" for i in range(40)] + ["s-00039.tar"], "s-00039.tar"),  # the last word of the buffer
    (["x" * 16, "x" * 17, "x" * 15, "y" + "x" * 15], None),             # lengths around whole words
    (["\u00e9t\u00e9/1", "\u00e9t\u00e9/2", "long/" * 20 + "z", "long/" * 20 + "z", "q"], "long/" * 20 + "z"),
    # In increasing order (the build's own): checked pairwise, without hashing.
    (["s-1", "s-2", "s-2", "s-3"], "s-2"),                              # equal neighbours, across a chunk edge
    (["x" * 20 + "1", "x" * 20 + "2", "x" * 20 + "2"], "x" * 20 + "2"),  # equal in the third word
    (["a", "ab", "abc", "b", "ba"], None),                              # prefixes first
    (["ab", "ba", "b", "c"], None),                                     # not in order: hashed
])
@pytest.mark.parametrize("chunk", [2, 1 << 17])
def test_duplicate_names_are_found_whatever_their_bytes(names, twice, chunk, monkeypatch):
    from shardkit import shard_columns

    monkeypatch.setattr(shard_columns, "_HASH_CHUNK", chunk)
    columns = _columns_named(names)
    if twice is None:
        columns.check(source="m")
    else:
        with pytest.raises(ManifestError, match="names the same shard twice") as caught:
            columns.check(source="m")
        assert repr(twice) in str(caught.value)


@pytest.mark.parametrize("scan", [3, 4, 5])
@pytest.mark.parametrize("shift", range(5))
@pytest.mark.parametrize("unsafe", ["a/../b.tar", "s3://b.tar", "a//b.tar"])
def test_unsafe_parts_are_found_across_the_edges_of_the_searched_windows(scan, shift, unsafe, monkeypatch):
    from shardkit import shard_columns

    monkeypatch.setattr(shard_columns, "_SCAN_BYTES", scan)  # names searched a few bytes at a time
    columns = _columns_named(["ok.tar", "x" * shift + unsafe])  # the part at every offset in a window
    with pytest.raises(ManifestError, match="component|scheme"):
        columns.check(source="test")


def test_names_numbered_in_order_need_no_hashing():
    from shardkit.shard_columns import _NameWords

    numbered = _columns_named([f"shards/shard-{i:07d}.tar" for i in range(5, 1200, 7)] + ["shards/u"])
    assert numbered._names_increase(_NameWords(numbered.names))  # byte order, across every word
    swapped = _columns_named(["shards/shard-0000010.tar", "shards/shard-0000009.tar"])
    assert not swapped._names_increase(_NameWords(swapped.names))


def test_names_that_are_not_utf8_are_refused():
    columns = _columns_named(["ok.tar", "caf\u00e9.tar"])
    columns.check(source="m")  # non-ASCII UTF-8 is fine
    columns.names = columns.names[:-5] + b"\xff.tar"  # the same length, one byte no longer UTF-8
    with pytest.raises(ManifestError, match="not valid UTF-8"):
        columns.check(source="m")


def _claim(url: str, samples: int, *, sizes: bool) -> None:
    """Edit shard 1 of the manifest to declare `samples` samples, totals kept consistent; with
    `sizes`, its byte sizes too, as far as every bound allows (a careful forger)."""
    path = Storage(url).path(MANIFEST_NAME)
    data = json.load(open(path))
    shard = data["shards"][1]
    shard["samples"], shard["tokens"] = samples, samples * 9
    if sizes:
        shard["raw_bytes"] = shard["tokens"] * 2 + 64 * samples
        shard["compressed_bytes"] = -(-shard["raw_bytes"] // 32768)
    for key in ("samples", "tokens", "raw_bytes", "compressed_bytes"):
        data["totals"][key] = sum(s[key] for s in data["shards"])
    open(path, "w").write(json.dumps(data))


@pytest.mark.parametrize("samples", [400_000_000, 10**15])
def test_absurd_sample_counts_fail_early_small_and_named(tmp_path, samples):
    url = str(tmp_path / "ds")
    manifest = write_fixed(url, 200, seq_len=8, per_shard=50)
    started = time.perf_counter()  # the yardstick: opening the honest dataset, on this machine, now
    StreamingDataset(url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=1, batch_size=4)
    honest = time.perf_counter() - started
    _claim(url, samples, sizes=False)
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(ManifestError) as err:
        StreamingDataset(url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=1, batch_size=4)
    elapsed, (_, peak) = time.perf_counter() - started, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    message = str(err.value)
    assert f"{url}/{MANIFEST_NAME}" in message and manifest.shards[1].name in message
    assert f"declares {samples} samples" in message and "more" in message
    # megabytes, and no longer than opening an honest dataset takes (x 20: one preemption on a busy machine)
    assert peak < 20 * 2**20 and elapsed < 20 * honest, (elapsed, honest)


def test_counts_forged_with_sizes_fail_at_load_or_at_the_first_read_of_that_shard(tmp_path):
    url = str(tmp_path / "ds")
    manifest = write_fixed(url, 200, seq_len=8, per_shard=50)
    _claim(url, 10**15, sizes=True)  # would need a 2.5 TB shard: refused before any plan
    with pytest.raises(ManifestError, match=f"{manifest.shards[1].name} .*compressed_bytes above"):
        StreamingDataset(url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=1, batch_size=4)
    samples = 400_000_000  # possible for a 2 GB shard: the first read of the real 1 KB shard refutes it
    write_fixed(url, 200, seq_len=8, per_shard=50)
    _claim(url, samples, sizes=True)
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=1, batch_size=4,
                               shuffle=False)
    assert dataset.num_samples == 150 + samples
    tracemalloc.start()
    with pytest.raises(ValueError, match=manifest.shards[1].name):
        for _ in dataset:  # the plan is lazy: reaching shard 1 costs nothing more than reaching shard 0
            pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 50 * 2**20


def test_totals_beyond_int64_arithmetic_are_refused(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 100, seq_len=8, per_shard=50)
    path = Storage(url).path(MANIFEST_NAME)
    data = json.load(open(path))
    data["shards"][0]["samples"] = 2**63
    open(path, "w").write(json.dumps(data))
    with pytest.raises(ManifestError, match="below 2\\^63"):
        load_manifest(url)


def _first_chunks_seconds(steps: int) -> float:
    """The fastest of 5 runs of taking an epoch's first two chunks (the fastest: preemptions only add)."""
    times = []
    for _ in range(5):
        started = time.perf_counter()
        chunks = worker_step_chunks(steps, worker=1, num_workers=3, bundle=2, chunk=4)
        assert next(chunks).tolist() == [1]  # the ramp splits the first bundles: one step per message
        assert next(chunks).tolist() == [4]
        times.append(time.perf_counter() - started)
    return min(times)


def test_first_chunk_of_an_epoch_of_1e15_steps_is_immediate():
    # As fast as for an epoch of 100 steps, measured in the same run: the cost does not grow with the epoch.
    small, huge = _first_chunks_seconds(100), _first_chunks_seconds(10**15)
    assert huge < 20 * small, (huge, small)


def test_node_record_lets_later_processes_skip_hashing(indexed, tmp_path, monkeypatch):
    from shardkit import manifest as manifest_module
    import shardkit.loaders.cache.shard_cache as cache_module

    url, manifest = indexed
    calls = []
    real = manifest_module.json_digest
    monkeypatch.setattr(manifest_module, "json_digest", lambda storage: calls.append(1) or real(storage))
    monkeypatch.setattr(manifest_module.Manifest, "from_json", None)  # every load below uses the index
    for _ in range(3):
        assert cache_module.fetch_manifest(Storage(url), str(tmp_path / "node")) == manifest
    assert len(calls) == 1  # once per node
    assert json_digest(Storage(url))[0] == len(manifest.to_json().encode())


@pytest.mark.parametrize("index", [True, False])
def test_the_node_record_holds_the_digest_of_the_json(indexed, index):
    url, manifest = indexed
    write_manifest(Storage(url), manifest, index=index)
    loaded, digest, checked_index = load_manifest_and_digest(Storage(url))
    text = (Path(url) / MANIFEST_NAME).read_bytes()
    assert loaded == manifest and isinstance(loaded.shards, ShardColumns) == index
    assert digest == (len(text), hashlib.sha256(text).hexdigest())
    assert checked_index is None  # the dataset's own index, read whole: nothing for the node to record


def test_prefetch_starts_at_a_node_dependent_offset():
    from shardkit.loaders.sources.built.reading import prefetch_order
    from shardkit.loaders.delivery.topology import Topology

    shards = list(range(40))
    firsts = [prefetch_order(shards, Topology(rank=node * 2, world_size=32, local_rank=0, local_world_size=2))[0]
              for node in range(16)]
    assert len(set(firsts)) >= 12  # the 16 nodes do not all start with the same shard
    for node in range(16):  # each still asks for every shard once, its local rank's own first
        order = prefetch_order(shards, Topology(rank=node * 2 + 1, world_size=32, local_rank=1, local_world_size=2))
        assert sorted(order) == shards and all(s % 2 == 1 for s in order[:20])


def _many_shards(url: str, n: int, per_shard: int = 4) -> Manifest:
    """An indexed manifest of `n` shards (no shard files: nothing here reads one), made as columns."""
    names = b"".join(f"shards/shard-{i:07d}.tar".encode() for i in range(n))
    samples = np.full(n, per_shard, dtype=np.int64)
    manifest = Manifest(shard_format="tar", token_dtype="uint16", seq_len=8, packing="concat",
                        tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=256), shards=ShardColumns(
                            names=names, name_offsets=np.arange(n + 1, dtype=np.int64) * 24,
                            sha256=np.random.default_rng(0).integers(0, 256, (n, 32), dtype=np.uint8),
                            has_doc_boundaries=np.zeros(n, dtype=bool), samples=samples, tokens=samples * 9,
                            compressed_bytes=samples * 100, raw_bytes=samples * 100))
    write_manifest(Storage(url), manifest, index=True)
    return manifest


def test_later_processes_map_the_node_copy_of_the_index_instead_of_reading_it(tmp_path):
    from shardkit.loaders.cache.shard_cache import fetch_manifest

    url, node = str(tmp_path / "ds"), str(tmp_path / "node")
    manifest = _many_shards(url, 40_000)
    index_bytes = (Path(url) / INDEX_NAME).stat().st_size  # ~3.9 MB
    fetch_manifest(Storage(url), node)  # the node's first process: copies, checks and records the index
    tracemalloc.start(30)
    try:
        later = fetch_manifest(Storage(url), node)
        # What the manifest holds, allocated by shardkit's code (numpy and bytes buffers are traced, a mapping is
        # not). Not the process's peak: other threads of the test process (an earlier test's pools, object-store
        # runtimes) allocate meanwhile, and once pushed the peak past the bound in a full run.
        held = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/shardkit/*", all_frames=True),
                                                          tracemalloc.Filter(True, "*/loaders/*", all_frames=True)])
        allocated = sum(stat.size for stat in held.statistics("filename"))
    finally:
        tracemalloc.stop()
    assert later == manifest and isinstance(later.shards, ShardColumns)
    # An index read into memory stays allocated in the manifest's columns; mapped columns hold none of it.
    assert allocated < index_bytes / 3, (allocated, index_bytes)
    maps = Path("/proc/self/maps").read_text()
    copies = [line.split()[-1] for line in maps.splitlines() if line.endswith(INDEX_NAME)]
    # The node's private copy is mapped, never the dataset's own file (which someone may rewrite in place).
    assert copies and all(path.startswith(node) for path in copies), copies


def test_an_index_copy_replaced_under_a_live_mapping_leaves_it_intact(tmp_path):
    from shardkit.loaders.cache.shard_cache import fetch_manifest

    url, node = str(tmp_path / "ds"), str(tmp_path / "node")
    old = _many_shards(url, 20_000)
    held = fetch_manifest(Storage(url), node)  # a rank that keeps its manifest while the dataset changes
    expected = [(s.name, s.sha256, s.samples) for s in old.shards[::997]]
    new = _many_shards(url, 30_000, per_shard=5)  # rebuilt: new JSON and index (written by rename)
    assert fetch_manifest(Storage(url), node) == new  # the node's copy is replaced under the live mapping
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert any(line.endswith(f"{INDEX_NAME} (deleted)") for line in maps)  # the old copy: unlinked, still mapped
    assert len(held.shards) == 20_000
    assert [(s.name, s.sha256, s.samples) for s in held.shards[::997]] == expected
    assert held.columns.samples.sum() == old.columns.samples.sum()
    assert pickle.loads(pickle.dumps(held)) == old  # a mapped manifest still pickles (as copies)


def test_a_damaged_index_copy_is_never_trusted_by_the_node(indexed, tmp_path, caplog):
    from shardkit.loaders.cache.shard_cache import fetch_manifest

    url, manifest = indexed
    storage, node = Storage(url), str(tmp_path / "node")
    data = bytearray(storage.read_bytes(INDEX_NAME))
    data[len(data) - 60] ^= 1  # a name's byte: the header (and its binding to the JSON) stays intact
    storage.write_bytes(INDEX_NAME, bytes(data))
    for process in ("first", "later"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardkit.manifest"):
            loaded = fetch_manifest(storage, node)
        # The first process's checks failed, so the node's record vouches for no index: a later process
        # checks the copy again rather than trusting it, and both read the JSON.
        assert loaded == manifest and not isinstance(loaded.shards, ShardColumns), process
        assert "checksum mismatch" in caplog.text, process
