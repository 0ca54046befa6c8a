"""A child forked after its parent ran obstore (a DataLoader worker) reads through one copy of obstore's extension:
the one its parent loaded for its children before the fork, never run there (issue 47, item 3: no load on the way
to each worker's first batch), or, where the parent has none, one loaded by the child once, however many of its
threads ask at the same moment. S3 through moto on loopback."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from shardkit import object_store_runtime
from shardkit.storage import Storage

pytest.importorskip("obstore")
pytestmark = pytest.mark.s3

THREADS = 4


def _read_in_threads(url: str, options: dict, answers) -> None:
    """In the child: THREADS threads each read the object through a Storage of their own, all at once."""
    start, seen = threading.Barrier(THREADS), []

    def read() -> None:
        storage = Storage(url, options)
        start.wait()
        data = storage.read_bytes("x.bin")
        seen.append((data, id(storage.objects._store_module)))

    threads = [threading.Thread(target=read) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    spare = object_store_runtime._spare
    answers.put({"data": sorted({data for data, _ in seen}), "modules": sorted({module for _, module in seen}),
                 "reads": len(seen), "spare": id(spare[1]) if spare is not None and spare[1] is not None else None})


def _child_answer(url: str, options: dict) -> dict:
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=_read_in_threads, args=(url, options, answers))
    child.start()
    try:
        return answers.get(timeout=90)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


@pytest.fixture
def parent_ran_obstore(s3_bucket, monkeypatch):
    monkeypatch.delenv("SHARDKIT_STORAGE_CLIENT", raising=False)
    url, options = s3_bucket
    storage = Storage(url, options)
    assert storage.client == "obstore"
    storage.write_bytes("x.bin", b"through a copy")
    assert storage.read_bytes("x.bin") == b"through a copy"  # the parent's runtime runs now
    return url, options, storage


def test_a_forked_child_reads_through_the_copy_its_parent_loaded(parent_ran_obstore):
    url, options, storage = parent_ran_obstore
    answer = _child_answer(url, options)
    assert answer["reads"] == THREADS and answer["data"] == [b"through a copy"]
    assert answer["spare"] is not None and answer["modules"] == [answer["spare"]], answer
    # The parent never runs the copy it loaded for its children: it still reads through its own.
    assert object_store_runtime._spare[1] is not storage.objects._store_module
    assert storage.read_bytes("x.bin") == b"through a copy"


def test_threads_of_a_child_asking_at_once_read_through_one_copy(parent_ran_obstore, monkeypatch):
    url, options, _ = parent_ran_obstore
    monkeypatch.setattr(object_store_runtime, "_spare", None)
    monkeypatch.setattr(object_store_runtime, "_load_spare", lambda memfd: None)  # the child loads its own
    monkeypatch.setattr(object_store_runtime, "_copy_for_children", None)  # made again before this fork
    answer = _child_answer(url, options)
    assert answer["reads"] == THREADS and answer["data"] == [b"through a copy"]
    assert answer["spare"] is None and len(answer["modules"]) == 1, answer
