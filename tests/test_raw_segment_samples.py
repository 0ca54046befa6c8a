"""A raw-text segment's samples made as its documents are tokenized (`sources.raw.segment_samples`): the same
samples as the whole segment tokenized at once, the first one after a few documents, and a restart point from
which a resume tokenizes only from the document the next sample begins in."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.sources.raw.segment_samples import SegmentSamples
from shardkit.text.documents import tokenize_unit
from test_raw_text import rows, take
from shardkit.loaders.state.envelope import decode

GPT2 = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "gpt2_hf_tokenizer.json"
WORDS = "the of and a to in is was he for it with as his on be at by had are but from or data text".split()


def corpus_file(directory: Path, docs: int = 300, seed: int = 7) -> Path:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 40, 300, 900])))})
             for _ in range(docs)]
    lines[11] = json.dumps({"text": ""})  # rejected when parsed
    path = directory / "a.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def tokenizer() -> str:
    return str(GPT2) if GPT2.exists() else "byte"


def whole(corpus, segment) -> list:
    """The segment's samples as before: every document tokenized at once, one packer fed once."""
    result = tokenize_unit(segment, corpus.documents)
    packer = corpus.packer()
    return [*packer.feed(result.tokens, result.doc_lengths, result.source, result.doc_index), *packer.finish()]


FIRST_CALL = (1 << 13) + 6000  # the first call's characters, and one document over it


def tokenized(samples: SegmentSamples, document: int) -> int:
    """Characters of text the segment's samples tokenized from `document` on."""
    return int(samples.chars[samples.next_document] - samples.chars[document])


def same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "doc_starts", "doc_source",
                                                                          "doc_index"))


@pytest.mark.parametrize("pack", ["concat", "none", "bestfit"])
def test_incremental_samples_equal_the_whole_segment_and_every_restart_point_resumes_exactly(tmp_path, pack):
    path = corpus_file(tmp_path)
    dataset = StreamingDataset(str(path), tokenizer=tokenizer(), seq_len=128, pack=pack, unit_bytes=1 << 22,
                               lanes=1, bestfit_buffer=64, bestfit_open=8)
    corpus = dataset.source.corpus
    segment = next(corpus.segments(0))
    reference = whole(corpus, segment)
    samples = SegmentSamples(segment, corpus)
    first = samples.take()
    # the first sample needs only the first few of the segment's documents (bestfit: its first buffer)
    if pack == "bestfit":
        assert samples.next_document <= 64 + 2 < len(samples.records)
    else:
        assert tokenized(samples, 0) <= FIRST_CALL < samples.chars[-1] / 10
    got, restarts = [first], [samples.restart()]
    for sample in iter(samples.take, None):
        got.append(sample)
        restarts.append(samples.restart())
    assert len(got) == len(reference) > 20 and all(same(a, b) for a, b in zip(got, reference))
    if pack == "bestfit":
        assert set(restarts) == {(0, 0)}  # no restart point: a resume re-tokenizes from the segment's start
        return
    assert len(set(restarts)) == len(restarts)  # every sample moves the stream on
    for within in [*range(1, len(reference), max(1, len(reference) // 12)), len(reference) - 1]:
        document, token = restarts[within - 1]
        resumed = SegmentSamples(segment, corpus, within=within, document=document, token=token)
        assert same(resumed.take(), reference[within]), f"resuming at sample {within} from ({document}, {token})"
        assert tokenized(resumed, document) <= FIRST_CALL  # it tokenized only from the restart document on
    tail = SegmentSamples(segment, corpus, within=len(reference), document=restarts[-1][0], token=restarts[-1][1])
    assert tail.take() is None


def test_a_resumed_loader_restarts_inside_the_segment_and_continues_exactly(tmp_path):
    path = corpus_file(tmp_path / "in")
    settings = dict(tokenizer=tokenizer(), seq_len=128, unit_bytes=1 << 22, lanes=1)
    reference = rows(take(StreamingDataLoader(StreamingDataset(str(path), **settings), batch_size=4), 12))
    loader = StreamingDataLoader(StreamingDataset(str(path), **settings), batch_size=4)
    head = take(loader, 5)
    state = loader.state_dict()
    resumed = StreamingDataLoader(StreamingDataset(str(path), **settings), batch_size=4)
    resumed.load_state_dict(state)
    assert rows(head) + rows(take(resumed, 7)) == reference
    # a state saved before the restart point was kept (version 1, six entries per cursor) resumes exactly too
    flat = decode(state)
    old = {**flat, "raw_text": {**flat["raw_text"], "cursors": [row[:6] for row in flat["raw_text"]["cursors"]]}}
    again = StreamingDataLoader(StreamingDataset(str(path), **settings), batch_size=4)
    again.load_state_dict(old)
    assert rows(head) + rows(take(again, 7)) == reference


def test_a_lane_cursor_reads_as_its_fields_in_order():
    from dataclasses import astuple

    from shardkit.loaders.sources.raw.corpus import CURSOR_FIELDS, LaneCursor

    cursor = LaneCursor(*range(1, CURSOR_FIELDS + 1))
    assert cursor.as_tuple() == astuple(cursor) == tuple(range(1, CURSOR_FIELDS + 1))
