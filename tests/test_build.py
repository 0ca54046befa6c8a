"""End-to-end `shardkit build`: determinism across workers, accounting of bad input, formats, S3."""

from __future__ import annotations

import gzip
import json
import logging
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import shared_path
from shardkit.cli import main
from shardkit.formats import ShardReader
from shardkit.manifest import MANIFEST_NAME, load_manifest
from shardkit.storage import Storage
from shardkit.text.tokenizers import load_tokenizer
from shardkit.tools.build import BuildConfig, BuildInputError, parse_compression, parse_size, run_build

WORDS = "the of and a to in is was he for it with as his on be at by had are but from or".split()


def write_corpus(directory, *, bad=True, docs=400, seed=0):
    """A small mixed corpus: jsonl, jsonl.gz, jsonl.zst, parquet and txt; a few bad records."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)

    def doc():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 400)))

    records = [json.dumps({"text": doc(), "id": i}) for i in range(docs)]
    if bad:
        records[5] = '{"text": "unterminated'
        records[17] = json.dumps({"content": "wrong field"})
        records[30] = json.dumps({"text": ""})
    plain = "\n".join(records[: docs // 3]) + "\n"
    (directory / "a.jsonl").write_text(plain)
    (directory / "b.jsonl.gz").write_bytes(gzip.compress(("\n".join(records[docs // 3: 2 * docs // 3]) + "\n").encode()))
    tail = ("\n".join(records[2 * docs // 3:]) + "\n").encode()
    if bad:
        tail += b'{"text": "bad \xff byte"}\n'
    (directory / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(tail))
    pq.write_table(pa.table({"text": [doc() for _ in range(50)]}), directory / "d.parquet", row_group_size=16)
    (directory / "e.txt").write_text("\n\n".join(doc() for _ in range(5)))
    return directory


def config(inputs, output, **overrides):
    base = dict(inputs=tuple(map(str, inputs)), output=str(output), tokenizer="byte", seq_len=64,
                shard_size=20_000, unit_bytes=4096, progress=False, workers=1)
    base.update(overrides)
    return BuildConfig(**base)


def read_samples(url, storage_options=None):
    manifest = load_manifest(url, storage_options)
    storage = Storage(url, storage_options)
    samples = []
    for shard in manifest.shards:
        reader = ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard, manifest=manifest)
        samples += [reader.sample(i) for i in range(len(reader))]
    return manifest, samples


def documents_from_samples(samples):
    """Reassemble documents from sample segments: (source, index) -> tokens."""
    docs: dict = {}
    for s in samples:
        ends = [*s.doc_starts[1:].tolist(), len(s.tokens)]
        for a, b, src, idx in zip(s.doc_starts.tolist(), ends, s.doc_source.tolist(), s.doc_index.tolist()):
            if src >= 0:
                docs.setdefault((src, idx), []).extend(s.tokens[a:b].tolist())
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "in")


def test_parse_size_and_compression():
    assert parse_size("64MB") == 64_000_000 and parse_size("64MiB") == 64 * 2**20 and parse_size("1000") == 1000
    assert parse_size("1.5k") == 1536
    with pytest.raises(ValueError, match="--shard-size"):
        parse_size("lots", option="--shard-size")
    assert parse_compression("zstd") == 3 and parse_compression("zstd:19") == 19
    with pytest.raises(ValueError, match="--compression"):
        parse_compression("gzip")


@pytest.mark.slow
def test_same_shards_for_1_2_4_workers(corpus, tmp_path):
    manifests = []
    for workers in (1, 2, 4):
        result = run_build(config([corpus], tmp_path / f"w{workers}", workers=workers))
        manifests.append((tmp_path / f"w{workers}" / MANIFEST_NAME).read_bytes())
        assert len(result.manifest.shards) > 3
    assert manifests[0] == manifests[1] == manifests[2]  # same shard sha256s, counts, everything


def test_documents_survive_packing_with_provenance(corpus, tmp_path):
    out = tmp_path / "ds"
    result = run_build(config([corpus], out))
    manifest, samples = read_samples(str(out))
    assert manifest.sources == tuple(str(corpus / n) for n in
                                     ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.txt"))
    assert all(len(s.tokens) == 65 for s in samples) and manifest.sample_length == 65
    docs = documents_from_samples(samples)
    # every accepted document comes back whole, in order, followed by EOS
    tok = load_tokenizer("byte")
    lines = (corpus / "a.jsonl").read_text().splitlines()
    for line_no in (0, 1, 6, len(lines) - 1):
        want = tok.encode(json.loads(lines[line_no])["text"]).tolist() + [256]
        assert docs[(0, line_no)] == want
    assert (0, 5) not in docs and (0, 17) not in docs and (0, 30) not in docs
    table = pq.read_table(corpus / "d.parquet")
    assert docs[(3, 20)] == tok.encode(table.column("text")[20].as_py()).tolist() + [256]
    assert docs[(4, 0)][:-1] == tok.encode((corpus / "e.txt").read_text()).tolist()
    report = result.report
    counted = report["documents"]
    assert counted["in"] == 400 + 1 + 50 + 1 and counted["rejected"] == 4
    assert counted["in"] == counted["written"] + counted["rejected"] and counted["balanced"]
    assert counted["written"] == len(docs)
    assert counted["rejected_by_reason"] == {"malformed JSON": 1, "no 'text' field": 1, "empty document": 1,
                                             "invalid UTF-8": 1}
    where = {(e["file"].rsplit("/", 1)[-1], e["line"]): e["reason"] for e in counted["examples"]}
    assert where[("a.jsonl", 6)].startswith("malformed JSON")
    assert ("c.jsonl.zst", 135) in where  # the appended bad-UTF-8 line: 134 good lines before it
    assert json.loads((out / "build_report.json").read_text())["documents"] == counted
    assert manifest.build["documents"] == {"in": counted["in"], "written": counted["written"], "rejected": 4}
    assert "seconds" not in json.dumps(manifest.build) and not (out / "_build").exists()


def test_cli_skip_prints_summary_and_fail_exits_nonzero(corpus, tmp_path, capsys):
    args = [str(corpus / "a.jsonl"), "--tokenizer", "byte", "--seq-len", "32", "--workers", "1", "--no-progress"]
    assert main(["build", *args, "--output", str(tmp_path / "skip")]) == 0
    err = capsys.readouterr().err
    assert "documents rejected  3" in err and "a.jsonl line 6: malformed JSON" in err and "(holds)" in err
    assert main(["build", *args, "--output", str(tmp_path / "fail"), "--on-error", "fail"]) == 1
    err = capsys.readouterr().err
    assert "a.jsonl: line 6: malformed JSON" in err and "--on-error fail" in err
    assert not (tmp_path / "fail" / MANIFEST_NAME).exists()
    # the same command again finds the finished build and does nothing
    assert main(["build", *args, "--output", str(tmp_path / "skip")]) == 0
    assert "already holds this build" in capsys.readouterr().err


def test_other_build_is_refused_unless_overwrite(corpus, tmp_path, caplog):
    out = tmp_path / "ds"
    run_build(config([corpus / "a.jsonl"], out))
    with pytest.raises(FileExistsError, match=r"different configuration \(differs in: seq_len\).*--overwrite"):
        run_build(config([corpus / "a.jsonl"], out, seq_len=32))
    with caplog.at_level(logging.WARNING, logger="shardkit.tools.state"):
        result = run_build(config([corpus / "a.jsonl"], out, seq_len=32, overwrite=True))
    assert load_manifest(str(out)).seq_len == 32 and result.status == "built"
    assert "did not write" not in caplog.text  # the manifest's companions (shardkit.blocks) are shardkit's own
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        run_build(config([corpus / "a.jsonl"], foreign))


def test_fail_mode_raises_with_file_and_line(corpus, tmp_path):
    with pytest.raises(BuildInputError, match=r"c\.jsonl\.zst: line 135: invalid UTF-8"):
        run_build(config([corpus / "c.jsonl.zst"], tmp_path / "x", on_error="fail"))


def test_truncated_input_is_reported(tmp_path):
    rng = np.random.default_rng(1)
    text = "".join(json.dumps({"text": f"doc {i} {rng.integers(0, 10**12, 6)}"}) + "\n" for i in range(20000))
    blob = zstandard.ZstdCompressor().compress(text.encode())
    (tmp_path / "cut.jsonl.zst").write_bytes(blob[: len(blob) * 2 // 3])
    result = run_build(config([tmp_path / "cut.jsonl.zst"], tmp_path / "out", unit_bytes=1 << 16))
    report = result.report
    assert len(report["file_errors"]) == 1 and "truncated" in report["file_errors"][0]["reason"]
    docs = report["documents"]
    assert 0 < docs["written"] < 20000 and docs["in"] == docs["written"] + docs["rejected"]


def test_corrupt_gzip_and_parquet_are_unreadable_files(corpus, tmp_path):
    (tmp_path / "broken.jsonl.gz").write_bytes(b"this is not gzip data at all")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 nonsense")
    inputs = [tmp_path / "broken.jsonl.gz", tmp_path / "broken.parquet", corpus / "a.jsonl"]
    result = run_build(config(inputs, tmp_path / "out"))
    errors = {e["file"].rsplit("/", 1)[-1]: e["reason"] for e in result.report["file_errors"]}
    assert set(errors) == {"broken.jsonl.gz", "broken.parquet"}
    assert "gzip" in errors["broken.jsonl.gz"].lower()
    with pytest.raises(BuildInputError, match=r"broken\.jsonl\.gz: read failed"):
        run_build(config(inputs, tmp_path / "fail", on_error="fail"))


@pytest.mark.parametrize("shard_format, packing", [("arrow", "bestfit"), ("tar", "none"), ("arrow", "concat")])
def test_formats_and_packings(corpus, tmp_path, shard_format, packing):
    out = tmp_path / "ds"
    result = run_build(config([corpus / "a.jsonl", corpus / "d.parquet"], out, shard_format=shard_format,
                              packing=packing, compression_level=9))
    manifest, samples = read_samples(str(out))
    assert manifest.shard_format == shard_format and manifest.packing == packing
    assert manifest.compression == {"codec": "zstd", "level": 9}
    lengths = {len(s.tokens) for s in samples}
    if packing == "none":
        assert manifest.seq_len is None and max(lengths) <= 65 and len(lengths) > 1
    else:
        assert lengths == {65}
    docs = documents_from_samples(samples)
    assert len(docs) == result.report["documents"]["written"]
    tok = load_tokenizer("byte")
    first = json.loads((corpus / "a.jsonl").read_text().splitlines()[0])["text"]
    assert docs[(0, 0)] == tok.encode(first).tolist() + [256]


def test_txt_paragraphs_and_bos(tmp_path):
    (tmp_path / "book.txt").write_text("One para.\n\nTwo\nlines.\n\n\n\nThree.")
    out = tmp_path / "ds"
    run_build(config([tmp_path / "book.txt"], out, txt_mode="paragraph", bos_id="auto", packing="none"))
    manifest, samples = read_samples(str(out))
    texts = [bytes(t for t in s.tokens.tolist() if t < 256).decode() for s in samples]
    assert texts == ["One para.", "Two\nlines.", "Three."]
    assert all(s.tokens[0] == 257 and s.tokens[-1] == 256 for s in samples)
    assert manifest.tokenizer.bos_id == 257


@pytest.mark.s3
def test_build_to_s3(corpus, tmp_path, s3_bucket, capsys):
    url, options = s3_bucket
    result = run_build(config([corpus / "a.jsonl"], url, storage_options=options))
    local = run_build(config([corpus / "a.jsonl"], tmp_path / "local"))
    # the CLI, with the options as --storage-option, finds the same finished build
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in options.items()]
    assert main(["build", str(corpus / "a.jsonl"), "--output", url, "--tokenizer", "byte", "--seq-len", "64",
                 "--shard-size", "20000", "--unit-size", "4096", *flags]) == 0
    assert "already holds this build" in capsys.readouterr().err
    manifest, samples = read_samples(url, options)
    assert [s.sha256 for s in manifest.shards] == [s.sha256 for s in local.manifest.shards]
    assert len(samples) == result.manifest.num_samples
    storage = Storage(url, options)
    assert storage.exists("build_report.json") and not storage.exists("_build/checkpoint.npz")
    # inputs on S3 too (a glob over the bucket): same samples as from the local file
    bucket = url.split("/")[2]
    Storage(f"s3://{bucket}/raw", options).write_bytes("a.jsonl", (corpus / "a.jsonl").read_bytes())
    remote = run_build(config([f"s3://{bucket}/raw/*.jsonl"], tmp_path / "from-s3", storage_options=options))
    assert remote.manifest.sources == (f"s3://{bucket}/raw/a.jsonl",)
    assert [s.sha256 for s in remote.manifest.shards] == [s.sha256 for s in local.manifest.shards]


@pytest.mark.shared
@pytest.mark.slow
def test_real_prose_with_gpt2(tmp_path):
    """A slice of real text, GPT-2 tokenizer: documents round-trip and bestfit padding stays under 2%."""
    corpus = shared_path("corpora/prose.jsonl.zst")
    tokenizer = shared_path("tokenizers/r50k_base.tiktoken")
    with zstandard.ZstdDecompressor().stream_reader(open(corpus, "rb")) as reader:
        head = reader.read(3_000_000)
    (tmp_path / "prose.jsonl").write_bytes(head[: head.rfind(b"\n") + 1])
    result = run_build(config([tmp_path / "prose.jsonl"], tmp_path / "ds", tokenizer=str(tokenizer), seq_len=1024,
                              packing="bestfit", shard_size=1_000_000, unit_bytes=1 << 18, workers=2))
    assert result.report["packing"]["padding_fraction"] < 0.02
    manifest, samples = read_samples(str(tmp_path / "ds"))
    assert manifest.tokenizer.eos_id == 50256 and manifest.token_dtype == "uint16"
    docs = documents_from_samples(samples)
    tok = load_tokenizer(str(tokenizer))
    first = json.loads((tmp_path / "prose.jsonl").read_text().splitlines()[0])["text"]
    assert docs[(0, 0)] == tok.encode(first).tolist() + [50256]


def test_nothing_accepted_is_an_error_naming_the_reasons(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"none of the 2 input documents") as caught:
        run_build(config([tmp_path / "bad.jsonl"], tmp_path / "out"))
    assert "malformed JSON: 1" in str(caught.value) and "'text' is int, not a string: 1" in str(caught.value)
