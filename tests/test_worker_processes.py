"""DataLoader worker processes: forked safely while the parent's other threads are busy (no lock, thread
pool or flock of the parent may reach a worker in a state that hangs it: shardkit/forking.py, the fork hooks
of shardkit/metrics.py), gone as soon as their loader is dropped (no reference cycle keeps it alive), and
gone when their parent dies (shardkit/loaders/delivery/parent_watch.py).

Each run gives the DataLoader a timeout, so a hung worker fails the test with "DataLoader timed out"
instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from loader_helpers import ids_from_tokens, lock_is_held, write_fixed
from process_tree import descendants, signal_all
from shardkit import StreamingDataLoader, StreamingDataset, metrics
import shardkit.loaders.cache.shard_cache as cache_module

WORKER_TIMEOUT = 60  # seconds a worker may take for one batch before the run counts as hung


def epoch_ids(dataset, *, batch_size: int = 8, timeout: float = WORKER_TIMEOUT) -> np.ndarray:
    loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=2, multiprocessing_context="fork",
                                 timeout=timeout)
    ids = []
    for batch in loader:
        assert np.array_equal(ids_from_tokens(batch["tokens"]), batch["sample_id"].numpy())
        ids.append(batch["sample_id"].numpy().copy())
    return np.concatenate(ids)


def test_workers_forked_while_a_parent_thread_counts_metrics(tmp_path):
    """A thread of the parent records shardkit metrics without pause (as prefetch threads or a trainer's
    do) while the loader forks its workers, epoch after epoch: a fork that caught the metrics lock held
    used to leave the worker hung at its first count."""
    url = str(tmp_path / "ds")
    write_fixed(url, 96, per_shard=16)
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1)
    stop = threading.Event()
    counted = [0]

    def count() -> None:
        while not stop.is_set():
            metrics.inc("shardkit_storage_requests_total", operation="fork-test")
            counted[0] += 1

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    try:
        for epoch in range(6):
            dataset.set_epoch(epoch)
            assert sorted(epoch_ids(dataset).tolist()) == list(range(96)), f"epoch {epoch}"
    finally:
        stop.set()
        thread.join()
    assert counted[0] > 0
    # The parent's counts are intact: the fork hooks hand the lock back in the parent.
    assert metrics.value("shardkit_storage_requests_total", operation="fork-test") >= counted[0]


def test_workers_forked_after_the_parent_read_blocks(tmp_path, monkeypatch, s3_bucket):
    """The parent reads a batch first from S3 (format v2 shards read block by block, in parallel: a pool of
    block-reading threads, idle afterwards), then forks workers that read other shards block by block. An
    inherited pool counts its missing threads as idle and never runs the work: each worker needs its own."""
    monkeypatch.setattr(cache_module, "WHOLE_READ_BYTES", 0)  # every shard read block by block
    from shardkit.formats import write_dataset
    from shardkit.manifest import TokenizerInfo
    from loader_helpers import VOCAB, fixed_sample

    url, options = s3_bucket
    write_dataset(url, (fixed_sample(i, 65) for i in range(480)), seq_len=64, packing="concat", max_samples=120,
                  tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB), format_version=2,
                  block_bytes=2048, storage_options=options)
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), storage_options=options, shuffle=False,
                               rank=0, world_size=1, prefetch=False, chunk_samples=16)
    first = next(iter(StreamingDataLoader(dataset, batch_size=8)))
    assert first["sample_id"].tolist() == list(range(8))
    assert dataset.caches[0]._block_executor is not None, "the parent read blocks through its pool"
    assert not any(dataset.caches[0].is_cached(i) for i in (1, 2, 3)), "the workers read the other shards"
    dataset.caches[0].drain(timeout=60)
    assert sorted(epoch_ids(dataset).tolist()) == list(range(480))


def test_workers_forked_while_a_parent_thread_holds_a_download_lock(tmp_path):
    """A thread of the parent reading through the node cache holds a shard's download lock (an flock) while the
    loader forks its workers, and lets go of it a moment later. An flock belongs to the open file description,
    which the fork shares: each worker held the lock too, for good, and the worker that needed the shard waited
    for it forever (as did every other process of the node)."""
    url, cache_dir = str(tmp_path / "ds"), str(tmp_path / "cache")
    write_fixed(url, 96, per_shard=16)
    dataset = StreamingDataset(url, cache_dir=cache_dir, shuffle=False, rank=0, world_size=1, prefetch=False)
    holding = threading.Event()

    others = set(descendants(os.getpid()))  # e.g. a moto server an earlier test started

    def download_shard_0() -> None:  # what `DecodedStore._fetch` holds while it downloads, as a real reader would
        release = dataset.caches[0].store.claim(0)
        holding.set()
        deadline = time.monotonic() + 30
        while len(set(descendants(os.getpid())) - others) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the loader forked its workers
        time.sleep(0.5)
        release()

    thread = threading.Thread(target=download_shard_0, daemon=True)
    thread.start()
    holding.wait(10)
    assert sorted(epoch_ids(dataset, timeout=20).tolist()) == list(range(96))
    thread.join(10)
    assert not lock_is_held(dataset.caches[0].path(0) + ".dl"), "no process holds the download lock afterwards"


def test_a_lock_held_at_fork_time_is_free_in_the_child():
    """The mechanism itself, without timing luck: fork while another thread holds the metrics lock (it is
    released only after the fork); the child must count at once."""
    import multiprocessing as mp

    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with metrics._lock:
            entered.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    entered.wait(10)
    # The fork hook waits for the lock: release it a moment after the fork begins.
    threading.Timer(0.5, release.set).start()
    ctx = mp.get_context("fork")
    done = ctx.Queue()
    start = time.monotonic()
    child = ctx.Process(target=_count_in_child, args=(done,))
    child.start()
    child.join(30)
    holder.join(10)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the forked child hung on a lock another thread of its parent held"
    assert done.get(timeout=5) == 1.0, "the child could not count"
    assert time.monotonic() - start < 30


def _count_in_child(done) -> None:
    if not metrics._lock.acquire(timeout=20):  # what a DataLoader worker's first count does
        done.put("the metrics lock stayed held")
        return
    metrics._lock.release()
    metrics.inc("shardkit_storage_requests_total", operation="child")
    done.put(metrics.value("shardkit_storage_requests_total", operation="child"))


@pytest.mark.parametrize("cache_mode", ["decoded", "none"])
def test_a_dropped_loader_goes_at_once_with_its_workers(tmp_path, cache_mode):
    """A loader over a dataset without a manifest index and with a corrupt shard (quarantined): its last
    reference dropped, it is freed at once, and its persistent workers exit. Errors the read path caught
    (the missing index, the failed check) used to stay in reference cycles holding the caller's frames,
    so the loader and its workers lived on until a garbage collection, which then waited out torch's 5 s
    worker-join timeout per worker."""
    import gc
    import weakref

    from shardkit.manifest import load_manifest

    url = str(tmp_path / "ds")
    write_fixed(url, 96, per_shard=16)
    path = tmp_path / "ds" / load_manifest(url).shards[1].name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # fails its SHA-256 at every read: quarantined
    path.write_bytes(bytes(data))

    def run() -> tuple[weakref.ref, list[int]]:
        dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1,
                                   on_corrupt="skip", cache_mode=cache_mode, chunk_samples=16)
        loader = StreamingDataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True,
                                     multiprocessing_context="fork", timeout=WORKER_TIMEOUT)
        ids = [batch["sample_id"].numpy() for batch in loader]
        assert sorted(np.concatenate(ids).tolist()) == [i for i in range(96) if not 16 <= i < 32]
        return weakref.ref(loader), [worker.pid for worker in loader._iterator._workers]

    gc.collect()
    gc.disable()  # what is freed below is freed by reference counting alone
    try:
        loader, pids = run()
        assert loader() is None, "the dropped loader is still alive (held by a reference cycle)"
    finally:
        gc.enable()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.05)
    assert not alive, f"workers {alive} of the dropped loader are still running"


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False  # reaped
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


# -- a worker does not outlive its parent ---------------------------------------------------------------
ORPHANING_RUN = """
import os, signal, sys, threading
from process_tree import descendants
from shardkit import StreamingDataLoader, StreamingDataset

# Raw text: parts of 32 rows of 2,049 tokens (over 64 KiB a message, more than a pipe holds, as the built batches).
dataset = (StreamingDataset(URL, shuffle=False, rank=0, world_size=1, tokenizer="byte", seq_len=2048,
                            unit_bytes=1 << 16, lanes=4) if RAW
           else StreamingDataset(URL, cache_dir=CACHE, shuffle=False, rank=0, world_size=1))
loader = StreamingDataLoader(dataset, batch_size=32 if RAW else 8, num_workers=2, multiprocessing_context="fork")

def train():
    iterator = iter(loader)
    next(iterator)
    print("WORKERS", *descendants(os.getpid()), flush=True)
    if DEATH == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)

if IN_THREAD:  # a loader iterated in another thread: its workers are not tied to the main thread's end
    thread = threading.Thread(target=train)
    thread.start()
    thread.join()  # (a main thread that ends first starts the interpreter's shutdown: no thread pool then)
else:
    train()
"""


@pytest.mark.parametrize("source, death, in_thread", [("built", "sigkill", False), ("built", "os_exit", True),
                                                    ("raw", "sigkill", False)])
def test_workers_exit_when_their_training_process_dies_hard(tmp_path, figures, source, death, in_thread):
    """A training process dies hard (SIGKILL, `os._exit`) while its loader's two workers hold batches it never
    took: the workers must end too, whatever the source (raw text's workers tokenize ahead endlessly). They used
    to stay forever (parent pid 1): torch's loop noticed the dead parent and returned, but the process then
    waited to flush its last batches into a pipe nobody reads (ours carry the tokens, ~66 KiB a message here,
    more than a pipe holds)."""
    url = str(tmp_path / "ds")
    if source == "raw":
        url = str(tmp_path / "corpus.jsonl")
        words = "the of and a to in is was he for it with as his on be at by had are".split()
        with open(url, "w") as f:
            for i in range(400):
                f.write(json.dumps({"text": " ".join(words[(i * j) % len(words)] for j in range(300))}) + "\n")
    else:
        write_fixed(url, 2000, per_shard=200, seq_len=256)
    script = (f"URL, CACHE, DEATH, IN_THREAD, RAW = {url!r}, {str(tmp_path / 'cache')!r}, {death!r}, {in_thread}, "
              f"{source == 'raw'}\n" + ORPHANING_RUN)
    # Output to a file, not a pipe: the orphaned workers hold what they inherited, and a pipe would not end.
    with open(tmp_path / "out", "w+") as out:
        subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT, timeout=120,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
        died = time.monotonic()
        out.seek(0)
        printed = out.read()
    workers = next((list(map(int, line.split()[1:])) for line in printed.splitlines()
                    if line.startswith("WORKERS")), [])
    assert len(workers) == 2, printed
    deadline = died + ORPHAN_SECONDS
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.05)
    seconds = time.monotonic() - died
    signal_all(alive, signal.SIGKILL)  # a failed run leaves nothing behind
    assert not alive, f"workers {alive} outlived their dead parent by {ORPHAN_SECONDS} s"
    figures.add(f"orphaned_workers_{source}_{death}", runs=1, workers=len(workers), seconds_to_exit=round(seconds, 2))


ORPHAN_SECONDS = 10  # torch's own workers (tensors in shared memory) take up to ~12 s; ours must be quicker


def _running(pid: int) -> bool:
    """Whether process `pid` runs (not merely a zombie that a non-reaping pid 1 keeps), whoever its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_persistent_workers_forked_from_a_thread_that_ended_keep_serving(tmp_path):
    """A loader whose first epoch ran in a thread that has ended since: its persistent workers serve the next
    epoch. (The kernel's parent-death signal follows the forking thread, not the process: asked for in such
    workers, it would kill them when the thread ends.)"""
    url = str(tmp_path / "ds")
    write_fixed(url, 96, per_shard=16)
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1)
    loader = StreamingDataLoader(dataset, batch_size=8, num_workers=2, persistent_workers=True,
                                 multiprocessing_context="fork", timeout=WORKER_TIMEOUT)
    epochs: list[list[int]] = []
    first = threading.Thread(target=lambda: epochs.append([int(i) for b in loader for i in b["sample_id"]]))
    first.start()
    first.join(120)
    time.sleep(0.5)  # a signal on the thread's end would have arrived
    epochs.append([int(i) for b in loader for i in b["sample_id"]])
    assert [sorted(ids) for ids in epochs] == [list(range(96))] * 2
