"""Lanes that run dry are left out of the order (issue 45, item 8): a lane whose units hold no accepted document,
or whose every unit was cut as unreadable, no longer stops the raw-text loader; every rank leaves it out at the
same position, the state keeps it, and a resume on another number of ranks hands out exactly the uninterrupted
run's rows."""

from __future__ import annotations

import gzip
import io
import logging

import numpy as np
import pytest
import zstandard

from conftest import shared_path
from resume_contract import check_resume
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.order.lanes import lane_sample_counts, position_lanes, rank_step_positions
from shardkit.loaders.state.envelope import decode
from test_raw_text import rows, take

FILES, DOCS_PER_FILE, DAMAGED = 8, 40, 3  # eight .jsonl.gz files, one lane each; part3 is damaged


def mix_lines(count: int) -> list[bytes]:
    """The first `count` documents of the shared mixed corpus (JSONL lines)."""
    with shared_path("corpora/mix.jsonl.zst").open("rb") as raw:
        reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
        return [reader.readline() for _ in range(count)]


@pytest.fixture(scope="module")
def gz_corpus(tmp_path_factory):
    """Eight .jsonl.gz files of real documents; part3's deflate stream is scrambled from its first block, so
    reading it fails before its first record: its unit is cut whole and its lane holds no document."""
    root = tmp_path_factory.mktemp("dry") / "in"
    root.mkdir()
    lines = mix_lines(FILES * DOCS_PER_FILE)
    for part in range(FILES):
        data = bytearray(gzip.compress(b"".join(lines[part * DOCS_PER_FILE:(part + 1) * DOCS_PER_FILE])))
        if part == DAMAGED:
            for k in range(10, len(data) - 8):  # after the 10-byte header, up to the trailer
                data[k] ^= 0xA5
        (root / f"part{part}.jsonl.gz").write_bytes(bytes(data))
    return root


def settings():
    return dict(tokenizer=str(shared_path("tokenizers/gpt2_hf_tokenizer.json")), seq_len=64, on_corrupt="skip")


def lane_of(corpus_dataset, name):
    corpus = corpus_dataset.source.corpus
    return next(lane for lane in range(corpus.num_lanes) if corpus.lane_inputs(lane)[0].endswith(name))


def test_the_order_leaves_dry_lanes_out_from_their_last_sample_on():
    """Round r holds sample r of every lane with more than r samples; counts and rank slices follow it."""
    dry = {1: 0, 3: 2}
    lanes, index = position_lanes(np.arange(14), 4, dry)
    assert list(zip(lanes.tolist(), index.tolist())) == [
        (0, 0), (2, 0), (3, 0), (0, 1), (2, 1), (3, 1), (0, 2), (2, 2), (0, 3), (2, 3), (0, 4), (2, 4), (0, 5), (2, 5)]
    for consumed in range(15):
        assert lane_sample_counts(consumed, 4, dry).tolist() == np.bincount(lanes[:consumed], minlength=4).tolist()
    slices = [rank_step_positions(1, start=2, world_size=3, batch_size=2, rank=r, num_lanes=4, dry=dry)
              for r in range(3)]
    assert np.concatenate(slices).tolist() == [8, 10, 12, 9, 11, 13]  # step 1 of 6 from position 2, by lane
    with pytest.raises(ValueError, match="all 2 lanes ran dry"):
        position_lanes(np.array([3]), 2, {0: 1, 1: 2})


def test_a_damaged_gz_file_among_eight_leaves_its_lane_out_and_the_run_goes_on(gz_corpus, caplog):
    dataset = StreamingDataset(str(gz_corpus), **settings())
    dry_lane = lane_of(dataset, f"part{DAMAGED}.jsonl.gz")
    loader = StreamingDataLoader(dataset, batch_size=6)
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw"):
        got = rows(take(loader, 30))
    assert loader.counters() == {"skipped_units": 1, "dry_lanes": 1}
    [message] = [r.getMessage() for r in caplog.records if "order leaves it out" in r.getMessage()]
    assert f"lane {dry_lane} of 8 holds no accepted document after its first 0 samples" in message
    assert f"part{DAMAGED}.jsonl.gz" in message
    ids = [sample_id for sample_id, _, _ in got]
    assert sorted(ids) == list(range(180))  # every position once, none left for padding
    lanes, _ = position_lanes(np.array(ids), 8, {dry_lane: 0})
    assert dry_lane not in lanes.tolist() and set(lanes.tolist()) == set(range(8)) - {dry_lane}
    assert not any(all(t == tokens[0] for t in tokens) for _, _, tokens in got)  # no stand-in padding row
    state = loader.state_dict()
    assert decode(state)["raw_text"]["dry_lanes"] == [[dry_lane, 0]]
    # Where a sample comes from (shardkit trace) follows the same order: a late id made again is the delivered one.
    late = got[-6:]
    found = dataset.source.provenance([i for i, _, _ in late], state=state).samples
    assert [tuple(found[i].tokens.tolist()) for i, _, _ in late] == [tokens for _, _, tokens in late]
    assert all(found[i].place["lane"] != dry_lane for i, _, _ in late)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_contract_with_a_dry_lane(gz_corpus, workers):
    def make_loader(rank, world_size):
        return StreamingDataLoader(StreamingDataset(str(gz_corpus), **settings(), rank=rank, world_size=world_size),
                                   batch_size=6, num_workers=workers,
                                   multiprocessing_context="fork" if workers else None)

    check_resume(make_loader, steps=12)


def test_a_lane_whose_file_vanishes_mid_run_runs_dry_there_and_resumes_exactly(tmp_path):
    """Two files, one lane each; one vanishes after the first steps: its lane gives the samples it had read, then
    its unit is cut (there, then whole in the next lane epoch); the lane leaves the order after those samples, the
    positions go on over the other lane, and a state saved after that resumes onto the same rows."""
    lines = mix_lines(60)
    for name, part in (("a.jsonl", lines[:30]), ("b.jsonl", lines[30:])):
        (tmp_path / name).write_bytes(b"".join(part))
    options = dict(tokenizer="byte", seq_len=256, unit_bytes=1 << 30, lanes=2, on_corrupt="skip")
    make = lambda: StreamingDataLoader(StreamingDataset(str(tmp_path), **options), batch_size=4)  # noqa: E731
    loader = make()
    doomed = lane_of(loader, "b.jsonl")
    head = rows(take(loader, 2))
    kept = (tmp_path / "b.jsonl").read_bytes()
    (tmp_path / "b.jsonl").unlink()
    head += rows(take(loader, 60))
    [[lane, samples]] = decode(loader.state_dict())["raw_text"]["dry_lanes"]
    assert lane == doomed and samples >= 4 and loader.counters() == {"skipped_units": 2, "dry_lanes": 1}
    state = loader.state_dict()
    tail = rows(take(loader, 10))
    ids = [i for i, _, _ in head + tail]
    assert sorted(ids) == list(range(len(ids)))  # every position once
    lanes, _ = position_lanes(np.array(ids), 2, {doomed: samples})
    assert (lanes == doomed).sum() == samples  # its lane epoch 0, no more
    (tmp_path / "b.jsonl").write_bytes(kept)  # back (the listing must match): the state says what is left out
    resumed = make()
    resumed.load_state_dict(state)
    assert rows(take(resumed, 10)) == tail


@pytest.mark.slow
def test_ranks_agree_on_a_dry_lane_over_gloo_and_resume_on_three(process_pool, gz_corpus):
    """2 gloo ranks leave the damaged file's lane out alike and save one state; 3 gloo ranks resume from it; the
    rows of both, step by step, are the single-process run's, ids and tokens."""
    from conftest import free_port
    from raw_procs import raw_rank_run

    reference = rows(take(StreamingDataLoader(StreamingDataset(str(gz_corpus), **settings()), batch_size=12), 14))

    def run(world_size, steps, state=None):
        port = free_port()
        return process_pool.run(raw_rank_run, [
            dict(inputs=str(gz_corpus), settings=settings(), batch_size=12 // world_size, rank=r,
                 world_size=world_size, port=port, steps=steps, state=state) for r in range(world_size)])

    def merged(runs, steps):
        size = len(runs[0]["rows"]) // steps
        return [row for step in range(steps) for run in runs for row in run["rows"][size * step:size * (step + 1)]]

    two = run(2, 6)
    assert two[0]["state"] == two[1]["state"] and [r["dry_lanes"] for r in two] == [1, 1]
    assert merged(two, 6) == reference[:72]
    three = run(3, 8, state=two[0]["state"])
    assert three[0]["state"] == three[1]["state"] == three[2]["state"]
    assert merged(three, 8) == reference[72:]


@pytest.mark.slow
def test_under_raise_ranks_agree_on_a_lane_of_rejected_documents_over_gloo(process_pool, tmp_path):
    """Under on_corrupt="raise" a lane whose every document is rejected is found in the steps of round 0 (each
    lane's first sample), which 2 gloo ranks agree on: both leave it out alike, the single process's rows."""
    from conftest import free_port
    from raw_procs import raw_rank_run

    lines = mix_lines(FILES * DOCS_PER_FILE)
    for part in range(FILES):
        text = b"".join(lines[part * DOCS_PER_FILE:(part + 1) * DOCS_PER_FILE])
        if part == DAMAGED:
            text = b'{"text": ""}\n' * DOCS_PER_FILE  # every record rejected (an empty document)
        (tmp_path / f"part{part}.jsonl.gz").write_bytes(gzip.compress(text))
    options = {**settings(), "on_corrupt": "raise"}
    reference = rows(take(StreamingDataLoader(StreamingDataset(str(tmp_path), **options), batch_size=12), 6))
    port = free_port()
    two = process_pool.run(raw_rank_run, [
        dict(inputs=str(tmp_path), settings=options, batch_size=6, rank=r, world_size=2, port=port, steps=6)
        for r in range(2)])
    assert two[0]["state"] == two[1]["state"] and [r["dry_lanes"] for r in two] == [1, 1]
    merged = [row for step in range(6) for run in two for row in run["rows"][6 * step:6 * (step + 1)]]
    assert merged == reference


def test_a_dataset_iterated_on_its_own_leaves_a_dry_lane_out_too(tmp_path):
    """Without StreamingDataLoader (one rank): the iteration starts again with the lane left out and skips the
    steps it handed out, so the rows are the loader's."""
    lines = mix_lines(40)
    (tmp_path / "good.jsonl").write_bytes(b"".join(lines))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": ""}\n' * 10)  # every record rejected
    options = dict(tokenizer="byte", seq_len=64, lanes=2)
    alone = StreamingDataset(str(tmp_path), **options, batch_size=4)
    got = [b for b, _ in zip(alone, range(5))]
    assert rows(got) == rows(take(StreamingDataLoader(StreamingDataset(str(tmp_path), **options), batch_size=4), 5))
    assert sorted(i for i, _, _ in rows(got)) == list(range(20))
