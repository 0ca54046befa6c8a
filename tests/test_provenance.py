"""`Source.provenance` (what `shardkit trace` reads), asked through `StreamingDataset.provenance` of built shards, raw
text and a raw mixture with a built stream: every answer's tokens are the ones the loader gave for that sample id,
its documents tile them and name real input documents, and raw text started from a saved state reads less."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset
from shardkit.tools.build import run_build
from test_build import config, write_corpus

SEQ_LEN = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("provenance")
    lines = (write_corpus(root / "words", bad=False, docs=60) / "a.jsonl").read_text().splitlines()
    corpus = root / "corpus"
    corpus.mkdir()
    for k in range(3):  # three files: three units, so three lanes
        (corpus / f"p{k}.jsonl").write_text("\n".join(lines[k::3]) + "\n")
    run_build(config(sorted(corpus.glob("*.jsonl")), root / "built", seq_len=SEQ_LEN, shard_size=4_000))
    return root, corpus


def loader_rows(loader, steps: int) -> dict[int, np.ndarray]:
    """sample id -> tokens of the first `steps` batches."""
    rows, batches = {}, iter(loader)
    for _ in range(steps):
        batch = next(batches)
        rows.update((int(i), t.numpy().copy()) for i, t in zip(batch["sample_id"], batch["tokens"]))
    return rows


def documents_of(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def check(provenance, rows: dict[int, np.ndarray], corpus: Path) -> None:
    assert set(provenance.samples) == set(rows)
    for sample_id, record in provenance.samples.items():
        tokens = np.asarray(record.tokens)
        assert np.array_equal(tokens, rows[sample_id][:len(tokens)]) and len(tokens) == SEQ_LEN + 1, sample_id
        spans = [(d["start"], d["end"]) for d in record.documents]
        assert spans[0][0] == 0 and spans[-1][1] == len(tokens) and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for document in record.documents:
            if document["source"] >= 0:  # byte tokenizer: a segment's bytes are a piece of the document it names
                text = bytes(int(t) for t in tokens[document["start"]:document["end"]] if t < 256).decode(
                    "utf-8", errors="ignore")
                assert text.strip() in documents_of(corpus / Path(document["source_name"]).name)[document["doc"]]


def test_built_samples_name_their_shard_and_documents(data, tmp_path):
    root, corpus = data
    dataset = StreamingDataset(str(root / "built"), cache_dir=str(tmp_path / "cache"), seed=3)
    rows = loader_rows(StreamingDataLoader(dataset, batch_size=4), 3)
    provenance = dataset.provenance(sorted(rows))
    check(provenance, rows, corpus)
    assert provenance.reread == 0
    shards = {s.name for s in dataset.manifests[0].shards}
    assert {r.place["shard"] for r in provenance.samples.values()} <= shards
    with pytest.raises(IndexError, match=f"sample id {dataset.num_samples} is outside"):
        dataset.provenance([dataset.num_samples])


def test_raw_samples_are_made_again_from_a_saved_state(data):
    _, corpus = data
    dataset = StreamingDataset(f"{corpus}/*.jsonl", tokenizer="byte", seq_len=SEQ_LEN, lanes=3)
    loader = StreamingDataLoader(dataset, batch_size=4)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    later = {int(i): t.numpy().copy() for i, t in zip(*(lambda b: (b["sample_id"], b["tokens"]))(next(batches)))}
    from_start = dataset.provenance(sorted(later))
    from_state = dataset.provenance(sorted(later), state=state)
    check(from_start, later, corpus)
    check(from_state, later, corpus)
    assert {r.place["lane"] for r in from_state.samples.values()} == {0, 1, 2}
    # 3 steps of 4 samples were read before the state: made again only from the start.
    assert from_start.reread - from_state.reread == 12
    with pytest.raises(IndexError, match="sample id -1 is negative"):
        dataset.provenance([-1])


def test_a_mixtures_samples_come_from_its_lanes_and_its_shards(data):
    root, corpus = data
    dataset = StreamingDataset([Stream(str(root / "built"), 0.5), Stream(f"{corpus}/*.jsonl", 0.5, raw_text=True)],
                               tokenizer="byte", seq_len=SEQ_LEN, lanes=2)
    rows = loader_rows(StreamingDataLoader(dataset, batch_size=4), 3)
    provenance = dataset.provenance(sorted(rows))
    check(provenance, rows, corpus)
    kinds = {"lane" in r.place for r in provenance.samples.values()}
    assert kinds == {True, False}
