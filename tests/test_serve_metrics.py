"""The data service's Prometheus metrics (issue 43, item 4), scraped over HTTP: the consumer's queue depth (what
it read ahead) and its wait for the service, and the rows each worker sent, counted by the dispatcher from the
workers' heartbeats (rate(): rows/s per worker), beside `shardkit_service_reassignments_total`."""

from __future__ import annotations

import time
from contextlib import closing

from conftest import free_port
from metrics_scrape import scrape, total
from shardkit import metrics
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from test_serve_parts import data, service, spec_of  # noqa: F401 - the module's fixtures

DEPTH, WAIT, ROWS = ("shardkit_service_queue_depth", "shardkit_service_wait_seconds_total",
                     "shardkit_service_worker_rows_total")


def scraped_until(port: int, ready, timeout: float = 10.0) -> dict:
    """Scrape until `ready(samples)` holds (heartbeats come every half second), or fail naming what was seen."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)[1]
        if ready(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError({k: v for k, v in samples.items() if k[0].startswith("shardkit_service")})
        time.sleep(0.1)


def test_the_service_metrics_are_scraped(data, service):
    port = metrics.start_metrics_server(free_port())
    running = service(spec_of(data, "raw"))
    before = scrape(port)[1]
    loader = StreamingDataLoader(StreamingDataset(None, service=running.url), batch_size=6)
    with closing(iter(loader)) as batches:
        rows = sum(len(next(batches)["sample_id"]) for _ in range(8))
        workers = [w["id"] for w in running.workers()]
        # Each of the three workers read a part of the steps; their streams read ahead into the consumer's queues.
        during = scraped_until(port, lambda s: all(total(s, ROWS, worker=w) > total(before, ROWS, worker=w)
                                                   for w in workers) and total(s, DEPTH) > total(before, DEPTH))
        # per stream, at most 4 parts queued and one decoded, waiting for room
        assert total(during, DEPTH) - total(before, DEPTH) <= 3 * (4 + 1)
    sent = sum(total(during, ROWS, worker=w) - total(before, ROWS, worker=w) for w in workers)
    assert rows <= sent <= sum(server.rows_sent for server, _ in running._threads)
    after = scrape(port)[1]
    assert total(after, WAIT) > total(before, WAIT)
    assert total(after, DEPTH) == total(before, DEPTH)  # what was read ahead and never handed out is gone
