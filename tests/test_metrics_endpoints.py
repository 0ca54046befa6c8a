"""The build's and the loader's Prometheus endpoints, scraped over HTTP during real runs.

Counters never decrease between scrapes, and what the endpoint finally says equals the run's own
accounting: build_report.json for the build, the shards' stored sizes for the loader's downloads.
"""

from __future__ import annotations

import gc
import json

import pytest

from conftest import accepts, free_port, outside_address
from metrics_scrape import Scraper, check_counters_increase, parse, scrape, total
from shardkit import metrics
from shardkit.cli.main import main
from shardkit.manifest import load_manifest
from test_build import write_corpus

prometheus_client = pytest.importorskip("prometheus_client")


def snapshot():
    return parse(prometheus_client.generate_latest(metrics.registry()).decode())


@pytest.mark.slow
def test_build_endpoint_counts_what_the_report_says(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    output = tmp_path / "ds"
    port = free_port()
    before = snapshot()  # the registry is per process: compare what this build added
    with Scraper([port], interval=0.02) as scraper:
        assert main(["build", str(corpus), "--output", str(output), "--tokenizer", "byte", "--seq-len", "64",
                     "--shard-size", "20000", "--unit-size", "4096", "--workers", "2", "--no-progress",
                     "--format", "tar", "--metrics-port", str(port)]) == 0
    _, final = scrape(port)  # the server outlives the build in this process
    series = scraper.series[port] + [final]
    assert len(series) >= 3, "the endpoint was not reachable while the build ran"
    assert check_counters_increase(series) > 0
    report = json.loads((output / "build_report.json").read_text())
    manifest = load_manifest(str(output))

    def added(name, **labels):
        return total(final, name, **labels) - total(before, name, **labels)

    docs = report["documents"]
    assert added("shardkit_build_documents_read_total") == docs["in"]
    assert added("shardkit_build_documents_written_total") == docs["written"]
    assert docs["rejected"] > 0
    for reason, count in docs["rejected_by_reason"].items():
        assert added("shardkit_build_documents_rejected_total", reason=reason) == count
    assert added("shardkit_build_documents_rejected_total") == docs["rejected"]
    assert added("shardkit_build_tokens_total") == report["timing"]["tokens_this_run"]
    assert added("shardkit_build_shards_written_total", shard_format="tar") == report["totals"]["shards"] > 1
    assert added("shardkit_build_output_bytes_total", shard_format="tar") == report["totals"]["compressed_bytes"]
    assert added("shardkit_build_input_bytes_total") == sum(i["bytes"] for i in manifest.build["inputs"])
    assert 0 < added("shardkit_build_worker_busy_seconds_total") < 2 * report["timing"]["seconds"] + 1


@pytest.mark.slow
@pytest.mark.s3
def test_loader_endpoint_aggregates_its_workers_and_shows_no_credentials(tmp_path, s3_bucket, monkeypatch):
    """Two DataLoader workers over S3 with secrets in storage_options: their downloads reach the parent's
    endpoint (exactly the shards' stored bytes), and no secret appears in any label or value."""
    from shardkit import StreamingDataLoader, StreamingDataset, metrics

    # The cache-bytes gauge covers every cache directory this process has used: earlier tests in the same
    # pytest process used others (the default one among them), so this test starts the gauge afresh.
    monkeypatch.setattr(metrics, "_cache_roots", set())
    from shardkit.loaders import start_metrics_server
    from train_runs import write_byte_dataset

    url, options = s3_bucket
    secret = "sEcReT-metrics-test-0123456789"
    options = {**options, "key": "AKIAMETRICSTESTKEY01", "secret": secret}
    write_byte_dataset(url, num_samples=96, storage_options=options)
    manifest = load_manifest(url, options)
    port = start_metrics_server(free_port(), addr="127.0.0.1")
    # A loader iterator an earlier test abandoned publishes its batch counts when it is collected;
    # collect such garbage now so that it cannot land between the two snapshots.
    gc.collect()
    before = snapshot()
    dataset = StreamingDataset(url, storage_options=options, cache_dir=str(tmp_path / "cache"), shuffle=True,
                               seed=1)
    loader = StreamingDataLoader(dataset, batch_size=8, num_workers=2)
    with Scraper([port], interval=0.02) as scraper:
        batches = sum(1 for _ in loader)
    text, final = scrape(port)
    assert check_counters_increase(scraper.series[port] + [final]) > 0
    stream = {"stream": "data", "shard_format": manifest.shard_format}

    def added(name, **labels):
        return total(final, name, **labels) - total(before, name, **labels)

    # Each shard is downloaded once (fresh cache), by whichever worker needed it first.
    assert added("shardkit_loader_downloaded_bytes_total", **stream) == sum(s.compressed_bytes for s in manifest.shards)
    # Every shard open is a hit or a miss (a shard a prefetch thread fetched first is a hit).
    assert (added("shardkit_cache_hits_total", stream="data") + added("shardkit_cache_misses_total", stream="data")
            >= len(manifest.shards))
    assert added("shardkit_storage_requests_total", operation="read") >= len(manifest.shards)
    assert added("shardkit_loader_batches_total") == batches == len(loader)
    assert added("shardkit_loader_decode_seconds_total", **stream) > 0
    on_disk = sum(path.stat().st_size for path in (tmp_path / "cache").rglob("*.skd"))
    assert total(final, "shardkit_cache_bytes") == on_disk > 0
    for forbidden in (secret, "AKIAMETRICSTESTKEY01", str(tmp_path), "s3://"):
        assert forbidden not in text


def test_endpoints_listen_on_loopback_unless_an_address_is_given(tmp_path):
    outside = outside_address()
    if outside is None:
        pytest.skip("this machine has no interface besides loopback")
    port = metrics.start_metrics_server(free_port())
    assert accepts("127.0.0.1", port) and not accepts(outside, port)
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    port = free_port()
    assert main(["build", str(corpus), "--output", str(tmp_path / "ds"), "--tokenizer", "byte", "--seq-len", "64",
                 "--no-progress", "--metrics-port", str(port), "--metrics-address", outside]) == 0
    assert accepts(outside, port)  # the server outlives the build in this process


def test_a_counter_refuses_to_go_down_where_it_is_asked_and_a_gauge_does_not():
    before = metrics.value("shardkit_build_tokens_total")
    with pytest.raises(ValueError, match="counter shardkit_build_tokens_total cannot go down"):
        metrics.inc("shardkit_build_tokens_total", -5)
    assert metrics.value("shardkit_build_tokens_total") == before  # nothing pending to fail later either
    metrics.inc("shardkit_build_tokens_total", 5)
    assert metrics.value("shardkit_build_tokens_total") == before + 5
    gauge = next(spec for spec in metrics.METRICS if spec.kind == "gauge" and not spec.labels).name
    level = metrics.value(gauge)
    metrics.inc(gauge, 2)
    metrics.inc(gauge, -3)
    assert metrics.value(gauge) == level - 1
