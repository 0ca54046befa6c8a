"""Training straight from raw text: the raw-text StreamingDataset and its loader (exact and elastic resume, the
same documents as `shardkit build`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.sources.documents import dense_segment_ids
from shardkit.loaders.sources.raw.feed import merge_raw_states
from shardkit.text.documents import tokenize_unit
from test_build import config, documents_from_samples, read_samples, write_corpus
from shardkit.loaders.state.envelope import decode

SETTINGS = dict(tokenizer="byte", seq_len=1024, unit_bytes=4096, lanes=5)  # about 30 samples per lane epoch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("raw") / "in", docs=150)


def dataset(corpus, **overrides):
    return StreamingDataset(str(corpus), **{**SETTINGS, **overrides})


def take(loader, steps):
    out, it = [], iter(loader)
    for _ in range(steps):
        out.append({k: v.clone() for k, v in next(it).items()})
    return out


def rows(batches):
    """(sample id, lane epoch, tokens) of every row, in delivery order."""
    return [(int(i), int(e), tuple(t.tolist())) for b in batches
            for i, e, t in zip(b["sample_id"], b["lane_epoch"], b["tokens"])]


def real_tokens(batch):
    """Each row's tokens without padding (padding segments, and a variable batch's tail)."""
    segments = dense_segment_ids(batch["cu_seqlens"], batch["padding_segments"], *batch["tokens"].shape)
    return [t[s >= 0].tolist() for t, s in zip(batch["tokens"], segments)]


def first_epoch(ds, *, batch_size=4):
    """Real tokens of every sample of lane epoch 0: read until every lane has moved on to epoch 1."""
    loader = StreamingDataLoader(ds, batch_size=batch_size)
    lanes = ds.source.corpus.num_lanes
    moved, samples = set(), []
    for batch in loader:
        for sample_id, epoch, tokens in zip(batch["sample_id"].tolist(), batch["lane_epoch"].tolist(),
                                            real_tokens(batch)):
            if epoch == 0:
                samples.append(tokens)
            else:
                moved.add(sample_id % lanes)
        if len(moved) == lanes:
            return samples
    raise AssertionError("unreachable: the loader is endless")


def loader_documents(ds):
    """(file, document number) -> tokens (with EOS) of every accepted document of the loader's units."""
    corpus, docs = ds.source.corpus, {}
    for number in range(len(corpus.units.size)):
        for unit in corpus.segments(number):
            result = tokenize_unit(unit, corpus.documents)
            ends = np.cumsum(result.doc_lengths)
            for end, length, index in zip(ends, result.doc_lengths, result.doc_index):
                docs[(unit.source, int(index))] = result.tokens[end - length:end].tolist()
    return docs


def accepted_documents(ds):
    """Every accepted document's tokens (with EOS), as the build's tokenizer step gives them."""
    return list(loader_documents(ds).values())


def test_batches_carry_tokens_ids_and_document_boundaries(corpus):
    batch = next(iter(StreamingDataLoader(dataset(corpus), batch_size=3)))
    assert batch["tokens"].shape == (3, 1025) and batch["sample_id"].tolist() == [0, 1, 2]
    assert batch["cu_seqlens"][0] == 0 and batch["cu_seqlens"][-1] == 3 * 1025
    assert "_raw_lane_cursors" not in batch


@pytest.mark.parametrize("pack", ["concat", "bestfit"])
def test_every_token_of_every_accepted_document_once_per_lane_epoch(corpus, pack):
    from shardkit import metrics

    reasons = ("malformed JSON", "no 'text' field", "empty document", "invalid UTF-8")
    before = {r: metrics.value("shardkit_loader_documents_rejected_total", reason=r) for r in reasons}
    ds = dataset(corpus, pack=pack)
    samples = first_epoch(ds)
    docs = accepted_documents(ds)
    got = np.concatenate([np.asarray(s, dtype=np.int64) for s in samples])
    want = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
    assert len(got) == len(want) and np.array_equal(np.bincount(got, minlength=300), np.bincount(want, minlength=300))
    # counted by reason as the build counts them, once per corpus though the loader read on into lane epoch 1
    assert ds.source.rejected == {"malformed JSON": 1, "no 'text' field": 1, "empty document": 1, "invalid UTF-8": 1}
    published = {r: metrics.value("shardkit_loader_documents_rejected_total", reason=r) - before[r] for r in reasons}
    assert published == dict(ds.source.rejected)  # and published as a metric, once each


def test_pack_none_gives_the_builds_samples(corpus, tmp_path):
    from shardkit.tools.build import run_build

    out = tmp_path / "built"
    report = run_build(config([corpus], out, packing="none", seq_len=1024)).report
    _, built = read_samples(str(out))
    ds = dataset(corpus, pack="none")
    raw = first_epoch(ds)
    assert sorted(tuple(s) for s in raw) == sorted(tuple(s.tokens.tolist()) for s in built)
    assert ds.source.rejected == report["documents"]["rejected_by_reason"] and ds.source.rejected  # counted as the build counts


def test_documents_are_the_builds_across_ranges_segments_and_row_groups(corpus, tmp_path):
    from shardkit.loaders.sources.raw.units import RANGE, ROW_GROUP, STREAMED
    from shardkit.tools.build import run_build

    run_build(config([corpus], tmp_path / "built", packing="none", seq_len=1024))
    built = documents_from_samples(read_samples(str(tmp_path / "built"))[1])
    ds = dataset(corpus, pack="none")
    units = ds.source.corpus.units
    names = [f.url.rsplit("/", 1)[-1] for f in ds.source.corpus.files]
    kinds = dict(zip(names, units.kinds))
    assert kinds == {"a.jsonl": RANGE, "b.jsonl.gz": STREAMED, "c.jsonl.zst": STREAMED, "d.parquet": ROW_GROUP,
                     "e.txt": STREAMED}
    parts = np.bincount(units.source, minlength=len(names))
    streamed = names.index("c.jsonl.zst")
    assert parts[names.index("a.jsonl")] > 3 and parts[names.index("d.parquet")] == 4 and parts[streamed] == 1
    assert sum(1 for _ in ds.source.corpus.segments(int(np.flatnonzero(units.source == streamed)[0]))) > 3
    raw = loader_documents(ds)
    for source, kind in enumerate(units.kinds):
        mine = {k: v for k, v in raw.items() if k[0] == source}
        theirs = {k: v for k, v in built.items() if k[0] == source}
        assert mine and len(mine) == len(theirs), names[source]
        if kind == RANGE:  # numbered from byte offsets, not line numbers: the same documents, the same tokens
            assert sorted(mine.values()) == sorted(theirs.values()), names[source]
        else:
            assert mine == theirs, names[source]


@pytest.mark.parametrize("pack", ["concat", "bestfit", "none"])
def test_resume_anywhere_in_a_fresh_dataset_continues_exactly(corpus, pack):
    reference = rows(take(StreamingDataLoader(dataset(corpus, pack=pack), batch_size=8), 40))
    for stop in (1, 7, 23):
        loader = StreamingDataLoader(dataset(corpus, pack=pack), batch_size=8)
        head = take(loader, stop)
        state = loader.state_dict()
        resumed = StreamingDataLoader(dataset(corpus, pack=pack), batch_size=8)
        resumed.load_state_dict(state)
        assert rows(head) + rows(take(resumed, 40 - stop)) == reference, stop
    assert {epoch for _, epoch, _ in reference} >= {0, 1}  # the reference crosses into the lanes' second epoch


def test_resume_at_another_batch_size_continues_the_same_global_order(corpus):
    reference = rows(take(StreamingDataLoader(dataset(corpus), batch_size=6), 10))
    loader = StreamingDataLoader(dataset(corpus), batch_size=4)
    head = take(loader, 6)  # 24 positions: 4 global steps of 6
    resumed = StreamingDataLoader(dataset(corpus), batch_size=3)
    resumed.load_state_dict(loader.state_dict())
    # Rows come lane by lane inside each global step: compare sample by sample.
    assert sorted(rows(head) + rows(take(resumed, 12))) == sorted(reference)


def simulated_run(corpus, *, world_size, batch_size, steps, state=None, workers=0):
    """Run `world_size` ranks in this process (explicit rank/world_size); their rows per step concatenated in
    rank order, and the merged state after `steps` steps."""
    return ranks_run(lambda **rank: dataset(corpus, **rank), world_size=world_size, batch_size=batch_size,
                     steps=steps, state=state, workers=workers)


def ranks_run(make_dataset, *, world_size, batch_size, steps, state=None, workers=0):
    """`simulated_run` over the datasets `make_dataset(rank=r, world_size=world_size)`."""
    loaders = [StreamingDataLoader(make_dataset(rank=r, world_size=world_size), batch_size=batch_size,
                                   num_workers=workers, multiprocessing_context="fork" if workers else None)
               for r in range(world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    per_rank = [rows(take(loader, steps)) for loader in loaders]
    ordered = [row for step in range(steps) for rank in range(world_size)
               for row in per_rank[rank][step * batch_size:(step + 1) * batch_size]]
    return ordered, merge_raw_states([loader.local_state_dict() for loader in loaders])


def test_one_two_three_ranks_give_the_same_samples(corpus):
    one, _ = simulated_run(corpus, world_size=1, batch_size=12, steps=5)
    assert simulated_run(corpus, world_size=2, batch_size=6, steps=5)[0] == one
    assert simulated_run(corpus, world_size=3, batch_size=4, steps=5)[0] == one
    assert simulated_run(corpus, world_size=3, batch_size=4, steps=5, workers=2)[0] == one


@pytest.mark.parametrize("before,after", [((2, 6), (3, 4)), ((4, 3), (2, 6)), ((2, 5), (3, 2))])
def test_elastic_resume_from_a_merged_state(corpus, before, after):
    reference, _ = simulated_run(corpus, world_size=1, batch_size=12, steps=14)
    (w1, b1), (w2, b2) = before, after
    head, state = simulated_run(corpus, world_size=w1, batch_size=b1, steps=5)
    tail, _ = simulated_run(corpus, world_size=w2, batch_size=b2, steps=(12 * 14 - len(head)) // (w2 * b2),
                            state=state)
    got = head + tail
    # The same global order: the rows of each global step may come lane-sorted in another grouping, so
    # compare sample by sample.
    assert sorted(got) == sorted(r for r in reference if r[0] < len(got)) and len(got) > 12 * 10


def test_state_with_several_ranks_needs_a_process_group(corpus):
    loader = StreamingDataLoader(dataset(corpus, rank=0, world_size=2), batch_size=2)
    take(loader, 1)
    with pytest.raises(ValueError, match="initialise torch.distributed"):
        loader.state_dict()


def test_a_state_of_other_settings_or_a_built_dataset_is_refused(corpus):
    loader = StreamingDataLoader(dataset(corpus), batch_size=2)
    take(loader, 2)
    state = loader.state_dict()
    other = StreamingDataLoader(dataset(corpus, seq_len=32), batch_size=2)
    with pytest.raises(ValueError, match="seq_len: saved 1024, now 32"):
        other.load_state_dict(state)
    built = {**state, "source": "built"}
    with pytest.raises(ValueError, match="built dataset's"):
        StreamingDataLoader(dataset(corpus), batch_size=2).load_state_dict(built)


def test_two_workers_give_the_samples_of_none_and_resume_across(corpus):
    reference = take(StreamingDataLoader(dataset(corpus), batch_size=6), 20)
    loader = StreamingDataLoader(dataset(corpus), batch_size=6, num_workers=2, multiprocessing_context="fork")
    head = take(loader, 9)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(head, reference) for k in a)
    state = loader.state_dict()
    for workers in (0, 2):  # a workers' state is global: resumed with or without workers
        resumed = StreamingDataLoader(dataset(corpus), batch_size=6, num_workers=workers,
                                      multiprocessing_context="fork" if workers else None)
        resumed.load_state_dict(state)
        assert rows(head) + rows(take(resumed, 11)) == rows(reference)


def test_persistent_workers_continue_where_the_loader_stands_and_resume_exactly(corpus):
    """Persistent workers serve every iteration (the same processes), each from where the loader stands, not from
    where they had read ahead to; the state saved between iterations resumes exactly, in a fresh loader and in this
    one (whose workers are then started again, from the state)."""
    batches = take(StreamingDataLoader(dataset(corpus), batch_size=6), 20)
    reference = rows(batches)
    loader = StreamingDataLoader(dataset(corpus), batch_size=6, num_workers=2, persistent_workers=True,
                                 multiprocessing_context="fork")
    head = take(loader, 4)
    workers = [w.pid for w in loader._iterator._workers]
    head += take(loader, 5)  # the second iteration: the same workers, from step 4
    assert [w.pid for w in loader._iterator._workers] == workers
    assert rows(head) == rows(batches[:9])
    state = loader.state_dict()
    assert rows(take(loader, 3)) == rows(batches[9:12])
    resumed = StreamingDataLoader(dataset(corpus), batch_size=6, num_workers=2, persistent_workers=True,
                                  multiprocessing_context="fork")
    resumed.load_state_dict(state)
    assert rows(head) + rows(take(resumed, 6)) + rows(take(resumed, 5)) == reference
    loader.load_state_dict(state)
    assert rows(take(loader, 11)) == rows(batches[9:])


def test_an_unreadable_input_is_named(tmp_path):
    bad = tmp_path / "broken.jsonl.zst"
    bad.write_bytes(b"\x28\xb5\x2f\xfd garbage that is not a zstd frame")
    ds = StreamingDataset(str(bad), **SETTINGS)  # listing reads no file: the error comes with its first read
    with pytest.raises(OSError, match="broken.jsonl.zst"):
        next(iter(StreamingDataLoader(ds, batch_size=1)))


@pytest.mark.parametrize("bad", [b'{"text": ""}\nnot json\n', b""])
def test_a_lane_without_accepted_documents_is_left_out_not_spun_on(tmp_path, bad):
    """Issue 45 item 8: the order leaves a dry lane out (tests/test_raw_dry_lanes.py); a corpus whose every lane is
    dry is one error naming the cause."""
    (tmp_path / "good.jsonl").write_text("\n".join(f'{{"text": "document {i} {"x" * 50}"}}' for i in range(40)))
    (tmp_path / "bad.jsonl").write_bytes(bad)  # every document rejected, or no document at all
    ds = StreamingDataset(str(tmp_path), tokenizer="byte", seq_len=64, lanes=2)
    assert [len(units) for units in ds.source.corpus.lanes] == [1, 1]
    loader = StreamingDataLoader(ds, batch_size=4)
    assert sorted(i for i, _, _ in rows(take(loader, 2))) == list(range(8))  # lane 0's first 8 samples
    assert loader.counters()["dry_lanes"] == 1
    (tmp_path / "good.jsonl").unlink()
    (tmp_path / "worse.jsonl").write_bytes(bad)
    with pytest.raises(ValueError, match=r"all 2 lanes ran dry \(their units hold no accepted document"):
        take(StreamingDataLoader(StreamingDataset(str(tmp_path), tokenizer="byte", seq_len=64, lanes=2),
                                 batch_size=4), 1)


def test_standalone_iteration_needs_batch_size(corpus):
    batch = next(iter(dataset(corpus, batch_size=2)))
    assert isinstance(batch["tokens"], torch.Tensor) and batch["tokens"].shape == (2, 1025)
    with pytest.raises(ValueError, match="batch_size"):
        iter(dataset(corpus))


@pytest.mark.slow
def test_state_dict_gathers_every_ranks_cursors_over_gloo(process_pool, corpus):
    from conftest import free_port
    from raw_procs import raw_rank_run

    port = free_port()
    runs = process_pool.run(raw_rank_run, [dict(inputs=str(corpus), settings=SETTINGS, batch_size=5, rank=r,
                                                world_size=2, port=port, steps=6) for r in range(2)])
    assert runs[0]["state"] == runs[1]["state"], "the state must be global (identical on every rank)"
    assert len(decode(runs[0]["state"])["raw_text"]["cursors"]) == 5  # every lane's cursor, from whichever rank read it
    head = runs[0]["rows"] + runs[1]["rows"]
    tail, _ = simulated_run(corpus, world_size=3, batch_size=4, steps=10, state=runs[0]["state"])
    reference, _ = simulated_run(corpus, world_size=1, batch_size=10, steps=18)
    assert sorted(head + tail) == sorted(r for r in reference if r[0] < 60 + 120)


@pytest.mark.slow
def test_state_dict_called_on_one_rank_only_is_refused_in_one_line(process_pool, corpus):
    """Saving on rank 0 only: its state_dict() says every rank must call it, within the agreement's timeout,
    instead of blocking in the gather until the group's timeout (issue 45, item 11)."""
    from conftest import free_port
    from raw_procs import raw_state_on_one_rank_run

    port = free_port()
    runs = process_pool.run(raw_state_on_one_rank_run, [dict(inputs=str(corpus), settings=SETTINGS, rank=r,
                                                             world_size=2, port=port, timeout=3) for r in range(2)])
    error = runs[0]["error"]
    assert error is not None and "must be called on every rank" in error and "within 3 s" in error, error
    assert "\n" not in error and runs[1]["error"] is None


def test_a_real_corpus_with_a_real_tokenizer_resumes_inside_a_segment_of_a_compressed_file():
    from conftest import shared_path

    corpus = str(shared_path("corpora/prose.jsonl.zst"))
    tokenizer = str(shared_path("tokenizers/gpt2_hf_tokenizer.json"))
    settings = dict(tokenizer=tokenizer, seq_len=256, unit_bytes=1 << 14, lanes=4, pack="bestfit")
    reference = rows(take(StreamingDataLoader(StreamingDataset(corpus, **settings), batch_size=8), 10))
    loader = StreamingDataLoader(StreamingDataset(corpus, **settings), batch_size=8)
    head = take(loader, 6)
    state = loader.state_dict()
    # One .zst file is one streamed unit (one lane); the stop falls inside a later segment of it.
    [[_, _, _, unit, segment, within, *_]] = decode(state)["raw_text"]["cursors"]
    assert unit == 0 and segment > 0 and within > 0
    resumed = StreamingDataLoader(StreamingDataset(corpus, **settings), batch_size=8)
    resumed.load_state_dict(state)
    assert rows(head) + rows(take(resumed, 4)) == reference
    assert max(max(t) for _, _, t in reference) > 256  # GPT-2 ids, not bytes


def test_special_ids_as_the_build_takes_them(corpus):
    with pytest.raises(ValueError, match=r"eos_id 999 is outside the tokenizer's vocabulary \[0, 258\)"):
        dataset(corpus, eos_id=999)
    assert dataset(corpus).source.corpus.documents.eos_id == 256  # "auto": the tokenizer's
    assert dataset(corpus, eos_id=None).source.corpus.documents.eos_id is None


def test_an_input_that_vanishes_after_listing_is_named(tmp_path):
    corpus = write_corpus(tmp_path / "in", docs=40)
    loader = StreamingDataLoader(dataset(corpus, lanes=2), batch_size=2)
    (corpus / "b.jsonl.gz").unlink()
    with pytest.raises(OSError, match="b.jsonl.gz: cannot read it.*No such file.*vanish"):
        take(loader, 40)


def test_batches_handed_out_are_counted_in_the_loader_metrics(corpus):
    from shardkit import metrics

    before = metrics.value("shardkit_loader_batches_total")
    batches = iter(StreamingDataLoader(dataset(corpus), batch_size=2))
    for _ in range(5):
        next(batches)
    batches.close()  # the end of an iteration publishes what is left
    assert metrics.value("shardkit_loader_batches_total") - before == 5
