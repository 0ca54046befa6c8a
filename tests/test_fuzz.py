"""Bounded fuzzing (hypothesis, derandomized so CI is reproducible): the shard decoders and the
JSONL/Parquet ingest, fed mutated and arbitrary bytes, either succeed or raise only their documented
errors (CorruptShardError for shards; for the ingest nothing escapes: every record is accounted as
accepted or rejected, and an unreadable file is reported on its unit)."""

from __future__ import annotations

import gzip
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.errors import CorruptShardError
from shardkit.formats import Sample, arrays_from_samples, decode_shard, encode_shard

FUZZ = settings(max_examples=150, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
COUNTS = {"shards": 0, "ingest": 0}


@st.composite
def shards(draw):
    """A valid encoded shard (tar or arrow, uint16 or uint32, with or without documents)."""
    shard_format = draw(st.sampled_from(["tar", "arrow"]))
    token_dtype = draw(st.sampled_from(["uint16", "uint32"]))
    docs = draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, 40), min_size=0, max_size=6))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    samples = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(0, 60000, n)
        if docs:
            starts = np.array([0] + sorted(rng.choice(np.arange(1, n), size=min(2, max(n - 1, 0)), replace=False)))[:max(1, min(n, 3))] if n else np.zeros(0, int)
            samples.append(Sample(tokens, starts, np.zeros(len(starts)), np.arange(len(starts)) + i))
        else:
            samples.append(Sample(tokens))
    encoded = encode_shard(arrays_from_samples(samples, token_dtype), shard_format=shard_format, token_dtype=token_dtype)
    return shard_format, token_dtype, encoded


@st.composite
def mutated(draw):
    shard_format, token_dtype, encoded = draw(shards())
    data = bytearray(encoded.data)
    for _ in range(draw(st.integers(0, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    if draw(st.integers(0, 9)) == 0:
        data += draw(st.binary(max_size=600))
    raw = encoded.raw_bytes + draw(st.sampled_from([0, 0, 0, -1, 1, -encoded.raw_bytes, 10**6]))
    return shard_format, token_dtype, bytes(data), max(raw, 0)


@FUZZ
@given(mutated())
def test_fuzz_decode_shard_raises_only_corrupt_shard_error(case):
    shard_format, token_dtype, data, raw = case
    COUNTS["shards"] += 1
    try:
        arrays = decode_shard(data, shard_format=shard_format, token_dtype=token_dtype, shard="fuzz", raw_bytes=raw)
    except CorruptShardError as err:
        assert "fuzz" in str(err)
        return
    arrays.validate("fuzz")  # whatever decodes is structurally sound


@FUZZ
@given(st.sampled_from(["tar", "arrow"]), st.binary(max_size=2048), st.integers(0, 10**6))
def test_fuzz_decode_shard_on_arbitrary_bytes(shard_format, data, raw):
    if shard_format == "arrow":
        data = b"ARROW1\0\0" + data  # get past the magic check sometimes
    try:
        decode_shard(data, shard_format=shard_format, token_dtype="uint16", shard="fuzz", raw_bytes=raw)
    except CorruptShardError:
        pass


# -- ingest -----------------------------------------------------------------------------------------
def ingest(path: str) -> tuple[int, int, int, list[str | None]]:
    """Run the build's reading and tokenizing stages over one file: (records, accepted, rejected, file errors)."""
    from shardkit.tools.documents import DocumentSettings, tokenize_unit
    from shardkit.tools.inputs import expand_inputs, iter_units

    files = expand_inputs([path])
    settings_ = DocumentSettings(tokenizer="byte", token_dtype="uint16", eos_id=None, max_doc_chars=5000)
    records = accepted = rejected = 0
    errors = []
    for unit in iter_units(files, unit_bytes=512, max_doc_chars=5000):
        result = tokenize_unit(unit, settings_)
        assert len(result.doc_index) + len(result.rejected) == result.documents_in, "a record went unaccounted"
        assert int(result.doc_lengths.sum()) == len(result.tokens)
        records += result.documents_in
        accepted += len(result.doc_index)
        rejected += len(result.rejected)
        errors.append(result.file_error)
    return records, accepted, rejected, errors


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
                           lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
                           max_leaves=6)


@st.composite
def jsonl_bytes(draw):
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 4))
        if kind == 0:
            lines.append(json.dumps({"text": draw(st.text(max_size=80))}, ensure_ascii=draw(st.booleans())).encode())
        elif kind == 1:
            lines.append(json.dumps({"text": draw(json_values), "other": 1}).encode())
        elif kind == 2:
            lines.append(draw(st.binary(max_size=60)).replace(b"\n", b" "))
        elif kind == 3:
            lines.append(json.dumps(draw(json_values)).encode())
        else:
            lines.append(b"")
    body = b"\n".join(lines)
    if draw(st.booleans()):
        body += b"\n"
    return body


@FUZZ
@given(jsonl_bytes(), st.sampled_from(["", ".gz", ".zst"]), st.booleans())
def test_fuzz_jsonl_ingest_accounts_for_every_record(tmp_path_factory, body, compression, truncate):
    COUNTS["ingest"] += 1
    data = body
    if compression == ".gz":
        data = gzip.compress(body, mtime=0)
    elif compression == ".zst":
        data = zstandard.ZstdCompressor().compress(body)
    if truncate and compression and len(data) > 4:
        data = data[:len(data) // 2]
    path = tmp_path_factory.mktemp("fuzz") / f"input.jsonl{compression}"
    path.write_bytes(data)
    records, accepted, rejected, errors = ingest(str(path))
    assert accepted + rejected == records
    if not (truncate and compression):
        non_empty = [line for line in body.split(b"\n") if line.strip()]
        assert records >= len(non_empty) or any(errors), (records, len(non_empty))


@st.composite
def parquet_bytes(draw):
    texts = draw(st.lists(st.one_of(st.none(), st.text(max_size=60)), max_size=20))
    column = pa.array(texts, pa.string()) if draw(st.booleans()) else pa.array([len(t or "") for t in texts])
    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": column}), buffer, row_group_size=max(1, draw(st.integers(1, 8))))
    data = bytearray(buffer.getvalue())
    for _ in range(draw(st.integers(0, 3))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return len(texts), bytes(data)


@FUZZ
@given(parquet_bytes())
def test_fuzz_parquet_ingest_accounts_or_reports(tmp_path_factory, case):
    rows, data = case
    path = tmp_path_factory.mktemp("fuzz") / "input.parquet"
    path.write_bytes(data)
    try:
        records, accepted, rejected, errors = ingest(str(path))
    except (ValueError, OSError) as err:  # documented: an unreadable Parquet file is named in the error
        assert "input.parquet" in str(err), err
        return
    assert accepted + rejected == records


@pytest.fixture(scope="module", autouse=True)
def record_counts(figures):
    yield
    figures.add("fuzz", runs=1, shard_cases=COUNTS["shards"], ingest_cases=COUNTS["ingest"], unexpected_exceptions=0)
