"""Closing what a reader left open (shardkit/loaders/delivery/closing.py): a shard handle the garbage collector drops
is closed outside the collector, so no lock is ever taken from `__del__`; and a reading generator left
unfinished is closed before the interpreter's teardown, so a user's clean exit prints nothing."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from loader_helpers import VOCAB, fixed_sample, write_fixed
from shardkit.errors import CorruptShardError
from shardkit.formats import write_dataset
import shardkit.loaders.cache.shard_cache as cache_module
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import Storage

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def blocks_url(tmp_path, monkeypatch) -> str:
    """Format v2 shards of many blocks, each the same size, read block by block however small."""
    monkeypatch.setattr(cache_module, "WHOLE_READ_BYTES", 0)
    url = str(tmp_path / "blocks")
    write_dataset(url, (fixed_sample(i, 65) for i in range(480)), seq_len=64, packing="concat", max_samples=120,
                  tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB), format_version=2,
                  block_bytes=2048)
    return url


def test_a_handle_collected_inside_its_shards_lock_is_closed_without_a_deadlock(blocks_url, tmp_path):
    """A handle on a shard arriving block by block, in a reference cycle, collected while the same thread
    holds the shard's lock (as the background completion does while it reads the block index). Its close
    used to run inside the collection and wait for that lock: a thread waiting for itself, forever. Now the
    close runs in the closing thread once the lock is free, and still finishes and stores the shard."""
    cache = cache_module.ShardCache(Storage(blocks_url), load_manifest(blocks_url), str(tmp_path / "cache"),
                                    cache_mode="compressed")
    partials = []

    def drop_a_handle_inside_the_lock() -> None:
        handle = cache.open(0, on_demand=True)
        assert not handle.complete
        partials.append(handle.partial)
        cycle = [handle]
        cycle.append(cycle)  # only the collector frees it
        del handle, cycle
        with partials[0]._lock:
            gc.collect()

    thread = threading.Thread(target=drop_a_handle_inside_the_lock, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the collected handle's close waited for a lock its own thread held"
    deadline = time.monotonic() + 30
    while partials[0]._completion is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the closing thread starts the completion
    cache.drain(30)
    assert cache.is_cached(0), "the dropped handle's shard was finished and stored, as a closed one's is"


def test_a_same_size_shard_swapped_in_is_refused_cleanly_with_collections_everywhere(tmp_path):
    """`cache_mode="compressed"`, a cold cache, and a shard replaced by another valid shard of the same size
    (only the hash tells them apart), with the collector running at nearly every allocation so that it runs
    inside the read path's locked sections: the read raises `CorruptShardError` naming the shard, and
    returns (it used to hang in a handle's `__del__`, the case of issue 34)."""
    from shardkit import StreamingDataLoader, StreamingDataset

    url = str(tmp_path / "ds")
    manifest = write_fixed(url, 4000, per_shard=1000, seq_len=512)  # 2.5 MB shards: read block by block
    first, second = manifest.shards[0], manifest.shards[1]
    assert first.compressed_bytes == second.compressed_bytes
    shutil.copy(os.path.join(url, second.name), os.path.join(url, first.name))
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1,
                               cache_mode="compressed")
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            for _ in StreamingDataLoader(dataset, batch_size=4):
                pass
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - checked below
            outcome.append(err)

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(120)
    finally:
        gc.set_threshold(*thresholds)
    assert not reader.is_alive(), "the read of a swapped shard hung"
    assert isinstance(outcome[0], CorruptShardError), outcome
    assert first.name in str(outcome[0])
    for shard_cache in dataset.caches:
        shard_cache.drain(30)


# -- a clean exit prints nothing ------------------------------------------------------------------------
EXITS = {
    # 34.15: a `break` out of the loader's loop, the iterator still held by a global.
    "loader_iterator_kept": """
        import torch  # first, as a training script does: the teardown's order depends on it
        from shardkit import StreamingDataLoader, StreamingDataset
        dataset = StreamingDataset(URL, cache_dir=CACHE, rank=0, world_size=1)
        iterator = iter(StreamingDataLoader(dataset, batch_size=8))
        for step, batch in enumerate(iterator):
            if step == 2:
                break
        """,
    "dataset_iterator_kept": """
        from shardkit import StreamingDataset
        iterator = iter(StreamingDataset(URL, cache_dir=CACHE, rank=0, world_size=1, batch_size=8))
        next(iterator)
        """,
    # 35.9: the torchdata recipe with 0 workers, stopped at max_steps mid-epoch.
    "torchdata_stateful_0_workers": """
        from torchdata.stateful_dataloader import StatefulDataLoader
        from shardkit import StreamingDataset
        dataset = StreamingDataset(URL, cache_dir=CACHE, rank=0, world_size=1, batch_size=8)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
        step = 0
        for batch in loader:
            step += 1
            if step == 5:
                state = loader.state_dict()
                break
        """,
}


@pytest.mark.parametrize("case", sorted(EXITS))
def test_a_clean_exit_prints_nothing(tmp_path, case):
    """A script that stops reading early and exits, in a fresh interpreter: nothing on stderr (the
    generators' `finally` used to run in the interpreter's teardown and print "Exception ignored")."""
    url = str(tmp_path / "ds")
    write_fixed(url, 400, per_shard=50)
    script = f"URL, CACHE = {url!r}, {str(tmp_path / 'cache')!r}\n" + textwrap.dedent(EXITS[case])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # torchdata's own deprecation warnings are not ours
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env,
                          cwd=TESTS)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr


def test_flush_waits_for_earlier_closes_and_returns_at_once_inside_the_closing_thread():
    """`flush` from ordinary code returns after what was handed over before it ran; a close that itself flushes
    (a handle whose close drains a cache) returns at once instead of waiting for itself."""
    from shardkit.loaders.delivery.closing import Closer

    closer = Closer()
    closer.start()
    ran, inner = [], []
    gate = threading.Event()
    closer.later(lambda: (gate.wait(5), ran.append("first")))
    closer.later(lambda: inner.append(closer.flush(timeout=5)))
    gate.set()
    assert closer.flush(timeout=10) and ran == ["first"] and inner == [True]
    # Another thread named like the closer is not the closer: its flush still waits for the closes before it.
    closer.later(lambda: (time.sleep(0.2), ran.append("second")))
    waited = []
    impostor = threading.Thread(target=lambda: waited.append(closer.flush(timeout=10)), name="shardkit-closer")
    impostor.start()
    impostor.join()
    assert waited == [True] and ran == ["first", "second"]
