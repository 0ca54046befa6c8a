"""The raw-text loader's units: byte ranges of JSONL files found without reading the file, each line in exactly
one range wherever the ranges' ends fall."""

import json

import pytest

from shardkit.loaders.raw_units import RANGE, list_units, read_segments
from shardkit.text.documents import parse_unit
from shardkit.text.inputs import expand_inputs, max_line_bytes


def lines_by_range(path, unit_bytes, max_doc_chars=10_000_000):
    files = expand_inputs([str(path)])
    table = list_units(files, unit_bytes=unit_bytes, text_field="text", storage_options=None)
    assert table.kinds == (RANGE,) and len(table.size) == max(1, -(-files[0].size // unit_bytes))
    texts, rejected = [], []
    for number in range(len(table.size)):
        for unit in read_segments(table, files, number, skip=0, unit_bytes=unit_bytes, txt_mode="file",
                                  text_field="text", max_doc_chars=max_doc_chars, storage_options=None):
            accepted, got, bad, _ = parse_unit(unit, text_field="text", max_doc_chars=max_doc_chars)
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
    from shardkit.loaders.raw_units import STREAMED
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
