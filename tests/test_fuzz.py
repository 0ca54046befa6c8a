"""Bounded fuzzing (hypothesis, derandomized so CI is reproducible): the shard decoders and the
JSONL/Parquet ingest, fed mutated and arbitrary bytes, either succeed or raise only their documented
errors (CorruptShardError for shards; for the ingest nothing escapes, and an unreadable file is
reported on its unit). The ingest's accounting is checked against the generator's own count: every
record it wrote is accepted or rejected as its content dictates, and the accepted documents read
back from the output tokens are exactly the texts written, in order. The figures recorded are the
ones the tests counted, as they stood when each test ended."""

from __future__ import annotations

import collections
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


@pytest.fixture
def counted(figures):
    """Counters a fuzz test fills as it runs; recorded as they stand when it ends, failed or not.

    Only what the test counted is recorded: a figure it never measured stays absent (shown as "-"),
    and `unexpected_exceptions` is the number of exceptions it saw escape, not an assumed 0.
    """
    counts: collections.Counter = collections.Counter()
    yield counts
    figures.add("fuzz", **dict(counts))


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
def test_fuzz_decode_shard_raises_only_corrupt_shard_error(counted, case):
    shard_format, token_dtype, data, raw = case
    counted["shard_cases"] += 1
    counted["unexpected_exceptions"] += 0  # measured from here on: the case ran
    try:
        arrays = decode_shard(data, shard_format=shard_format, token_dtype=token_dtype, shard="fuzz", raw_bytes=raw)
        arrays.validate("fuzz")  # whatever decodes is structurally sound
    except CorruptShardError as err:
        assert "fuzz" in str(err)
    except Exception:
        counted["unexpected_exceptions"] += 1
        raise


@FUZZ
@given(st.sampled_from(["tar", "arrow"]), st.binary(max_size=2048), st.integers(0, 10**6))
def test_fuzz_decode_shard_on_arbitrary_bytes(counted, shard_format, data, raw):
    if shard_format == "arrow":
        data = b"ARROW1\0\0" + data  # get past the magic check sometimes
    counted["shard_cases"] += 1
    counted["unexpected_exceptions"] += 0
    try:
        decode_shard(data, shard_format=shard_format, token_dtype="uint16", shard="fuzz", raw_bytes=raw)
    except CorruptShardError:
        pass
    except Exception:
        counted["unexpected_exceptions"] += 1
        raise


# -- ingest -----------------------------------------------------------------------------------------
def ingest(path: str) -> tuple[int, int, int, list[str | None], list[str]]:
    """Run the build's reading and tokenizing stages over one file.

    Returns (records, accepted, rejected, file errors, documents): the first three as the ingest
    counts them; `documents` read back from its output tokens (the byte tokenizer's ids are the
    UTF-8 bytes), which is what the test checks against the records it generated.
    """
    from shardkit.text.documents import DocumentSettings, tokenize_unit
    from shardkit.text.inputs import expand_inputs, iter_units

    files = expand_inputs([path])
    settings_ = DocumentSettings(tokenizer="byte", token_dtype="uint16", eos_id=None, max_doc_chars=5000)
    records = accepted = rejected = 0
    errors, documents = [], []
    for unit in iter_units(files, unit_bytes=512, max_doc_chars=5000):
        result = tokenize_unit(unit, settings_)
        records += result.documents_in
        accepted += len(result.doc_index)
        rejected += len(result.rejected)
        errors.append(result.file_error)
        tokens = np.asarray(result.tokens)
        ends = np.cumsum(result.doc_lengths)
        documents += [bytes(tokens[end - n:end].astype(np.uint8)).decode("utf-8", errors="replace")
                      for n, end in zip(result.doc_lengths, ends)]
        assert int(ends[-1] if len(ends) else 0) == len(tokens), "tokens outside any document"
    return records, accepted, rejected, errors, documents


def check_against_generated(counted, got: tuple, expected: list[str | None], *, complete: bool) -> None:
    """Compare the ingest with what the generator made: `expected` holds, per record written, its
    text if it must be accepted, else None. With `complete` (the file reads to its end) every record
    is accounted and the accepted documents are exactly the expected texts, in order; otherwise
    (a truncated file) what was read is a prefix of them and the file error is reported."""
    records, accepted, rejected, errors, documents = got
    want = [t for t in expected if t is not None]
    found = collections.Counter(documents)
    counted["samples_checked"] += len(expected)
    if complete:
        counted["lost"] += sum((collections.Counter(want) - found).values())
        counted["duplicated"] += sum((found - collections.Counter(want)).values())
        assert documents == want, "the documents read back differ from the accepted records written"
        assert (records, accepted, rejected) == (len(expected), len(want), len(expected) - len(want)), \
            (records, accepted, rejected, len(expected), len(want))
    else:
        assert documents == want[:len(documents)], "a truncated file yielded documents it does not hold"
        assert accepted == len(documents) and accepted + rejected == records
        assert any(errors), "a truncated file read without a reported error"


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
                           lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
                           max_leaves=6)


def _document(value: object) -> str | None:
    """The text a JSON value yields as a record: a string "text" that is not blank, else None."""
    if isinstance(value, dict):
        value = value.get("text")
    return value if isinstance(value, str) and value.strip() else None


@st.composite
def jsonl_bytes(draw):
    """A JSONL body and, per record, the document it must give (None: it must be rejected)."""
    lines, expected = [], []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 4))
        if kind == 0:
            text = draw(st.text(max_size=80))
            lines.append(json.dumps({"text": text}, ensure_ascii=draw(st.booleans())).encode())
            expected.append(_document(text))
        elif kind == 1:
            value = draw(json_values)
            lines.append(json.dumps({"text": value, "other": 1}).encode())
            expected.append(_document(value))
        elif kind == 2:  # never JSON: "#" cannot start a JSON value
            lines.append(b"#" + draw(st.binary(max_size=60)).replace(b"\n", b" "))
            expected.append(None)
        elif kind == 3:
            value = draw(json_values)
            lines.append(json.dumps(value).encode())
            expected.append(_document(value) if isinstance(value, dict) else None)
        else:
            lines.append(b"")
            expected.append(None)
    body = b"\n".join(lines)
    if draw(st.booleans()):
        body += b"\n"
    # A record is a line; a final newline ends the last one instead of starting an empty one.
    pieces = body.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()
    expected = (expected + [None] * len(pieces))[:len(pieces)]
    return body, expected


@FUZZ
@given(jsonl_bytes(), st.sampled_from(["", ".gz", ".zst"]), st.booleans())
def test_fuzz_jsonl_ingest_accounts_for_every_record(tmp_path_factory, counted, case, compression, truncate):
    body, expected = case
    counted["ingest_cases"] += 1
    data = body
    if compression == ".gz":
        data = gzip.compress(body, mtime=0)
    elif compression == ".zst":
        data = zstandard.ZstdCompressor().compress(body)
    truncated = truncate and compression and len(data) > 4
    if truncated:
        data = data[:len(data) // 2]
    path = tmp_path_factory.mktemp("fuzz") / f"input.jsonl{compression}"
    path.write_bytes(data)
    check_against_generated(counted, ingest(str(path)), expected, complete=not truncated)


@st.composite
def parquet_bytes(draw):
    """Parquet bytes, the expected document per row (None: rejected), and whether the bytes are intact."""
    texts = draw(st.lists(st.one_of(st.none(), st.text(max_size=60)), max_size=20))
    strings = draw(st.booleans())
    column = pa.array(texts, pa.string()) if strings else pa.array([len(t or "") for t in texts])
    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": column}), buffer, row_group_size=max(1, draw(st.integers(1, 8))))
    data = bytearray(buffer.getvalue())
    intact = len(data)
    for _ in range(draw(st.integers(0, 3))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
            intact = 0
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    expected = [_document(t) if strings else None for t in texts]
    return expected, bytes(data), intact == len(data) and bytes(data) == buffer.getvalue()


@FUZZ
@given(parquet_bytes())
def test_fuzz_parquet_ingest_accounts_or_reports(tmp_path_factory, counted, case):
    expected, data, intact = case
    counted["ingest_cases"] += 1
    counted["unexpected_exceptions"] += 0
    path = tmp_path_factory.mktemp("fuzz") / "input.parquet"
    path.write_bytes(data)
    try:
        got = ingest(str(path))
    except (ValueError, OSError) as err:  # documented: an unreadable Parquet file is named in the error
        assert not intact, f"an intact Parquet file was refused: {err}"
        assert "input.parquet" in str(err), err
        return
    except Exception:
        counted["unexpected_exceptions"] += 1
        raise
    if intact:
        check_against_generated(counted, got, expected, complete=True)
    else:  # damaged bytes may still decode (pages carry no checksum): only the accounting can be checked
        records, accepted, rejected, _, documents = got
        assert accepted == len(documents) and accepted + rejected == records


def test_invalid_utf8_in_a_parquet_string_column_rejects_that_row(tmp_path):
    """pyarrow reads string pages without validating them: a bad row is rejected like a bad JSONL line
    (same reason, counted, named by file and row in the build report), and only that row."""
    from shardkit.tools.build import BuildConfig, run_build

    column = pa.array([b"ok", b"\x00\x80", None, b"fine"], pa.binary()).view(pa.string())  # row 2: not UTF-8
    path = tmp_path / "input.parquet"
    pq.write_table(pa.table({"text": column}), path)
    records, accepted, rejected, errors, documents = ingest(str(path))
    assert (records, accepted, rejected, documents) == (4, 2, 2, ["ok", "fine"])
    (tmp_path / "input.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\x00\x80"}\n')
    report = run_build(BuildConfig(inputs=(str(path), str(tmp_path / "input.jsonl")), output=str(tmp_path / "out"),
                                   tokenizer="byte", seq_len=16, progress=False, workers=1)).report["documents"]
    assert report["rejected_by_reason"] == {"invalid UTF-8": 2, "'text' is null": 1}
    examples = [(e["file"], e.get("row", e.get("line")), e["reason"]) for e in report["examples"]]
    assert (str(path), 2, "invalid UTF-8 at byte 1: invalid start byte") in examples
    assert (str(tmp_path / "input.jsonl"), 2, "invalid UTF-8 at byte 11: invalid start byte") in examples
