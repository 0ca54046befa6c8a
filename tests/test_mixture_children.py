"""A mixture is a Source over Sources (`shardkit.loaders.sources.mixture`): each stream is a child Source that answers
`MixtureChild`, and the mixture reads each stream's items through its child exactly as that stream reads alone."""

from __future__ import annotations

import numpy as np

from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset
from shardkit.loaders.source import MixtureChild, Source
from test_raw_mixture import SEQ_LEN, data, tokenizer  # noqa: F401  (fixtures)
from test_raw_text import rows, take

# Small units: every lane holds several, so the order a lane reads them in (its seed) shows in the samples.
TEXT = dict(seq_len=SEQ_LEN, unit_bytes=1024, lanes=2, seed=7)


def test_every_stream_is_a_child_source_with_its_part_in_the_order(data, tokenizer):  # noqa: F811
    ds = StreamingDataset([Stream(data["a"], 2, raw_text=True), Stream(data["built"], 1)], tokenizer=tokenizer,
                          **TEXT)
    children, parts = ds.source.children, ds.source.stream_parts
    assert all(isinstance(child, (Source, MixtureChild)) for child in children)
    assert [p.lanes for p in parts] == [children[0].corpus.num_lanes, 0]
    assert parts[0].shard_sizes is None and np.array_equal(parts[1].shard_sizes,
                                                            children[1].sources.manifests[0].columns.samples)
    assert [p.identity for p in parts] == [child.identity() for child in children] == ds.stream_identities()


def test_a_later_raw_streams_items_are_its_own_datasets_samples_under_its_seed_key(data, tokenizer):  # noqa: F811
    """Raw stream B (third in the mixture: seed key 2) gives, as item k, sample k of B read alone with seed + 2."""
    ds = StreamingDataset([Stream(data["a"], 1, raw_text=True), Stream(data["built"], 1),
                           Stream(data["b"], 2, raw_text=True)], tokenizer=tokenizer, **TEXT)
    batches = take(StreamingDataLoader(ds, batch_size=8), 8)
    built = ds.source.order.built_samples
    mixed = {(int(i) - built) // 2: tuple(t.tolist()) for b in batches
             for i, s, t in zip(b["sample_id"], b["stream"], b["tokens"]) if s == 2}
    alone = StreamingDataset(data["b"], tokenizer=tokenizer, **{**TEXT, "seed": TEXT["seed"] + 2})
    own = {i: t for i, _, t in rows(take(StreamingDataLoader(alone, batch_size=len(mixed)), 1))}
    assert sorted(mixed) == list(range(len(mixed))) and mixed == own
    unseeded = StreamingDataset(data["b"], tokenizer=tokenizer, **TEXT)  # the test sees the seed key
    assert {i: t for i, _, t in rows(take(StreamingDataLoader(unseeded, batch_size=len(mixed)), 1))} != own


def test_two_built_children_each_read_and_trace_their_own_samples(data, tokenizer, tmp_path):  # noqa: F811
    """Built rows of a mixture with two built streams are each stream's own samples (global id = the stream's offset
    + its id), and their provenance is what the stream's own dataset says of that id."""
    import json

    from shardkit.tools.build import run_build
    from test_build import WORDS, config, read_samples

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "d.jsonl").write_text("".join(json.dumps({"text": f"other {i}: " + " ".join(WORDS[-i:] * 4)})
                                                    + "\n" for i in range(1, 6)))
    run_build(config([tmp_path / "d"], tmp_path / "built2", tokenizer=tokenizer, seq_len=SEQ_LEN))
    urls = [data["built"], str(tmp_path / "built2")]
    ds = StreamingDataset([Stream(data["a"], 2, raw_text=True), Stream(urls[0], 1), Stream(urls[1], 1)],
                          tokenizer=tokenizer, **TEXT)
    batches = take(StreamingDataLoader(ds, batch_size=8), 10)
    ids, stream, tokens = (np.concatenate([b[k].numpy() for b in batches]) for k in ("sample_id", "stream", "tokens"))
    offsets = ds.source.order.id_offsets
    for s, url in ((1, urls[0]), (2, urls[1])):
        _, own = read_samples(url)
        rows_of = np.flatnonzero(stream == s)
        assert len(rows_of)
        for row in rows_of:
            assert np.array_equal(tokens[row], own[ids[row] - offsets[s]].tokens), (s, row)
    wanted = [int(ids[np.flatnonzero(stream == s)[0]]) for s in (1, 2)]
    found = ds.provenance(wanted).samples
    for s, sample_id in zip((1, 2), wanted):
        alone = StreamingDataset(urls[s - 1]).provenance([sample_id - int(offsets[s])]).samples
        [(_, expected)] = alone.items()
        assert found[sample_id].place == expected.place and found[sample_id].documents == expected.documents
        assert np.array_equal(found[sample_id].tokens, expected.tokens)
