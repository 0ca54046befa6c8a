"""The README's main command, `shardkit demo`, on a small slice of the embedded corpus."""

from __future__ import annotations

import json

from shardkit.cli import main
from shardkit.cli.demo import stdlib_sources, unigram_entropy_nats, write_corpus


def test_corpus_is_the_standard_library_and_holds_out_files(tmp_path):
    assert len(stdlib_sources()) > 100  # every CPython install ships its sources
    train, val, files = write_corpus(tmp_path, 300_000)
    train_docs = [json.loads(line)["source"] for line in train.open()]
    val_docs = [json.loads(line)["source"] for line in val.open()]
    assert len(train_docs) + len(val_docs) == files
    assert val_docs and not set(train_docs) & set(val_docs)
    assert 2.0 < unigram_entropy_nats(train) < 5.5  # bytes of code: well under log(256) = 5.55


def test_demo_builds_trains_and_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "30", "--corpus-mb", "1", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    plot = out / "run" / "curves.png"
    assert f"loss plot: {plot}" in printed
    assert plot.stat().st_size > 10_000
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0  # 30 steps of byte-level LM do learn
    assert any("eval_loss" in r for r in records)
