"""Input expansion, work units and document parsing with precise rejection reasons."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from shardkit.text.documents import DocumentSettings, parse_unit, tokenize_unit
from shardkit.text.inputs import classify, expand_inputs, iter_units


def lines(*objs):
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs).encode()


def parse_all(files, **kwargs):
    out = []
    for unit in iter_units(files, **kwargs):
        ids, texts, rejected, n = parse_unit(unit, text_field=kwargs.get("text_field", "text"),
                                             max_doc_chars=kwargs.get("max_doc_chars", 10_000_000))
        out.append((unit, ids, texts, rejected, n))
    return out


def test_classify():
    assert classify("a/b.JSONL.ZST") == ("jsonl", "zstd")
    assert classify("x.jsonl.gz") == ("jsonl", "gzip")
    assert classify("x.parquet") == ("parquet", None)
    assert classify("x.csv") is None


def test_expand_files_dirs_globs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.jsonl", "d/a.txt", "d/sub/c.jsonl.zst", "d/ignored.csv", "e.jsonl"):
        (tmp_path / name).write_bytes(b"")
    files = expand_inputs([str(tmp_path / "e.jsonl"), str(tmp_path / "d")])
    assert [f.url.rsplit("/", 2)[-2:] for f in files] == [[tmp_path.name, "e.jsonl"], ["d", "a.txt"], ["d", "b.jsonl"],
                                                           ["sub", "c.jsonl.zst"]]
    globbed = expand_inputs([str(tmp_path / "d" / "*.jsonl")])
    assert [f.url.endswith("b.jsonl") for f in globbed] == [True]
    with pytest.raises(FileNotFoundError, match="no such file"):
        expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="unrecognised file type"):
        expand_inputs([str(tmp_path / "d" / "ignored.csv")])
    with pytest.raises(ValueError, match="named twice"):
        expand_inputs([str(tmp_path / "e.jsonl"), str(tmp_path / "*.jsonl")])


def test_jsonl_rejections_name_line_and_reason(tmp_path):
    data = lines({"text": "good one"}, "{not json", {"body": "x"}, {"text": 5}, {"text": ""}, {"text": "   "},
                 "", "[1, 2]", {"text": "y" * 50}, '{"text": "bad \\ud800 surrogate"}', {"text": "last good"})
    data = data.replace(b"good one", b"good one")
    bad_utf8 = b'{"text": "caf\xe9"}\n'
    path = tmp_path / "x.jsonl"
    path.write_bytes(data + bad_utf8)
    files = expand_inputs([str(path)])
    (unit, ids, texts, rejected, n), = parse_all(files, max_doc_chars=20)
    assert texts == ["good one", "last good"] and ids == [0, 10]
    reasons = dict(rejected)
    assert reasons[1].startswith("malformed JSON")
    assert reasons[2].startswith("no 'text' field (fields: body)")
    assert reasons[3] == "'text' is int, not a string"
    assert reasons[4].startswith("empty document") and reasons[5].startswith("empty document")
    assert reasons[6].startswith("blank line")
    assert reasons[7] == "not a JSON object (got list)"
    assert reasons[8].startswith("enormous document: 50 characters")
    assert "lone surrogate" in reasons[9]
    assert reasons[11].startswith("invalid UTF-8 at byte")
    assert n == 12 == len(ids) + len(rejected)


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_compressed_units_cover_every_line(tmp_path, compression):
    data = lines(*({"text": f"document {i} " + "w" * (i % 50)} for i in range(500)))
    if compression == "gzip":
        path = tmp_path / "x.jsonl.gz"
        path.write_bytes(gzip.compress(data))
    else:
        path = tmp_path / "x.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    parsed = parse_all(expand_inputs([str(path)]), unit_bytes=1000)
    assert len(parsed) > 5
    ids = [i for p in parsed for i in p[1]]
    assert ids == list(range(500))
    assert [p[0].index for p in parsed] == list(range(len(parsed)))
    # resuming at unit k gives exactly the units from k on
    k = 3
    again = list(iter_units(expand_inputs([str(path)]), unit_bytes=1000, start=(k, 0, k)))
    assert [(u.index, u.first_record, u.payload) for u in again] == \
        [(p[0].index, p[0].first_record, p[0].payload) for p in parsed[k:]]


def test_truncated_zstd_is_a_file_error_with_partial_record(tmp_path):
    rng = np.random.default_rng(0)
    data = lines(*({"text": f"document {i} {rng.integers(0, 10**12, 8)}"} for i in range(20000)))
    blob = zstandard.ZstdCompressor().compress(data)  # ~1.5 MB of text: several zstd blocks
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(blob[: len(blob) // 2])
    parsed = parse_all(expand_inputs([str(path)]), unit_bytes=4096)
    errors = [p[0].file_error for p in parsed if p[0].file_error]
    assert len(errors) == 1 and "read failed after" in errors[0]
    accepted = sum(len(p[1]) for p in parsed)
    seen = sum(p[4] for p in parsed)
    assert 0 < accepted < 20000 and seen == accepted + sum(len(p[3]) for p in parsed)


@pytest.mark.parametrize(("compression", "records"), [("gzip", 60), ("zstd", 3000)])
def test_a_damaged_compressed_file_gives_every_record_decompressed_before_the_damage(tmp_path, compression, records):
    """Issue 45 item 8: the reader dropped the whole 1 MiB chunk a corruption fell in, so a small damaged file gave
    no record at all (in the build and the loader alike). A small gzip member, and zstd blocks (a damaged zstd
    block is lost whole: its records are the ones before it)."""
    rng = np.random.default_rng(1)
    data = lines(*({"text": f"document {i} {rng.integers(0, 10**12, 8)}"} for i in range(records)))
    blob = bytearray(gzip.compress(data) if compression == "gzip" else zstandard.ZstdCompressor().compress(data))
    damage = int(len(blob) * 0.8)
    blob[damage:damage + 8] = bytes(b ^ 0xFF for b in blob[damage:damage + 8])
    path = tmp_path / f"damaged.jsonl.{'gz' if compression == 'gzip' else 'zst'}"
    path.write_bytes(bytes(blob))
    parsed = parse_all(expand_inputs([str(path)]), unit_bytes=1 << 20)
    assert [bool(p[0].file_error) for p in parsed] == [False] * (len(parsed) - 1) + [True]
    texts = [t for p in parsed for t in p[2]]
    assert len(texts) >= records // 2  # before: none
    assert texts[:20] == [json.loads(line)["text"] for line in data.decode().splitlines()[:20]]


def test_oversized_line_is_dropped_while_reading(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(lines({"text": "a"}, {"text": "z" * 200_000}, {"text": "b"}))
    parsed = parse_all(expand_inputs([str(path)]), unit_bytes=4096, max_doc_chars=1000)
    texts = [t for p in parsed for t in p[2]]
    rejected = [r for p in parsed for r in p[3]]
    assert texts == ["a", "b"]
    assert rejected == [(1, rejected[0][1])] and "longer than" in rejected[0][1]


def test_txt_modes(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First para\nline two\n\n  \nSecond para\n\n\nThird\n")
    files = expand_inputs([str(path)])
    (_, _, texts, _, _), = parse_all(files)
    assert texts == [path.read_text()]
    paragraphs = [t for p in parse_all(files, txt_mode="paragraph") for t in p[2]]
    assert paragraphs == ["First para\nline two", "Second para", "Third"]


def test_parquet_rows_and_nulls(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["alpha", None, "", "gamma"] * 50}), path, row_group_size=64)
    parsed = parse_all(expand_inputs([str(path)]), text_field="content", unit_bytes=64 * 2048)
    texts = [t for p in parsed for t in p[2]]
    rejected = [r for p in parsed for r in p[3]]
    assert texts == ["alpha", "gamma"] * 50
    assert rejected[0] == (1, "'content' is null") and rejected[1][0] == 2 and len(rejected) == 100
    missing = parse_all(expand_inputs([str(path)]), text_field="text")
    assert "no column 'text'" in missing[0][0].file_error


def test_tokenize_unit_adds_eos_and_bos(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(lines({"text": "ab"}, {"text": ""}, {"text": "c"}))
    unit, = iter_units(expand_inputs([str(path)]))
    result = tokenize_unit(unit, DocumentSettings(tokenizer="byte", token_dtype="uint16", eos_id=256, bos_id=257))
    assert result.tokens.tolist() == [257, 97, 98, 256, 257, 99, 256]
    assert result.doc_lengths.tolist() == [4, 3] and result.doc_index.tolist() == [0, 2]
    assert result.documents_in == 3 and result.rejected[0][0] == 1
    assert result.tokens.dtype == np.uint16


@pytest.mark.s3
def test_remote_inputs_are_read_under_the_core_retry_policy(faulty_bucket, caplog):
    """Inputs on S3 are read through `shardkit.storage`'s filesystems and `retry_call`: every fault the
    store answers reaches shardkit's retry layer (one logged retry each, none hidden in botocore or s3fs,
    whose own retries `open_filesystem` turns off), and every record still arrives once."""
    import logging

    from shardkit.storage import Storage

    url, options, proxy = faulty_bucket
    texts = [f"document {i} " * (i % 7 + 1) for i in range(300)]
    Storage(url, options).write_bytes("in/a.jsonl.gz", gzip.compress(lines(*({"text": t} for t in texts))))
    Storage(url, options).write_bytes("in/b.parquet", parquet_bytes(texts[:50]))
    files = expand_inputs([f"{url}/in"], options)
    proxy.configure(rate=0.5, seed=7, kinds=("error500", "error503", "slowdown"))
    with caplog.at_level(logging.WARNING, logger="shardkit.storage"):
        units = parse_all(files, unit_bytes=4096, storage_options=options)
    assert not [u.file_error for u, *_ in units if u.file_error]
    assert [t for _, _, unit_texts, _, _ in units for t in unit_texts] == texts + texts[:50]
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert proxy.injected >= 1 and len(retries) == proxy.injected
    assert {f.url for f in files} == {f"{url}/in/a.jsonl.gz", f"{url}/in/b.parquet"}


def parquet_bytes(texts) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts}), sink)
    return sink.getvalue().to_pybytes()
