"""Raw-text and built streams in one weighted mixture (`shardkit.loaders.sources.mixture`): the order does not depend on
ranks or workers, resume is exact and elastic, and what cannot be mixed or resumed is refused by name."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from shardkit.loaders import Schedule, Stream, StreamingDataLoader, StreamingDataset
from resume_contract import check_resume
from shardkit.loaders.order.mixing import mixture_quotas, run_counts
from test_build import WORDS, config, read_samples, write_corpus
from test_raw_text import ranks_run, rows, take
from shardkit.loaders.state.envelope import decode, encode

SEQ_LEN = 64
WEIGHTS = (0.5, 0.3, 0.2)  # raw corpus A, the built dataset, raw corpus B


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import shared_path

    return str(shared_path("tokenizers/gpt2_hf_tokenizer.json"))


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer):
    """Two raw corpora and a small built dataset (its epoch ends within a few steps), all with GPT-2 ids."""
    from shardkit.tools.build import run_build

    root = tmp_path_factory.mktemp("rawmix")
    a = write_corpus(root / "a", docs=120)
    b = write_corpus(root / "b", docs=45, seed=1, bad=False)
    small = root / "c"
    small.mkdir()
    (small / "c.jsonl").write_text("".join(json.dumps({"text": f"built document {i}: " + " ".join(WORDS[i:] * 3)})
                                           + "\n" for i in range(4)))
    built = root / "built"
    run_build(config([small], built, tokenizer=tokenizer, seq_len=SEQ_LEN))
    return {"a": str(a), "b": str(b), "built": str(built), "root": root}


def streams(data, weights=WEIGHTS):
    return [Stream(data["a"], weights[0], raw_text=True), Stream(data["built"], weights[1]),
            Stream(data["b"], weights[2], raw_text=True)]


def mixture(data, tokenizer, weights=WEIGHTS, **overrides):
    return StreamingDataset(streams(data, weights), **{**dict(tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096,
                                                              lanes=3), **overrides})


def test_batches_mix_the_streams_by_their_quotas_with_distinguishable_ids(data, tokenizer):
    ds = mixture(data, tokenizer)
    batches = take(StreamingDataLoader(ds, batch_size=8), 12)
    stream = np.concatenate([b["stream"].numpy() for b in batches])
    ids = np.concatenate([b["sample_id"].numpy() for b in batches])
    assert all(b["tokens"].shape == (8, SEQ_LEN + 1) and b["cu_seqlens"][-1] == 8 * (SEQ_LEN + 1) for b in batches)
    # Each global step holds the positions the quotas give it (rows are sorted by lane and shard inside a step).
    assert np.array_equal(np.bincount(stream, minlength=3), run_counts(mixture_quotas(WEIGHTS), len(ids)))
    raw_ids = ids[stream != 1]
    assert len(set(raw_ids.tolist())) == len(raw_ids)  # a built id repeats only in the stream's next epoch
    _, built = read_samples(data["built"])
    assert ds.source.order.built_samples == len(built)
    assert (ids[stream == 1] < len(built)).all() and (ids[stream != 1] >= len(built)).all()
    # raw stream r's item k is len(built) + 2k + r: streams A (r = 0) and B (r = 1) tell apart by parity
    assert ((ids[stream == 0] - len(built)) % 2 == 0).all() and ((ids[stream == 2] - len(built)) % 2 == 1).all()
    tokens = np.concatenate([b["tokens"].numpy() for b in batches])
    for row in np.flatnonzero(stream == 1):  # a built row is that sample of the built dataset
        assert np.array_equal(tokens[row], built[ids[row]].tokens)
    epochs = np.concatenate([b["lane_epoch"].numpy() for b in batches])[stream == 1]
    assert epochs.max() >= 2  # the built stream went on epoch after epoch, each one all its samples once
    for epoch in range(epochs.max()):
        assert sorted(ids[stream == 1][epochs == epoch].tolist()) == list(range(len(built))), epoch


def test_raw_corpora_mix_without_a_built_stream(data, tokenizer):
    ds = StreamingDataset([Stream(data["a"], 3, raw_text=True), Stream(data["b"], 1, raw_text=True)],
                          tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3)
    stream = np.concatenate([b["stream"].numpy() for b in take(StreamingDataLoader(ds, batch_size=8), 4)])
    assert np.array_equal(np.bincount(stream, minlength=2), run_counts(mixture_quotas([3, 1]), 32))


def test_a_raw_streams_items_are_its_own_raw_datasets_samples(data, tokenizer):
    """Raw stream A's k-th item is sample k of A read as a raw dataset of its own (lane k % lanes)."""
    ds = mixture(data, tokenizer)
    batches = take(StreamingDataLoader(ds, batch_size=8), 10)
    built = ds.source.order.built_samples
    mixed = {(int(i) - built) // 2: tuple(t.tolist()) for b in batches
             for i, s, t in zip(b["sample_id"], b["stream"], b["tokens"]) if s == 0}
    alone = StreamingDataset(data["a"], tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3)
    own = {i: t for i, _, t in rows(take(StreamingDataLoader(alone, batch_size=len(mixed)), 1))}
    assert sorted(mixed) == list(range(len(mixed))) and mixed == own


def simulated_run(data, tokenizer, **run):
    """`world_size` ranks in this process; their rows per step in rank order, and the merged state."""
    return ranks_run(lambda **rank: mixture(data, tokenizer, **rank), **run)


def test_one_two_three_ranks_with_or_without_workers_give_the_same_samples(data, tokenizer):
    one, _ = simulated_run(data, tokenizer, world_size=1, batch_size=12, steps=4)
    assert simulated_run(data, tokenizer, world_size=2, batch_size=6, steps=4)[0] == one
    assert simulated_run(data, tokenizer, world_size=3, batch_size=4, steps=4)[0] == one
    assert simulated_run(data, tokenizer, world_size=3, batch_size=4, steps=4, workers=2)[0] == one


def test_resume_anywhere_continues_exactly(data, tokenizer):
    reference = rows(take(StreamingDataLoader(mixture(data, tokenizer), batch_size=8), 30))
    for stop in (1, 7, 19):
        loader = StreamingDataLoader(mixture(data, tokenizer), batch_size=8)
        head = take(loader, stop)
        resumed = StreamingDataLoader(mixture(data, tokenizer), batch_size=8)
        resumed.load_state_dict(loader.state_dict())
        assert rows(head) + rows(take(resumed, 30 - stop)) == reference, stop
    assert {epoch for _, epoch, _ in reference} >= {0, 1}  # lanes and the built stream cross into epoch 1


@pytest.mark.parametrize("before,after", [((2, 6, 0), (3, 4, 0)), ((4, 3, 2), (2, 6, 0)), ((1, 12, 0), (3, 4, 2))])
def test_elastic_resume_repeats_and_misses_nothing(data, tokenizer, before, after):
    reference, _ = simulated_run(data, tokenizer, world_size=1, batch_size=12, steps=12)
    (w1, b1, k1), (w2, b2, k2) = before, after
    head, state = simulated_run(data, tokenizer, world_size=w1, batch_size=b1, steps=4, workers=k1)
    assert len(decode(state)["raw_text"]["cursors"]) == 6  # one per lane of the two raw streams: O(lanes)
    tail, _ = simulated_run(data, tokenizer, world_size=w2, batch_size=b2, steps=(144 - len(head)) // (w2 * b2),
                            state=state, workers=k2)
    # Rows of a step may be grouped otherwise on another world size: compare the global order sample by sample.
    assert sorted(head + tail) == sorted(reference)


def test_a_weight_schedule_counts_the_first_runs_steps_also_after_an_elastic_resume(data, tokenizer):
    def scheduled(**rank):  # the built stream joins at step 3 (of 8 positions each: the first run's global batch)
        joining = Stream(data["built"], Schedule([(0, 0), (3, 1)]))
        return StreamingDataset([Stream(data["a"], 1, raw_text=True), joining], tokenizer=tokenizer, seq_len=SEQ_LEN,
                                unit_bytes=4096, lanes=3, **rank)

    reference, _ = ranks_run(scheduled, world_size=1, batch_size=8, steps=8)
    built = scheduled().source.order.built_samples
    with_built = [any(i < built for i, _, _ in reference[step * 8:(step + 1) * 8]) for step in range(8)]
    assert with_built == [False] * 3 + [True] * 5
    head, state = ranks_run(scheduled, world_size=1, batch_size=8, steps=2, workers=2)
    assert decode(state)["raw_text"]["global_batch"] == 8  # pinned in the main process too (the workers read)
    tail, _ = ranks_run(scheduled, world_size=2, batch_size=2, steps=12, state=state)  # 4 positions a step now
    assert sorted(head + tail) == sorted(reference)


def test_states_of_another_kind_or_mixture_are_refused(data, tokenizer):
    loader = StreamingDataLoader(mixture(data, tokenizer), batch_size=4)
    take(loader, 2)
    state = loader.state_dict()
    plain = StreamingDataLoader(StreamingDataset(data["a"], tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096,
                                                 lanes=3), batch_size=4)
    with pytest.raises(ValueError, match="state is a mixture with raw-text streams's, this loader reads a single "
                                         "raw-text dataset"):
        plain.load_state_dict(state)
    take(plain, 1)
    with pytest.raises(ValueError, match="state is a single raw-text dataset's, this loader reads a mixture"):
        StreamingDataLoader(mixture(data, tokenizer), batch_size=4).load_state_dict(plain.state_dict())
    built = StreamingDataLoader(StreamingDataset(data["built"]), batch_size=4)
    take(built, 1)
    with pytest.raises(ValueError, match="built dataset's, not raw text's"):
        StreamingDataLoader(mixture(data, tokenizer), batch_size=4).load_state_dict(built.state_dict())
    with pytest.raises(ValueError, match="state is raw text's .*, this loader reads built datasets only"):
        StreamingDataLoader(StreamingDataset(data["built"]), batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"mixture has other streams or weights \(saved \[\['.*/a', 0.5\], .* now "
                                         r"\[\['.*/a', 0.4\], .* pass allow_mixture_change=True"):
        StreamingDataLoader(mixture(data, tokenizer, weights=(0.4, 0.4, 0.2)), batch_size=4).load_state_dict(state)
    swapped = StreamingDataset([Stream(data["b"], 0.5, raw_text=True), Stream(data["built"], 0.3),
                                Stream(data["a"], 0.2, raw_text=True)], tokenizer=tokenizer, seq_len=SEQ_LEN,
                               unit_bytes=4096, lanes=3)
    with pytest.raises(ValueError, match="other streams or weights"):
        StreamingDataLoader(swapped, batch_size=4).load_state_dict(state)
    damaged = {**state, "streams": dict(list(state["streams"].items())[:2])}  # a stream dropped
    with pytest.raises(ValueError, match="streams do not match its mixture record"):
        StreamingDataLoader(swapped, batch_size=4).load_state_dict(damaged, allow_mixture_change=True)


def test_a_weight_change_on_resume_continues_each_stream_from_its_count(data, tokenizer):
    """Weights changed on resume (allow_mixture_change) apply from the saved position: each stream goes on from what
    it gave (a raw stream's items k, the built stream's epoch), nothing repeated or skipped; the state after the change
    resumes exactly, elastically too."""
    after = (0.2, 0.3, 0.5)
    loader = StreamingDataLoader(mixture(data, tokenizer), batch_size=8)
    head = take(loader, 5)
    state = loader.state_dict()
    changed = StreamingDataLoader(mixture(data, tokenizer, weights=after), batch_size=8)
    changed.load_state_dict(state, allow_mixture_change=True)
    tail = take(changed, 10)
    stream = np.concatenate([b["stream"].numpy() for b in head + tail])
    ids = np.concatenate([b["sample_id"].numpy() for b in head + tail])
    epochs = np.concatenate([b["lane_epoch"].numpy() for b in head + tail])
    assert np.array_equal(np.bincount(stream[:40], minlength=3), run_counts(mixture_quotas(WEIGHTS), 40))
    assert np.array_equal(np.bincount(stream[40:], minlength=3), run_counts(mixture_quotas(after), 80))
    built = changed.source.order.built_samples
    for raw_stream, r in ((0, 0), (2, 1)):  # raw stream r's item k is built + 2k + r: items 0..n-1, each once
        k = np.sort((ids[stream == raw_stream] - built - r) // 2)
        assert np.array_equal(k, np.arange(len(k))), raw_stream
    for epoch in range(epochs[stream == 1].max()):  # the built stream's epochs go on across the change
        assert sorted(ids[(stream == 1) & (epochs == epoch)].tolist()) == list(range(built)), epoch
    last = ids[(stream == 1) & (epochs == epochs[stream == 1].max())]
    assert len(set(last.tolist())) == len(last)

    saved = changed.state_dict()
    record = saved["mixture"]
    assert [c["position"] for c in record["changes"]] == [40] and record["anchor"]["position"] == 40
    assert record["anchor"]["counts"] == np.bincount(stream[:40], minlength=3).tolist()
    going_on = rows(take(changed, 6))
    again = StreamingDataLoader(mixture(data, tokenizer, weights=after), batch_size=8)
    again.load_state_dict(saved)  # the changed mixture's own state: no flag needed
    assert rows(take(again, 6)) == going_on
    elastic, _ = ranks_run(lambda **rank: mixture(data, tokenizer, weights=after, **rank), world_size=2, batch_size=4,
                           steps=6, state=saved, workers=2)
    assert sorted(elastic) == sorted(going_on)
    with pytest.raises(ValueError, match="mixture has other streams or weights"):  # the first weights: a change again
        StreamingDataLoader(mixture(data, tokenizer), batch_size=8).load_state_dict(saved)


def test_what_cannot_be_mixed_is_refused_by_name(data, tokenizer):
    from shardkit.tools.build import run_build

    corpus = data["root"] / "c"
    byte_built, short = data["root"] / "byte", data["root"] / "short"
    run_build(config([corpus], byte_built, seq_len=SEQ_LEN))  # the byte tokenizer
    run_build(config([corpus], short, tokenizer=tokenizer, seq_len=32))
    raw = Stream(data["a"], 1, raw_text=True)
    settings = dict(tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3)
    with pytest.raises(ValueError, match=rf"stream {byte_built}: built with tokenizer byte \(258 ids\), but the "
                                         r"mixture's tokenizer= is .*gpt2_hf_tokenizer.json \(50257 ids\)"):
        StreamingDataset([raw, Stream(str(byte_built))], **settings)
    with pytest.raises(ValueError, match=rf"stream {short}: holds samples of seq_len=32 .* the mixture's are "
                                         "seq_len=64"):
        StreamingDataset([raw, Stream(str(short))], **settings)
    with pytest.raises(ValueError, match="stream 1: weight 1e-09 is below 1/4096"):
        StreamingDataset([raw, Stream(data["built"], 1e-9)], **settings)
    with pytest.raises(ValueError, match="mark its raw-text streams"):
        StreamingDataset([Stream(data["built"])], **settings)
    with pytest.raises(ValueError, match=rf"stream {data['a']} is raw text \(raw_text=True\): .* tokenizer="):
        StreamingDataset([raw, Stream(data["built"])])
    with pytest.raises(TypeError, match="not both"):
        StreamingDataset([data["b"], raw], **settings)


def test_streams_removed_reordered_and_added_back_on_resume_continue_from_their_counts(data, tokenizer):
    """A, built, B for 5 steps; then B, A (the built stream removed, the raw ones reordered) for 5; then B, A, built
    (added back) for 5. Each raw stream's items are 0..n-1, each once, and item k is still sample k of that stream
    read alone (its lanes keep their seed and cursors, renumbered); the built stream's epochs go on from its count;
    the state after a change resumes exactly."""
    def phase(sources, weights):
        return StreamingDataset([Stream(data[name], w, raw_text=name != "built") for name, w in zip(sources, weights)],
                                tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3)

    phases = [(("a", "built", "b"), WEIGHTS), (("b", "a"), (0.5, 0.5)), (("b", "a", "built"), (0.4, 0.4, 0.2))]
    items: dict[str, list[tuple[int, tuple]]] = {"a": [], "b": [], "built": []}
    state = None
    for number, (sources, weights) in enumerate(phases):
        loader = StreamingDataLoader(phase(sources, weights), batch_size=8)
        if state is not None:
            with pytest.raises(ValueError, match="other streams or weights"):
                StreamingDataLoader(phase(sources, weights), batch_size=8).load_state_dict(state)
            loader.load_state_dict(state, allow_mixture_change=True)
        batches = take(loader, 5)
        if number == 1:  # the changed mixture's own state resumes exactly, without the flag
            saved = loader.state_dict()
            batches += take(loader, 3)
            again = StreamingDataLoader(phase(sources, weights), batch_size=8)
            again.load_state_dict(saved)
            assert rows(take(again, 3)) == rows(batches[5:])
        order = loader.dataset.source.order
        for batch in batches:
            for sample_id, stream, epoch, tokens in zip(batch["sample_id"].tolist(), batch["stream"].tolist(),
                                                        batch["lane_epoch"].tolist(), batch["tokens"]):
                name = sources[stream]
                if name == "built":
                    items[name].append((epoch, sample_id - int(order.id_offsets[stream])))
                else:
                    items[name].append(((sample_id - order.built_samples) // order.num_raw, tuple(tokens.tolist())))
        state = loader.state_dict()
    assert [c["position"] for c in state["mixture"]["changes"]] == [40, 104]
    for name, seed in (("a", 0), ("b", 2)):  # raw stream s's lanes are seeded with the mixture's seed + s
        k = sorted(item for item, _ in items[name])
        assert k == list(range(len(k))), name  # items 0..n-1 over the three mixtures, each once
        alone = StreamingDataset(data[name], tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3,
                                 seed=seed)
        own = {i: t for i, _, t in rows(take(StreamingDataLoader(alone, batch_size=len(k)), 1))}
        assert all(own[item] == tokens for item, tokens in items[name]), name
    built = len(read_samples(data["built"])[1])
    by_epoch: dict[int, list[int]] = {}
    for epoch, local in items["built"]:
        by_epoch.setdefault(epoch, []).append(local)
    assert max(by_epoch) >= 1
    for epoch, ids in by_epoch.items():
        assert len(set(ids)) == len(ids) and (epoch == max(by_epoch) or sorted(ids) == list(range(built))), epoch


def test_the_trainer_trains_on_raw_and_built_entries(data, tokenizer, tmp_path):
    from test_train_raw import run
    from train_runs import sample_ids

    options = {"data": f"{data['built']}:0.5 {data['a']}/*.jsonl*:0.5", "tokenizer": tokenizer, "lanes": 2,
               "batch_size": 4}
    run(None, tmp_path / "whole", 4, data=options)
    run(None, tmp_path / "split", 2, data=options)
    run(None, tmp_path / "split", 4, data=options)  # resumes from the step-2 checkpoint
    ids = sample_ids(tmp_path / "whole")
    assert sample_ids(tmp_path / "split") == ids
    built = len(read_samples(data["built"])[1])
    every = [i for step in ids.values() for i in step]
    assert len(ids) == 4 and min(every) < built <= max(every)  # samples of both kinds of stream


def test_the_trainer_changes_a_raw_mixtures_weights_on_resume_with_allow_mixture_change(data, tokenizer, tmp_path):
    from test_train_raw import run
    from train_runs import sample_ids

    options = {"data": f"{data['built']}:0.5 {data['a']}/*.jsonl*:0.5", "tokenizer": tokenizer, "lanes": 2,
               "batch_size": 4}
    run(None, tmp_path / "run", 2, data=options)
    first = sample_ids(tmp_path / "run")
    heavier = {**options, "data": f"{data['built']}:0.1 {data['a']}/*.jsonl*:0.9"}
    with pytest.raises(ValueError, match="allow_mixture_change=True .*--allow-mixture-change"):
        run(None, tmp_path / "run", 4, data=heavier)
    run(None, tmp_path / "run", 4, data={**heavier, "allow_mixture_change": True})
    ids = sample_ids(tmp_path / "run")
    assert {step: ids[step] for step in first} == first
    built = len(read_samples(data["built"])[1])
    later = np.array([i for step in (3, 4) for i in ids[step]])
    # From the checkpoint on, the new quotas: 0.1 of the 8 positions built, 0.9 raw text.
    assert np.array_equal([(later < built).sum(), (later >= built).sum()], run_counts(mixture_quotas([0.1, 0.9]), 8))


@pytest.mark.slow
def test_state_dict_gathers_every_ranks_cursors_over_gloo(process_pool, data, tokenizer):
    from conftest import free_port
    from raw_procs import raw_rank_run

    port = free_port()
    settings = dict(tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3)
    runs = process_pool.run(raw_rank_run, [dict(inputs=streams(data), settings=settings, batch_size=5, rank=r,
                                                world_size=2, port=port, steps=6) for r in range(2)])
    assert runs[0]["state"] == runs[1]["state"], "the state must be global (identical on every rank)"
    assert len(decode(runs[0]["state"])["raw_text"]["cursors"]) == 6  # both raw streams' lanes, whichever rank read them
    head = runs[0]["rows"] + runs[1]["rows"]
    tail, _ = simulated_run(data, tokenizer, world_size=3, batch_size=4, steps=10, state=runs[0]["state"])
    reference, _ = simulated_run(data, tokenizer, world_size=1, batch_size=10, steps=18)
    assert sorted(head + tail) == sorted(reference)


@pytest.fixture(scope="module")
def damaged(data):
    """The mixture's data with raw stream B's .zst file truncated (its unit is cut; B is the second raw stream,
    so the cut's unit number counts A's units first)."""
    import shutil

    from test_raw_unreadable import damage_zst

    b = data["root"] / "b_damaged"
    shutil.copytree(data["b"], b)
    damage_zst(b / "c.jsonl.zst")
    return {**data, "b": str(b)}


def skipping(data, tokenizer, **overrides):
    return mixture(data, tokenizer, on_corrupt="skip", **overrides)


def test_a_cut_unit_keeps_its_cut_when_the_streams_change(damaged, tokenizer, caplog):
    """B's cut unit, numbered after A's units in A, built, B, is renumbered when B comes first: the changed mixture
    does not find it again, and both raw streams go on as they read alone."""
    loader = StreamingDataLoader(skipping(damaged, tokenizer), batch_size=8)
    head = take(loader, 30)
    assert loader.counters()["skipped_units"] == 1
    changed = StreamingDataset([Stream(damaged["b"], 0.5, raw_text=True), Stream(damaged["a"], 0.5, raw_text=True)],
                               tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3, on_corrupt="skip")
    resumed = StreamingDataLoader(changed, batch_size=8)
    resumed.load_state_dict(loader.state_dict(), allow_mixture_change=True)
    caplog.clear()  # the first mixture's cut
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.unreadable"):
        tail = take(resumed, 20)
    assert not [r for r in caplog.records if "skipped an unreadable unit" in r.getMessage()]
    [[unit, _, _, _]] = decode(resumed.state_dict())["raw_text"]["unreadable"]
    assert unit < len(changed.source.corpora[0].units.size) and changed.source.corpora[0].unit_url(unit).endswith(
        "b_damaged/c.jsonl.zst")
    items: dict[str, dict[int, tuple]] = {"a": {}, "b": {}}
    for batches, order, names in ((head, loader.dataset.source.order, ("a", "built", "b")),
                                  (tail, changed.source.order, ("b", "a"))):
        for batch in batches:
            for sample_id, stream, tokens in zip(batch["sample_id"].tolist(), batch["stream"].tolist(),
                                                 batch["tokens"]):
                if names[stream] != "built":
                    k = (sample_id - order.built_samples) // order.num_raw
                    items[names[stream]][k] = tuple(tokens.tolist())
    for name, seed in (("a", 0), ("b", 2)):
        alone = StreamingDataset(damaged[name], tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3,
                                 seed=seed, on_corrupt="skip")
        k = sorted(items[name])
        own = {i: t for i, _, t in rows(take(StreamingDataLoader(alone, batch_size=len(k)), 1))}
        assert k == list(range(len(k))) and items[name] == own, name


def test_on_corrupt_skip_cuts_a_raw_streams_unreadable_unit_as_its_own_dataset_would(damaged, tokenizer, caplog):
    ds = skipping(damaged, tokenizer)
    loader = StreamingDataLoader(ds, batch_size=8)
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.unreadable"):
        batches = take(loader, 30)
    skipped = [r.getMessage() for r in caplog.records if "skipped an unreadable unit" in r.getMessage()]
    assert loader.counters()["skipped_units"] == 1 and len(skipped) == 1 and f"{damaged['b']}/c.jsonl.zst from its segment" in \
        skipped[0], skipped
    [[unit, _, _, _]] = decode(loader.state_dict())["raw_text"]["unreadable"]
    first_of_b = len(ds.source.corpora[0].units.size)
    assert unit >= first_of_b and ds.source.corpora[1].unit_url(unit - first_of_b).endswith("b_damaged/c.jsonl.zst")
    # Each raw stream's items are its own raw dataset's samples (its lanes seeded with the mixture's seed plus its
    # index): A untouched by B's cut, B cut as it cuts itself alone.
    built = ds.source.order.built_samples
    for stream, url in ((0, damaged["a"]), (2, damaged["b"])):
        mixed = [(int(i) - built) // 2 for b in batches for i, s in zip(b["sample_id"], b["stream"]) if s == stream]
        tokens = {(int(i) - built) // 2: tuple(t.tolist()) for b in batches
                  for i, s, t in zip(b["sample_id"], b["stream"], b["tokens"]) if s == stream}
        alone = StreamingDataset(url, tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3, seed=stream,
                                 on_corrupt="skip")
        own = {i: t for i, _, t in rows(take(StreamingDataLoader(alone, batch_size=len(mixed)), 1))}
        assert sorted(mixed) == list(range(len(mixed))) and tokens == own, stream


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_contract_of_a_mixture_that_skips(damaged, tokenizer, workers):
    def make_loader(rank, world_size):
        return StreamingDataLoader(skipping(damaged, tokenizer, rank=rank, world_size=world_size), batch_size=8,
                                   num_workers=workers, multiprocessing_context="fork" if workers else None)

    check_resume(make_loader, steps=24)  # saved before and after the cut (at step 10)
    run = make_loader(0, 1)
    take(run, 11)
    assert run.counters()["skipped_units"] == 1


def test_persistent_workers_of_a_mixture_that_skips_read_on_across_iterations(damaged, tokenizer):
    """A raw mixture with built and raw streams, read by persistent workers in four iterations, gives the rows of one
    uninterrupted run without workers: each iteration from where the loader stands, across the unit cut at step 10
    (which the workers' copies do not hold: they are started again with it)."""
    reference = take(StreamingDataLoader(skipping(damaged, tokenizer), batch_size=8), 16)
    loader = StreamingDataLoader(skipping(damaged, tokenizer), batch_size=8, num_workers=2, persistent_workers=True,
                                 multiprocessing_context="fork")
    batches = []
    for steps in (3, 5, 4, 4):
        batches += take(loader, steps)
    assert rows(batches) == rows(reference)
    assert loader.counters()["skipped_units"] == 1


def test_persistent_workers_take_up_a_weight_change_loaded_into_their_loader(data, tokenizer):
    """A state loaded with a weight change into a loader whose persistent workers already read: they are started
    again with the changed mixture, and read what a fresh loader reads from that state."""
    after = (0.2, 0.3, 0.5)
    before = StreamingDataLoader(mixture(data, tokenizer), batch_size=8)
    take(before, 5)
    state = before.state_dict()
    fresh = StreamingDataLoader(mixture(data, tokenizer, weights=after), batch_size=8)
    fresh.load_state_dict(state, allow_mixture_change=True)
    loader = StreamingDataLoader(mixture(data, tokenizer, weights=after), batch_size=8, num_workers=2,
                                 persistent_workers=True, multiprocessing_context="fork")
    take(loader, 3)
    loader.load_state_dict(state, allow_mixture_change=True)
    assert rows(take(loader, 4)) + rows(take(loader, 4)) == rows(take(fresh, 8))


def test_cuts_saved_on_one_rank_hold_on_two_and_three(damaged, tokenizer):
    """An elastic resume of a mixture that skipped a unit: the resumed ranks cut it where the state says (under
    "raise", so that ranks in one process need no process group to agree: any new failure would raise)."""
    def ranks(**rank):
        policy = "skip" if rank.get("world_size", 1) == 1 else "raise"
        return mixture(damaged, tokenizer, on_corrupt=policy, **rank)

    reference, _ = ranks_run(ranks, world_size=1, batch_size=12, steps=14)
    head, state = ranks_run(ranks, world_size=1, batch_size=12, steps=8)
    assert len(decode(state)["raw_text"]["unreadable"]) == 1
    _, start = ranks_run(ranks, world_size=1, batch_size=12, steps=0)
    start = decode(start)
    start["raw_text"]["unreadable"] = decode(state)["raw_text"]["unreadable"]  # the cut known before the lane reaches it
    start = encode(start)
    assert ranks_run(ranks, world_size=2, batch_size=6, steps=14, state=start)[0] == reference
    for world_size, batch_size, workers in ((2, 6, 0), (3, 4, 2)):
        tail, _ = ranks_run(ranks, world_size=world_size, batch_size=batch_size, steps=6 * 12 // (world_size *
                            batch_size), state=state, workers=workers)
        assert sorted(head + tail) == sorted(reference), world_size


@pytest.mark.slow
def test_ranks_skip_a_raw_streams_unreadable_unit_alike_over_gloo(process_pool, damaged, tokenizer):
    """Two ranks that agree over a real gloo group cut the same unit and read what one rank reads."""
    from conftest import free_port
    from raw_procs import raw_rank_run

    settings = dict(tokenizer=tokenizer, seq_len=SEQ_LEN, unit_bytes=4096, lanes=3, on_corrupt="skip")
    port = free_port()
    runs = process_pool.run(raw_rank_run, [dict(inputs=streams(damaged), settings=settings, batch_size=6, rank=r,
                                                world_size=2, port=port, steps=12) for r in range(2)])
    assert runs[0]["state"] == runs[1]["state"] and runs[0]["skipped"] == runs[1]["skipped"] == 1
    reference, state = ranks_run(lambda **rank: skipping(damaged, tokenizer, **rank), world_size=1,
                                 batch_size=12, steps=12)
    both = [row for step in range(12) for rank in (0, 1) for row in runs[rank]["rows"][6 * step:6 * step + 6]]
    assert both == reference
    assert decode(runs[0]["state"])["raw_text"]["unreadable"] == decode(state)["raw_text"]["unreadable"]


def test_a_sample_ids_place_inverts_the_order(data, tokenizer):
    """`places_of_ids` (what `shardkit trace` reads again) gives back each row's stream, lane and lane sample, and a
    built row's id within its stream."""
    order = mixture(data, tokenizer).source.order
    order.pin(12)
    rows = [order.step_rows(step, start=0, world_size=1, batch_size=12, rank=0) for step in range(20)]
    ids, stream, lane, index = (np.concatenate([getattr(r, name) for r in rows])
                                for name in ("sample_id", "stream", "lane", "index"))
    found_stream, found_lane, found_index = order.places_of_ids(ids)
    raw = lane >= 0
    assert raw.any() and (~raw).any()
    assert np.array_equal(found_stream, stream) and np.array_equal(found_lane, lane)
    assert np.array_equal(found_index[raw], index[raw])
    assert np.array_equal(found_index[~raw], ids[~raw] - order.id_offsets[stream[~raw]])
