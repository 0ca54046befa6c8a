"""Packers: every token of every document appears exactly once, in order, with correct segments."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.formats import arrays_from_samples
from shardkit.text.packing import BestFitPacker, ConcatPacker, NonePacker, make_packer

PAD = 9999


def make_docs(lengths, source=0):
    """Documents whose tokens encode (doc number, position) so misplaced tokens are visible."""
    docs = [np.arange(n, dtype=np.int64) % 997 + 1 for n in lengths]
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    return docs, tokens.astype(np.uint32)


def run(packer, batches):
    """Feed batches [(lengths, source, first_index)], return samples."""
    samples = []
    for lengths, source, first in batches:
        _, tokens = make_docs(lengths)
        samples += packer.feed(tokens, np.array(lengths, dtype=np.int64), source, np.arange(first, first + len(lengths)))
    return samples + list(packer.finish())


def pieces_by_doc(samples):
    """(source, index) -> list of token arrays in sample order; checks segment structure."""
    out: dict = {}
    for s in samples:
        starts = s.doc_starts.tolist()
        assert starts[0] == 0 and starts == sorted(set(starts))
        ends = starts[1:] + [len(s.tokens)]
        for a, b, src, idx in zip(starts, ends, s.doc_source.tolist(), s.doc_index.tolist()):
            assert b > a
            if src == -1:
                assert (s.tokens[a:b] == PAD).all() and b == len(s.tokens)
                continue
            out.setdefault((src, idx), []).append(s.tokens[a:b])
    return out


batches_strategy = st.lists(st.lists(st.integers(1, 60), max_size=12), min_size=1, max_size=6)


def _batches(groups):
    """Batches from three sources; doc_index counts within each source (as a build numbers them), so two
    documents of different sources share indices and only (source, index) tells them apart."""
    batches, next_index = [], [0, 0, 0]
    for number, lengths in enumerate(groups):
        source = number % 3
        batches.append((lengths, source, next_index[source]))
        next_index[source] += len(lengths)
    return batches


def _check_all_tokens(samples, batches):
    got = pieces_by_doc(samples)
    expected = {}
    for lengths, source, first in batches:
        docs, _ = make_docs(lengths)
        for k, doc in enumerate(docs):
            expected[(source, first + k)] = doc
    assert set(got) == set(expected)
    for key, doc in expected.items():
        np.testing.assert_array_equal(np.concatenate(got[key]), doc)


@settings(max_examples=150, deadline=None)
@given(groups=batches_strategy, seq_len=st.integers(1, 40))
def test_concat_keeps_every_token_once_in_order(groups, seq_len):
    batches = _batches(groups)
    packer = ConcatPacker(seq_len + 1, PAD, "uint32")
    samples = run(packer, batches)
    assert all(len(s.tokens) == seq_len + 1 for s in samples)
    _check_all_tokens(samples, batches)
    real = sum(sum(b[0]) for b in batches)
    padding = sum(int((s.doc_source == -1).any()) and int(len(s.tokens) - s.doc_starts[-1]) for s in samples)
    assert real + padding == len(samples) * (seq_len + 1)
    assert padding < seq_len + 1  # only the final partial window is padded
    spanning = sum(len(pieces) > 1 for pieces in pieces_by_doc(samples).values())
    assert packer.stats.split_documents == spanning
    arrays_from_samples(samples, "uint32")  # the shard writer accepts the segments


@settings(max_examples=150, deadline=None)
@given(groups=batches_strategy, seq_len=st.integers(1, 40), buffer=st.integers(1, 8), max_open=st.integers(0, 4))
def test_bestfit_keeps_every_token_once_in_order(groups, seq_len, buffer, max_open):
    batches = _batches(groups)
    packer = BestFitPacker(seq_len + 1, PAD, "uint32", buffer_docs=buffer, max_open=max_open)
    samples = run(packer, batches)
    assert all(len(s.tokens) == seq_len + 1 for s in samples)
    _check_all_tokens(samples, batches)
    lengths = [n for b in batches for n in b[0]]
    assert packer.stats.split_documents == sum(n > seq_len + 1 for n in lengths)
    assert packer.stats.padding_tokens == len(samples) * (seq_len + 1) - sum(lengths)
    # a document that fits a window is never split
    per_doc = pieces_by_doc(samples)
    for (lengths_, source, first) in batches:
        for k, n in enumerate(lengths_):
            if n <= seq_len + 1:
                assert len(per_doc[(source, first + k)]) == 1


@settings(max_examples=100, deadline=None)
@given(groups=batches_strategy, seq_len=st.integers(1, 40))
def test_none_one_document_per_sample(groups, seq_len):
    batches = _batches(groups)
    samples = run(NonePacker(seq_len + 1, PAD, "uint32"), batches)
    assert all(1 <= len(s.tokens) <= seq_len + 1 and len(s.doc_starts) == 1 for s in samples)
    _check_all_tokens(samples, batches)


@pytest.mark.parametrize("mode", ["concat", "bestfit", "none"])
@settings(max_examples=40, deadline=None)
@given(groups=batches_strategy, cut=st.integers(0, 6))
def test_snapshot_restore_continues_identically(mode, groups, cut):
    """Restoring a snapshot taken between batches gives the same samples as an uninterrupted run."""
    batches = _batches(groups)
    cut = min(cut, len(batches))
    make = lambda: make_packer(mode, seq_len=9, pad_id=PAD, token_dtype="uint32", buffer_docs=3, max_open=2)  # noqa: E731
    whole = run(make(), batches)
    first = make()
    head = []
    for lengths, source, index in batches[:cut]:
        _, tokens = make_docs(lengths)
        head += first.feed(tokens, np.array(lengths), source, np.arange(index, index + len(lengths)))
    state = first.snapshot()
    second = make()
    second.restore(state)
    tail = run(second, batches[cut:])
    assert len(head) + len(tail) == len(whole)
    for a, b in zip(head + tail, whole):
        for field in ("tokens", "doc_starts", "doc_source", "doc_index"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert second.stats == run_stats(make(), batches)


def run_stats(packer, batches):
    run(packer, batches)
    return packer.stats


def test_batching_does_not_change_samples():
    lengths = [5, 17, 3, 40, 8, 8, 1, 22]
    one = run(make_packer("bestfit", seq_len=15, pad_id=PAD, token_dtype="uint32", buffer_docs=3), [(lengths, 0, 0)])
    split = run(make_packer("bestfit", seq_len=15, pad_id=PAD, token_dtype="uint32", buffer_docs=3),
                [(lengths[:3], 0, 0), (lengths[3:], 0, 3)])
    assert [s.tokens.tolist() for s in one] == [s.tokens.tolist() for s in split]


def test_concat_final_partial_window_is_padded_and_reported():
    packer = ConcatPacker(10, PAD, "uint32")
    samples = run(packer, [([7, 6], 0, 0)])
    assert len(samples) == 2
    last = samples[-1]
    assert last.tokens[3:].tolist() == [PAD] * 7
    assert last.doc_source.tolist() == [0, -1] and last.doc_starts.tolist() == [0, 3]
    assert packer.stats.final_partial_tokens == 3 and packer.stats.padding_tokens == 7
    # document 1 continues from the first window: same doc index at start 0
    assert samples[1].doc_index.tolist() == [1, -1]


def test_bestfit_fills_windows_tightly():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 3000).tolist()
    packer = BestFitPacker(1025, PAD, "uint32", buffer_docs=512, max_open=64)
    samples = run(packer, [(lengths, 0, 0)])
    fraction = packer.stats.padding_tokens / (len(samples) * 1025)
    assert fraction < 0.02, fraction


def test_bad_mode_and_bestfit_sizes_are_refused():
    with pytest.raises(ValueError, match="pack= must be one of"):  # a Python call: its keyword
        make_packer("shuffle", seq_len=8, pad_id=0, token_dtype="uint16")
    for sizes in (dict(buffer_docs=0), dict(max_open=-1)):
        with pytest.raises(ValueError, match="buffer_docs must be >= 1 and max_open >= 0"):
            BestFitPacker(10, PAD, "uint32", **sizes)


def test_bestfit_fills_a_window_with_exactly_the_room_left():
    samples = run(BestFitPacker(10, PAD, "uint32", buffer_docs=1, max_open=4), [([4], 0, 0), ([6], 0, 1)])
    assert [s.doc_index.tolist() for s in samples] == [[0, 1]]


@pytest.mark.parametrize("mode", ["concat", "bestfit", "none"])
def test_stats_count_samples_documents_and_tokens(mode):
    """The build report and the manifest's counts come from these counters."""
    packer = make_packer(mode, seq_len=9, pad_id=PAD, token_dtype="uint32", buffer_docs=2, max_open=1)
    samples = run(packer, [([7, 6, 25], 0, 0), ([10], 1, 0)])
    stats = packer.stats
    assert (stats.samples, stats.documents, stats.document_tokens) == (len(samples), 4, 48)
    assert stats.padding_tokens == sum(len(s.tokens) for s in samples) - 48
    assert stats.final_partial_tokens == (48 % 10 if mode == "concat" else 0)
    # concat splits every document that crosses a window edge; the others only those longer than a window
    assert stats.split_documents == (3 if mode == "concat" else 1)
    assert max(len(s.tokens) for s in samples) == 10  # windows of seq_len + 1 tokens
    assert packer.finish().num_samples == 0  # finishing emptied the packer


def test_bestfit_keeps_max_open_windows_open_and_a_snapshot_restores_them():
    make = lambda: BestFitPacker(10, PAD, "uint32", buffer_docs=1, max_open=1)  # noqa: E731
    batches = [([4], 0, 0), ([8], 0, 1), ([5], 0, 2)]
    whole = run(make(), batches)
    # Two windows open after document 1, one allowed: the fuller one (document 1) closes, document 0's
    # stays open and document 2 joins it (the best fit). Padding is (source -1, index -1).
    assert [s.doc_index.tolist() for s in whole] == [[1, -1], [0, 2, -1]]
    assert [s.doc_source.tolist() for s in whole] == [[0, -1], [0, 0, -1]]
    first, head = make(), []
    for lengths, source, index in batches[:2]:
        _, tokens = make_docs(lengths)
        head += first.feed(tokens, np.array(lengths), source, np.array([index]))
    second = make()
    second.restore(first.snapshot())  # taken with document 0's window (the first, seq 0) open
    samples = head + run(second, batches[2:])
    assert [s.tokens.tolist() for s in samples] == [s.tokens.tolist() for s in whole]
    assert [s.doc_index.tolist() for s in samples] == [s.doc_index.tolist() for s in whole]
