"""Raw text's per-step work done by array operations over runs of samples (issue 47's rate): each shortcut gives
exactly what the general per-sample code gives.

- a segment's restart points, worked out for a whole packer call at once (`SegmentSamples._follow`), against the
  per-sample rule they replace;
- a batch of packed rows whose segment lengths the lane knows (`raw_batch`'s running sum), against the general
  sort of the segments' offsets, with and without padded and short rows;
- a step's positions and lanes from a pattern kept per phase (`order.lanes.rank_step_lanes`), against
  `rank_step_positions` and `position_lanes`.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardkit.formats import Sample
from shardkit.loaders import StreamingDataset
from shardkit.loaders.order.lanes import position_lanes, rank_step_lanes, rank_step_positions
from shardkit.loaders.sources.raw.batches import raw_batch
from shardkit.loaders.sources.raw.segment_samples import LaneSample, SegmentSamples
from test_raw_segment_samples import corpus_file, tokenizer


def segment_samples(tmp_path, pack: str, seq_len: int = 64, **resume) -> tuple[SegmentSamples, list, list]:
    """A segment of the test corpus taken whole (or from a restart point, `resume`): its samples and the restart
    point after each."""
    dataset = StreamingDataset(str(corpus_file(tmp_path)), tokenizer=tokenizer(), seq_len=seq_len, pack=pack,
                               unit_bytes=1 << 22, lanes=1)
    corpus = dataset.source.corpus
    samples = SegmentSamples(next(corpus.segments(0)), corpus, **resume)
    got, restarts = [], []
    for sample in iter(samples.take, None):
        got.append(sample)
        restarts.append(samples.restart())
    return samples, got, restarts


def per_sample_restarts(samples: list, first_record: int, records: int) -> list[tuple[int, int]]:
    """The restart point after each sample by the rule one sample at a time (the code the arrays replace)."""
    last_doc, last_count, out = -1, 0, []
    for sample in samples:
        if int(sample.doc_source[-1]) < 0:
            out.append((records, 0))
            continue
        doc = int(sample.doc_index[-1])
        held = len(sample.tokens) - int(sample.doc_starts[-1])
        last_count = last_count + held if len(sample.doc_index) == 1 and doc == last_doc else held
        last_doc = doc
        out.append((doc - first_record, last_count))
    return out


@pytest.mark.parametrize("pack", ["concat", "none"])
def test_restart_points_of_whole_runs_equal_the_per_sample_rule(tmp_path, pack):
    # seq_len 64 on documents of up to 900 words: documents span many windows (the chains the sum follows)
    samples, got, restarts = segment_samples(tmp_path, pack)
    spanning = sum(1 for s in got if len(s.doc_index) == 1)
    assert len(got) > 100 and spanning > 20
    assert restarts == per_sample_restarts(got, samples.first_record, len(samples.records))
    # resumed inside a document (its first tokens in samples already): the chain carries on from that count
    inside = [k for k, (_, token) in enumerate(restarts[:-1]) if token > 0 and len(got[k + 1].doc_index) == 1]
    assert len(inside) > 10
    for k in inside[::max(1, len(inside) // 6)]:
        document, token = restarts[k]
        _, _, resumed = segment_samples(tmp_path, pack, within=k + 1, document=document, token=token)
        assert resumed == restarts[k + 1:]


def plain(sample) -> Sample:
    """The same sample without the lane's segment lengths: `raw_batch` takes its general path."""
    return Sample(sample.tokens, sample.doc_starts, sample.doc_source, sample.doc_index)


def same_batches(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("pack", ["concat", "none"])
def test_a_batch_of_known_segment_lengths_equals_the_general_assembly(tmp_path, pack):
    _, got, _ = segment_samples(tmp_path, pack)
    assert all(isinstance(s, LaneSample) for s in got)
    regular = [s for s in got if s.segment_lengths is not None]
    assert len(regular) > len(got) // 2
    # concat: full rows, several documents in many, the segment's padded last sample among them; none: rows of
    # mixed lengths (the general path) and batches of one length
    batches = [got[k:k + 8] for k in range(0, len(got), 8)] + [got[-3:], regular[:5], regular[-1:]]
    if pack == "none":
        batches += [[s for s in got if len(s.tokens) == 65][:6]]
    for rows in batches:
        positions, epochs = np.arange(len(rows)) * 3, [0] * len(rows)
        for variable, dense in itertools.product([False, True], [False, True]):
            options = dict(pad_id=7, token_dtype="uint16", variable=variable, dense_segments=dense)
            fast = raw_batch(rows, positions, epochs, **options)
            general = raw_batch([plain(s) for s in rows], positions, epochs, **options)
            assert same_batches(fast, general)


def test_segment_lengths_of_a_sample_tile_its_tokens(tmp_path):
    _, got, _ = segment_samples(tmp_path, "concat")
    for sample in got:
        if sample.segment_lengths is None:  # only the padded last sample
            assert int(sample.doc_source[-1]) < 0
            continue
        assert sample.segment_lengths.sum() == len(sample.tokens)
        assert np.array_equal(np.cumsum(sample.segment_lengths)[:-1], sample.doc_starts[1:])


@pytest.mark.parametrize("dry", [{}, {2: 5}, {0: 3, 4: 9}])
def test_step_lanes_from_a_kept_pattern_equal_the_positions_and_lanes_of_each_step(dry):
    for lanes, world, batch, start in [(7, 2, 3, 0), (7, 2, 3, 11), (64, 8, 8, 0), (5, 3, 4, 2), (4, 1, 8, 5)]:
        for rank, step in itertools.product(range(world), range(12)):
            if dry and max(dry) >= lanes:
                continue
            expected = rank_step_positions(step, start=start, world_size=world, batch_size=batch, rank=rank,
                                           num_lanes=lanes, dry=dry)
            got = rank_step_lanes(step, start=start, world_size=world, batch_size=batch, rank=rank,
                                  num_lanes=lanes, dry=dry)
            assert np.array_equal(got[0], expected)
            for mine, theirs in zip(got[1:], position_lanes(expected, lanes, dry)):
                assert np.array_equal(mine, theirs)
