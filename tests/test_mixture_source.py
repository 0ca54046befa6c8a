"""One mixture class (`shardkit.loaders.sources.mixture.MixtureSource`, issue 42): a mixture of built datasets and a
mixture with raw-text streams are the same class, a Source over child Sources, read by the engine its children's
parts choose, the engine a single source of that kind is read by; the feeds talk to that engine."""

from __future__ import annotations

import json

import numpy as np

from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset
from shardkit.loaders.sources.built.engine import EpochEngine
from shardkit.loaders.sources.built.source import BuiltSource
from shardkit.loaders.sources.mixture import MixtureSource
from shardkit.loaders.sources.raw.engine import LaneEngine
from shardkit.loaders.sources.raw.source import RawTextSource
from test_raw_mixture import SEQ_LEN, data, tokenizer  # noqa: F401  (fixtures)

TEXT = dict(seq_len=SEQ_LEN, unit_bytes=1024, lanes=2, seed=7)


def second_built(tmp_path, tokenizer):  # noqa: F811
    from shardkit.tools.build import run_build
    from test_build import WORDS, config

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "d.jsonl").write_text("".join(json.dumps({"text": f"other {i}: " + " ".join(WORDS[-i:] * 4)})
                                                    + "\n" for i in range(1, 6)))
    run_build(config([tmp_path / "d"], tmp_path / "built2", tokenizer=tokenizer, seq_len=SEQ_LEN))
    return str(tmp_path / "built2")


def test_built_and_raw_mixtures_are_one_class_read_by_the_engine_of_their_childrens_kind(data, tokenizer, tmp_path):  # noqa: F811
    other = second_built(tmp_path, tokenizer)
    built = StreamingDataset([Stream(data["built"], 2), Stream(other, 1)], cache_dir=str(tmp_path / "cache"))
    mixed = StreamingDataset([Stream(data["a"], 2, raw_text=True), Stream(data["built"], 1)], tokenizer=tokenizer,
                             **TEXT)
    assert type(built.source) is type(mixed.source) is MixtureSource
    assert isinstance(built.source.engine, EpochEngine) and isinstance(mixed.source.engine, LaneEngine)
    assert not built.source.endless and mixed.source.endless
    # every child is a Source of one stream; a built mixture's children read by shards, so the epoch engine
    assert [type(c) for c in built.source.children] == [BuiltSource, BuiltSource]
    assert [type(c) for c in mixed.source.children] == [RawTextSource, BuiltSource]
    assert all(p.lanes == 0 for p in built.source.stream_parts) and mixed.source.stream_parts[0].lanes > 0
    assert [p.identity for p in built.source.stream_parts] == built.stream_identities()
    # the single sources hold the same engines, and every feed talks to the engine, not to the source
    alone = StreamingDataset(data["built"], cache_dir=str(tmp_path / "cache"))
    raw = StreamingDataset(data["a"], tokenizer=tokenizer, **TEXT)
    assert isinstance(alone.source.engine, EpochEngine) and isinstance(raw.source.engine, LaneEngine)
    for dataset in (built, mixed, alone, raw):
        assert StreamingDataLoader(dataset, batch_size=4).feed.source is dataset.source.engine


def test_a_built_mixtures_children_are_its_streams_as_datasets_of_their_own(data, tokenizer, tmp_path):  # noqa: F811
    """A built mixture's rows are its streams' own samples (global id = the stream's first id + its own), and each
    child says of its id what the stream's own dataset says of it."""
    urls = [data["built"], second_built(tmp_path, tokenizer)]
    ds = StreamingDataset([Stream(urls[0], 1), Stream(urls[1], 1)], cache_dir=str(tmp_path / "cache"))
    batches = list(StreamingDataLoader(ds, batch_size=2))  # one epoch
    ids = np.concatenate([b["sample_id"].numpy() for b in batches])
    tokens = np.concatenate([b["tokens"].numpy() for b in batches])
    first = [0, ds.source.children[0].num_samples]
    streams = (ids >= first[1]).astype(int)
    assert set(streams.tolist()) == {0, 1}
    for s, url in enumerate(urls):
        child, alone = ds.source.children[s], StreamingDataset(url, cache_dir=str(tmp_path / "cache"))
        assert child.identity() == alone.identity() == ds.stream_identities()[s]
        local = [int(i) - first[s] for i in ids[streams == s]]
        mine, own = child.provenance(local).samples, alone.provenance(local).samples
        whole = ds.provenance([i + first[s] for i in local]).samples
        for i, row in zip(local, np.flatnonzero(streams == s)):
            assert mine[i].place == own[i].place == whole[i + first[s]].place
            assert np.array_equal(mine[i].tokens, tokens[row]) and np.array_equal(own[i].tokens, tokens[row])
