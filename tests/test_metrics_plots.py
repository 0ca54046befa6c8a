"""Pictures without a server: `shardkit plot` adds data wait and throughput over time; `shardkit inspect
--plot` draws sample lengths and tokens per source, counted exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardkit.cli import main
from shardkit.formats import Sample, write_dataset
from shardkit.manifest import TokenizerInfo
from shardkit.train.plot import over_time, plot_dataset, read_metrics

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_adds_data_wait_and_throughput_over_time(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 5.0 / s, "tokens_per_s": 100.0 * s, "data_wait_fraction": s / 40,
                "time": 1000.0 + 30 * s} for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == PNG
    series = over_time(read_metrics(run)[0])
    assert series["minutes"][0] == 0 and series["minutes"][-1] == pytest.approx(19 * 30 / 60)
    assert series["data_wait"].tolist() == [s / 40 for s in range(1, 21)]
    assert series["tokens_per_s"].tolist() == [100.0 * s for s in range(1, 21)]


def mixed_source_samples(count: int, rng) -> list[Sample]:
    """Samples of 1-3 document segments from three sources, lengths 5-40, some padding (source -1)."""
    samples = []
    for i in range(count):
        length = int(rng.integers(5, 41))
        cuts = sorted({0, *map(int, rng.integers(1, length, size=int(rng.integers(0, 3))))})
        sources = [int(rng.integers(-1, 3)) for _ in cuts]
        samples.append(Sample(rng.integers(0, 256, length).astype(np.uint16), np.array(cuts), np.array(sources),
                              np.arange(len(cuts)) + 10 * i))
    return samples


def test_inspect_plot_counts_every_sample_length_and_the_tokens_of_each_source(tmp_path, capsys):
    samples = mixed_source_samples(120, np.random.default_rng(3))
    url = str(tmp_path / "ds")
    write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=256), seq_len=None,
                  packing="none", max_samples=16, sources=("web.jsonl", "books/", "code.parquet"))
    expected = np.zeros(3, np.int64)
    for sample in samples:
        ends = [*sample.doc_starts[1:].tolist(), len(sample.tokens)]
        for start, end, source in zip(sample.doc_starts.tolist(), ends, sample.doc_source.tolist()):
            if source >= 0:
                expected[source] += end - start
    png = tmp_path / "hist.png"
    assert main(["inspect", url, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG
    assert "120 samples of 8 of 8 shards" in capsys.readouterr().err

    from shardkit.formats import ShardReader
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    manifest, storage = load_manifest(url), Storage(url)
    arrays = [ShardReader.from_bytes(storage.read_bytes(s.name), shard=s, manifest=manifest).arrays
              for s in manifest.shards]
    drawn = plot_dataset(arrays, sources=manifest.sources, title="t", output=tmp_path / "again.png")
    assert drawn["tokens_per_source"] == expected.tolist()
    assert sorted(drawn["sample_lengths"].tolist()) == sorted(len(s.tokens) for s in samples)


def test_inspect_plot_refuses_a_bad_shard_count(tmp_path, capsys):
    url = str(tmp_path / "ds")
    write_dataset(url, mixed_source_samples(4, np.random.default_rng(0)),
                  tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=256), seq_len=None, packing="none",
                  sources=("a", "b", "c"))
    assert main(["inspect", url, "--plot", str(tmp_path / "x.png"), "--plot-shards", "0"]) == 2
    assert "--plot-shards must be >= 1" in capsys.readouterr().err
