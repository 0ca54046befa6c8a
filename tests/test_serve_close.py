"""A service closes in bounded time while a consumer still holds an open stream (an iterator left open: its
stream stays open under gRPC's flow control, and Flight's own shutdown waits for it forever)."""

from __future__ import annotations

import threading

import pytest

from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.serve.data import DataSpec
from shardkit.serve.local import LocalService
from test_build import write_corpus


def test_close_returns_while_a_consumer_iterator_is_open(tmp_path):
    write_corpus(tmp_path / "a", docs=60)
    spec = DataSpec(source=str(tmp_path / "a"), options=dict(tokenizer="byte", seq_len=128, unit_bytes=2048, lanes=7))
    service = LocalService(spec, workers=0, worker_threads=1)
    service.wait_for_workers(1)
    loader = StreamingDataLoader(StreamingDataset(None, service=service.url, service_timeout=5, rank=0,
                                                 world_size=1), batch_size=4)
    batches = iter(loader)
    next(batches), next(batches)  # the stream is open and read ahead into a full queue
    closed = threading.Event()
    threading.Thread(target=lambda: (service.close(grace=1.0), closed.set()), daemon=True).start()
    assert closed.wait(60), "LocalService.close() did not return with a consumer's stream open"
    # The consumer takes what it had read ahead, then learns in one line that no service is left.
    with pytest.raises(Exception, match="data service .* failed for 5 s") as caught:
        for _ in range(10):
            next(batches)
    assert "\n" not in str(caught.value).strip()
