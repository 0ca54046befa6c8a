"""obstore's store is built once per process (issue 47, item 3): a fresh process's first requests come from several
threads at once (the node cache GETs the manifest, its binary index and its block indexes together), and each built
a store of its own before (two or three builds, contending for the GIL, before the first request could leave).
S3 through moto on loopback."""

from __future__ import annotations

import threading
import time

import pytest

from shardkit.object_store import ObjectStoreObjects
from shardkit.storage import Storage


def test_threads_that_ask_at_once_share_one_store(s3_bucket, monkeypatch):
    pytest.importorskip("obstore")
    monkeypatch.delenv("SHARDKIT_STORAGE_CLIENT", raising=False)
    url, options = s3_bucket
    storage = Storage(url, options)
    assert storage.client == "obstore"
    storage.write_bytes("a", b"x")
    storage = Storage(url, options)  # no store built yet
    builds: list[str] = []
    build = ObjectStoreObjects._build

    def slow_build(self, module):  # a build long enough that threads asking at once overlap it
        builds.append(threading.current_thread().name)
        time.sleep(0.2)
        build(self, module)

    monkeypatch.setattr(ObjectStoreObjects, "_build", slow_build)
    start = threading.Barrier(4)
    answers: list[bool] = []

    def ask() -> None:
        start.wait()
        answers.append(storage.exists("a"))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [True] * 4
    assert len(builds) == 1, builds
