"""The raw-text loader's units: byte ranges of JSONL files found without reading the file, each line in exactly
one range wherever the ranges' ends fall."""

import json

import pytest

from shardkit.loaders.sources.raw.units import RANGE, list_units, read_segments
from shardkit.text.documents import parse_unit
from shardkit.text.inputs import expand_inputs, max_line_bytes


def lines_by_range(path, unit_bytes, max_doc_chars=10_000_000):
    files = expand_inputs([str(path)])
    table = list_units(files, unit_bytes=unit_bytes, text_field="text", storage_options=None)
    assert table.kinds == (RANGE,) and len(table.size) <= max(1, -(-files[0].size // unit_bytes))
    assert int(table.size.sum()) == max(1, files[0].size)  # the ranges cover the file
    texts, rejected = [], []
    for number in range(len(table.size)):
        for unit in read_segments(table, files, number, skip=0, unit_bytes=unit_bytes, txt_mode="file",
                                  text_field="text", max_doc_chars=max_doc_chars, storage_options=None):
            accepted, got, bad, records = parse_unit(unit, text_field="text", max_doc_chars=max_doc_chars)
            assert records or not files[0].size, f"unit {number} holds no line"  # issue 45 item 8
            texts += got
            rejected += [reason for _, reason in bad]
    return texts, rejected


@pytest.mark.parametrize("unit_bytes", [1, 2, 7, 33, 100, 4096])
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_every_line_in_exactly_one_range(tmp_path, unit_bytes, trailing_newline):
    docs = ["x" * n for n in (1, 0, 40, 3, 120, 2, 0, 9)]
    docs = [d or "short" for d in docs]
    body = "\n".join(json.dumps({"text": d}) for d in docs) + ("\n" if trailing_newline else "")
    path = tmp_path / "c.jsonl"
    path.write_text(body)
    texts, rejected = lines_by_range(path, unit_bytes)
    assert texts == docs and not rejected


def test_ranges_over_fsspec_read_the_same_lines(tmp_path):
    import fsspec

    docs = [f"document {i} " + "y" * (i * 7 % 90) for i in range(60)]
    body = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    with fsspec.open("memory://raw-units/c.jsonl", "wb") as fh:
        fh.write(body)
    (tmp_path / "c.jsonl").write_bytes(body)
    assert lines_by_range("memory://raw-units/c.jsonl", 257) == lines_by_range(tmp_path / "c.jsonl", 257)
    assert lines_by_range("memory://raw-units/c.jsonl", 257)[0] == docs


def test_an_empty_file_is_one_empty_range(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    assert lines_by_range(tmp_path / "e.jsonl", 100) == ([], [])


def test_a_line_too_long_to_read_is_rejected_as_the_build_rejects_it(tmp_path):
    limit = max_line_bytes(10)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b" * (limit + 10)}) + "\n"
                    + json.dumps({"text": "c"}) + "\n")
    texts, rejected = lines_by_range(path, 64, max_doc_chars=10)
    assert texts == ["a", "c"] and len(rejected) == 1 and rejected[0].startswith("line is longer than")


def test_a_txt_read_by_paragraphs_is_streamed_in_the_builds_segments(tmp_path):
    from shardkit.loaders.sources.raw.units import STREAMED
    from shardkit.text.inputs import iter_units

    paragraphs = [f"paragraph {i}\n" + "z" * (1 + i * 13 % 200) for i in range(80)]
    (tmp_path / "p.txt").write_text("\n\n\n".join(paragraphs) + "\n")
    files = expand_inputs([str(tmp_path / "p.txt")])
    table = list_units(files, unit_bytes=512, text_field="text", storage_options=None)
    assert table.kinds == (STREAMED,) and len(table.size) == 1
    settings = dict(unit_bytes=512, txt_mode="paragraph", text_field="text", max_doc_chars=10_000)
    segments = list(read_segments(table, files, 0, skip=0, storage_options=None, **settings))
    assert len(segments) > 3
    assert [s.payload for s in segments] == [u.payload for u in iter_units(files, **settings)]
    texts = [t for s in segments for t in parse_unit(s, text_field="text", max_doc_chars=10_000)[1]]
    assert texts == paragraphs
    # a resume into segment 2 reads on from there without the segments before it
    assert list(read_segments(table, files, 0, skip=2, storage_options=None, **settings))[0].payload \
        == segments[2].payload


def test_rejected_records_are_named_as_the_build_names_them_or_by_exact_byte_offset(tmp_path, caplog):
    """The build's report names line 6 of a.jsonl; the loader, which reads a.jsonl by byte ranges without counting
    the lines before them, names the byte offset where that line starts. A streamed .gz file and Parquet rows are
    numbered as the build numbers them."""
    import logging

    from shardkit.loaders import StreamingDataset
    from shardkit.tools.build import run_build
    from test_build import config, write_corpus
    from test_raw_text import first_epoch

    corpus = write_corpus(tmp_path / "in", docs=150)
    report = run_build(config([corpus], tmp_path / "built", packing="none", seq_len=256)).report
    ds = StreamingDataset(str(corpus), tokenizer="byte", seq_len=256, unit_bytes=4096, lanes=4)
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.corpus"):
        first_epoch(ds)  # every lane through its lane epoch 0
    logged = {r.getMessage().split(": rejected a document: ")[0] for r in caplog.records}
    plain = (corpus / "a.jsonl").read_bytes()
    line_starts = [0] + [i + 1 for i, byte in enumerate(plain) if byte == ord("\n")]
    expected = set()
    for example in report["documents"]["examples"]:
        if example["file"].endswith("a.jsonl"):  # line N (1-based) starts at byte line_starts[N - 1]
            expected.add(f"{example['file']} byte offset {line_starts[example['line'] - 1]}")
        else:
            where = " ".join(f"{k} {v}" for k, v in example.items() if k not in ("file", "reason"))
            expected.add(f"{example['file']} {where}")
    assert logged == expected and any("byte offset" in m for m in logged) and any("line" in m for m in logged)


def few_lanes_warnings(caplog, corpus, *, world_size, **settings):
    import logging

    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.feed"):
        for _ in range(2):  # a second loader over the same corpus and readers: warned once
            ds = StreamingDataset(str(corpus), tokenizer="byte", seq_len=64, rank=0, world_size=world_size,
                                  **settings)
            next(iter(StreamingDataLoader(ds, batch_size=2)))
    return [r.getMessage() for r in caplog.records if "lanes for" in r.getMessage()]


def test_few_lanes_for_the_readers_warn_once_naming_the_cause_and_the_fix(tmp_path, caplog):
    import zstandard

    text = "".join(f'{{"text": "document {i} {"x" * 80}"}}\n' for i in range(200)).encode()
    for name in ("one", "two"):
        (tmp_path / f"{name}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    [warning] = few_lanes_warnings(caplog, tmp_path, world_size=3, unit_bytes=1024)
    assert "2 lanes for 3 readers (ranks x DataLoader workers)" in warning
    assert "2 of its 2 files are compressed (.gz / .zst)" in warning and "split the corpus" in warning
    assert "plain .jsonl or Parquet" in warning
    (tmp_path / "plain.jsonl").write_bytes(text)  # its byte ranges give lanes enough
    caplog.clear()
    assert few_lanes_warnings(caplog, tmp_path, world_size=3, unit_bytes=1024) == []
    [warning] = few_lanes_warnings(caplog, tmp_path, world_size=3, unit_bytes=1024, lanes=2)
    assert "lanes=2; for more lanes give lanes >= 3" in warning


def test_documents_longer_than_a_unit_leave_no_empty_lane(tmp_path):
    """Issue 45 item 8: a few documents longer than a unit left byte ranges with no line start, each a lane of its
    own that raised "lane N of M holds no accepted document" before the first batch; those ranges are merged into
    the range before them when listing, so every lane holds documents and lane epoch 0 gives every token once."""
    from shardkit.loaders import StreamingDataset
    from test_raw_text import first_epoch

    docs = ["long " * 1500 if i % 10 == 3 else f"short document {i}" for i in range(40)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ds = StreamingDataset(str(path), tokenizer="byte", seq_len=64, unit_bytes=2048)
    assert ds.source.corpus.num_lanes < -(-path.stat().st_size // 2048)  # ranges were merged
    tokens = [t for sample in first_epoch(ds) for t in sample]
    assert len(tokens) == sum(len(d) + 1 for d in docs)  # every document's bytes and its EOS, once
