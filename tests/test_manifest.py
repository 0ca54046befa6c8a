"""The manifest: JSON round trip and determinism, validation, name safety, and atomic publication."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import FrozenInstanceError

import pytest

from shardkit.errors import ManifestError, UnsafeNameError
from shardkit.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    TokenizerInfo,
    check_counts,
    load_manifest,
    token_dtype_for_vocab,
    write_manifest,
)
from shardkit.storage import Storage


def shard(name: str, samples: int = 4, tokens: int = 260, **changes) -> ShardInfo:
    fields = dict(name=name, samples=samples, tokens=tokens, compressed_bytes=1000, raw_bytes=2000,
                  sha256=hashlib.sha256(name.encode()).hexdigest(), has_doc_boundaries=True)
    return ShardInfo(**{**fields, **changes})


def manifest(**changes) -> Manifest:
    fields = dict(shard_format="tar", token_dtype="uint16", seq_len=64, packing="concat",
                  tokenizer=TokenizerInfo(kind="hf", name="tok/tokenizer.json", vocab_size=50257, eos_id=50256,
                                          special_ids={"<|pad|>": 3}, vocab_sha256="ab" * 32),
                  shards=(shard("a/shard-000000.tar"), shard("a/shard-000001.tar", samples=2, tokens=130)),
                  sources=("web.jsonl.zst", "books.parquet"), build={"seed": 7, "inputs": ["x", "y"]})
    return Manifest(**{**fields, **changes})


def manifest_dict(**changes) -> dict:
    data = json.loads(manifest().to_json())
    data.update(changes)
    return data


def test_json_round_trip_is_exact_and_deterministic():
    m = manifest()
    text = m.to_json()
    assert Manifest.from_json(text) == m
    assert Manifest.from_json(text.encode()).to_json() == text  # bytes in, same bytes out
    # Same content built in a different dict order gives the same bytes (sorted keys).
    shuffled = manifest(build={"inputs": ["x", "y"], "seed": 7})
    assert shuffled.to_json() == text
    data = json.loads(text)
    assert data["format"] == "shardkit" and data["hash"] == "sha256"
    assert data["totals"] == {"shards": 2, "samples": 6, "tokens": 390, "compressed_bytes": 2000, "raw_bytes": 4000}
    assert data["max_sample_tokens"] == 65 and m.sample_length == 65


def test_variable_seq_len_round_trips_as_the_string_variable():
    m = manifest(seq_len=None, packing="none", max_sample_tokens=4096)
    data = json.loads(m.to_json())
    assert data["seq_len"] == "variable"
    back = Manifest.from_json(m.to_json())
    assert back.seq_len is None and back.sample_length is None and back.max_sample_tokens == 4096


def test_token_dtype_for_vocab_boundaries():
    assert token_dtype_for_vocab(256) == "uint16"
    assert token_dtype_for_vocab(65536) == "uint16"
    assert token_dtype_for_vocab(65537) == "uint32"
    assert token_dtype_for_vocab(1) == "uint16"
    assert token_dtype_for_vocab(2**32) == "uint32"
    with pytest.raises(ValueError, match="positive"):
        token_dtype_for_vocab(0)
    with pytest.raises(ValueError, match="uint32"):
        token_dtype_for_vocab(2**32 + 1)


def test_fields_at_their_limits_are_accepted():
    """Each check refuses exactly what lies past its limit: a bound off by one refuses real datasets."""
    assert TokenizerInfo(kind="byte", name="one", vocab_size=1, eos_id=0, bos_id=0, pad_id=0).vocab_size == 1
    assert manifest(tokenizer=TokenizerInfo(kind="hf", name="t", vocab_size=2**16), token_dtype="uint16").seq_len == 64
    assert manifest(seq_len=1, max_sample_tokens=None).max_sample_tokens == 2
    empty = shard("empty.tar", samples=0, tokens=0, compressed_bytes=0, raw_bytes=0, index_offset=0, index_bytes=0,
                  index_sha256="0" * 64)
    assert empty.has_block_index and empty.samples == 0
    with pytest.raises(ManifestError, match="vocab_size must be positive"):
        TokenizerInfo(kind="byte", name="none", vocab_size=0)
    with pytest.raises(ManifestError, match="needs uint32"):
        manifest(tokenizer=TokenizerInfo(kind="hf", name="t", vocab_size=2**16 + 1), token_dtype="uint16")
    with pytest.raises(ManifestError, match="index_offset, index_bytes and index_sha256"):
        shard("s.tar", index_offset=-1, index_bytes=10, index_sha256="0" * 64)


def test_format_version_packing_and_writer_version_are_derived_only_when_not_given():
    assert manifest().format_version == 1 and manifest().to_json().count("index_") == 0  # no index fields in v1
    assert shard("s.tar").to_dict().keys().isdisjoint({"index_offset", "index_bytes", "index_sha256"})
    indexed = shard("i.tar", index_offset=10, index_bytes=5, index_sha256="0" * 64)
    # tar shards with block indexes are written in the group layout, which readers of version 2 do not parse
    assert manifest(shards=(shard("s.tar"), indexed)).format_version == 3
    assert manifest(shard_format="arrow", shards=(shard("s.arrow"), indexed)).format_version == 2
    assert manifest(shards=(shard("s.tar"), indexed), format_version=2).format_version == 2  # per-sample layout
    assert manifest(shardkit_version="0.0.1").shardkit_version == "0.0.1"  # a read manifest keeps its writer's
    # "none" packing has a seq_len (documents are split there) but no fixed sample length
    assert manifest(packing="none").sample_length is None
    assert manifest(seq_len=None, packing="none", max_sample_tokens=None).max_sample_tokens is None
    for bad in ("ab", (shard("s.tar"), {"name": "t.tar"})):
        with pytest.raises(ManifestError, match="shards must be a list of shard entries"):
            manifest(shards=bad)


def test_config_dataclasses_are_frozen_and_keyword_only():
    for value in (manifest(), manifest().tokenizer, manifest().shards[0]):
        with pytest.raises(FrozenInstanceError):
            value.name = "x"
    tokenizer = TokenizerInfo(kind="byte", name="byte", vocab_size=256)
    for cls, arguments in ((TokenizerInfo, ("byte", "byte", 256)), (ShardInfo, ("s.tar", 0, 0, 0, 0, "0" * 64, False)),
                           (Manifest, ("tar", "uint16", 64, "concat", tokenizer, ()))):
        with pytest.raises(TypeError, match="positional"):
            cls(*arguments)


def _one_shard(shard_format="tar", token_dtype="uint16", max_sample_tokens=None, **fields):
    info = {"samples": 0, "tokens": 0, "compressed_bytes": 1, "raw_bytes": 0, **fields}
    return manifest(shard_format=shard_format, token_dtype=token_dtype, seq_len=None, packing="none",
                    max_sample_tokens=max_sample_tokens, shards=(shard("s.tar", **info),))


@pytest.mark.parametrize(("at_limit", "over", "match"), [
    (dict(compressed_bytes=2**40), dict(compressed_bytes=2**40 + 1), "compressed_bytes above"),
    (dict(raw_bytes=32768), dict(raw_bytes=32769), "raw_bytes more than 32,768 x"),
    (dict(raw_bytes=10, tokens=5), dict(raw_bytes=10, tokens=6), "more uint16 tokens"),
    (dict(token_dtype="uint32", raw_bytes=12, tokens=3), dict(token_dtype="uint32", raw_bytes=12, tokens=4),
     "more uint32 tokens"),
    (dict(raw_bytes=80, samples=10), dict(raw_bytes=80, samples=11), "raw_bytes / 8"),
    (dict(shard_format="arrow", raw_bytes=40, samples=10), dict(shard_format="arrow", raw_bytes=40, samples=11),
     "raw_bytes / 4"),
    (dict(max_sample_tokens=10, samples=2, tokens=20, raw_bytes=200),
     dict(max_sample_tokens=10, samples=2, tokens=21, raw_bytes=200), "more tokens than samples x max_sample_tokens"),
])
def test_count_bounds_refuse_exactly_what_lies_past_them(at_limit, over, match):
    check_counts(_one_shard(**at_limit), source="m")
    with pytest.raises(ManifestError, match=f"m: shard s.tar declares .*{match}"):
        check_counts(_one_shard(**over), source="m")


def test_totals_above_2_to_the_62_are_refused():
    # A shard may hold 2^55 raw bytes (2^40 stored x zstd's ratio): 128 of them reach 2^62 exactly.
    def shards(n):
        return tuple(shard(f"s{i}.tar", samples=0, tokens=0, compressed_bytes=2**40, raw_bytes=2**55) for i in range(n))
    check_counts(manifest(shards=shards(128), seq_len=None, packing="none", max_sample_tokens=None), source="m")
    with pytest.raises(ManifestError, match="more than 2\\^62 raw_bytes in total"):
        check_counts(manifest(shards=shards(200), seq_len=None, packing="none", max_sample_tokens=None), source="m")


@pytest.mark.parametrize(("changes", "match"), [
    ({"token_dtype": "int8"}, "token_dtype must be one of"),
    ({"shard_format": "zip"}, "shard_format must be one of"),
    ({"packing": "random"}, "packing must be one of"),
    ({"seq_len": 0}, "seq_len must be a positive integer or variable, got 0"),
    ({"seq_len": 2048.5}, "seq_len must be a positive integer or variable, got 2048.5"),
    ({"seq_len": "2048"}, "seq_len must be a positive integer"),
    ({"seq_len": True}, "seq_len must be a positive integer"),
    ({"max_sample_tokens": -3}, "max_sample_tokens must be a positive integer, got -3"),
    ({"format_version": 99}, "written by a newer shardkit \\(format 99"),
    ({"format_version": 0}, "format_version 0 is not supported.*corrupt or was edited"),
    ({"token_dtype": "uint16", "tokenizer": TokenizerInfo(kind="hf", name="big", vocab_size=200_000)}, "needs uint32"),
])
def test_invalid_fields_are_rejected_naming_the_field(changes, match):
    with pytest.raises(ManifestError, match=match):
        manifest(**changes)


def test_duplicate_shard_names_and_reserved_name_are_rejected():
    with pytest.raises(ManifestError, match="same shard twice"):
        manifest(shards=(shard("s.tar"), shard("s.tar")))
    with pytest.raises(ManifestError, match=MANIFEST_NAME):
        manifest(shards=(shard(MANIFEST_NAME),))


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/../../b", "../evil.tar", "/etc/passwd", "a//b", "./a", "a/",
                                 "C:/x", "s3://bucket/x", "a\\..\\b", "a\x00b", ""])
def test_unsafe_shard_names_are_rejected(bad):
    with pytest.raises(UnsafeNameError):
        shard(bad)
    data = manifest_dict()
    data["shards"][0]["name"] = bad
    with pytest.raises(ManifestError, match="unsafe|non-empty"):
        Manifest.from_dict(data)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("samples", -1, "samples must be a non-negative integer"),
    ("tokens", True, "tokens must be a non-negative integer"),
    ("raw_bytes", 1.5, "raw_bytes must be a non-negative integer"),
    ("sha256", "ABC", "sha256 must be 64 lowercase hex digits"),
])
def test_bad_shard_fields_name_the_shard(field, value, match):
    with pytest.raises(ManifestError, match=f"a/shard-000000.tar: {match}"):
        shard("a/shard-000000.tar", **{field: value})


def test_tokenizer_special_ids_must_lie_inside_the_vocabulary():
    with pytest.raises(ManifestError, match="eos_id=300"):
        TokenizerInfo(kind="byte", name="byte", vocab_size=256, eos_id=300)
    with pytest.raises(ManifestError, match="<x>=256"):
        TokenizerInfo(kind="byte", name="byte", vocab_size=256, special_ids={"<x>": 256})


def test_totals_mismatch_is_rejected():
    data = manifest_dict()
    data["totals"]["tokens"] += 1
    with pytest.raises(ManifestError, match="totals .* do not match the sum over shards"):
        Manifest.from_dict(data, source="mem/shardkit.json")


@pytest.mark.parametrize("missing", ["shards", "token_dtype", "tokenizer", "seq_len", "packing", "format_version"])
def test_missing_fields_are_reported(missing):
    data = manifest_dict()
    del data[missing]
    with pytest.raises(ManifestError, match=f"mem/shardkit.json: malformed manifest .*{missing}"):
        Manifest.from_dict(data, source="mem/shardkit.json")


@pytest.mark.parametrize(("text", "match"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"format": "other"}), "not a shardkit manifest"),
])
def test_garbage_is_rejected(text, match):
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(text)


def test_unsupported_hash_and_codec_are_rejected():
    with pytest.raises(ManifestError, match="unsupported hash"):
        Manifest.from_dict(manifest_dict(hash="md5"))
    with pytest.raises(ManifestError, match="unsupported compression"):
        Manifest.from_dict(manifest_dict(compression={"codec": "gzip"}))
    data = manifest_dict()
    data["shards"][0]["color"] = "blue"  # an unknown field is an error, not silently dropped
    with pytest.raises(ManifestError, match="color"):
        Manifest.from_dict(data)


def future_manifest(version: int) -> dict:
    """A manifest as a later shardkit might write it: a higher version, and shard entries with a field this
    one does not know (which alone it would call malformed)."""
    data = manifest_dict(format_version=version)
    for entry in data["shards"]:
        entry["layout"] = "something-new"
    return data


def test_a_later_format_version_is_refused_as_newer_naming_the_manifest_never_as_corrupt(tmp_path):
    from shardkit.manifest import FORMAT_VERSIONS
    from shardkit.shard_columns import encode_index

    newer = max(FORMAT_VERSIONS) + 1
    url = tmp_path / "ds"
    url.mkdir()
    text = json.dumps(future_manifest(newer)).encode()
    (url / MANIFEST_NAME).write_bytes(text)
    expected = (rf"^{url / MANIFEST_NAME}: written by a newer shardkit \(format {newer}; this shardkit reads "
                rf"formats 1, 2, 3\); upgrade shardkit$")
    with pytest.raises(ManifestError, match=expected):
        load_manifest(str(url))
    # the binary index of a large dataset says the same (its header carries the version)
    header = {k: v for k, v in json.loads(text).items() if k != "shards"}
    (url / "shardkit.index").write_bytes(encode_index(header, manifest().columns, json_bytes=text))
    with pytest.raises(ManifestError, match=expected):
        load_manifest(str(url))
    # what users run: exit 2, one line, the same words; never "corrupt"
    for command in ("inspect", "verify"):
        result = subprocess.run([sys.executable, "-m", "shardkit", command, str(url)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2, result.stderr
        assert f"written by a newer shardkit (format {newer}" in result.stderr and "upgrade shardkit" in result.stderr
        assert "corrupt" not in result.stderr and "Traceback" not in result.stderr


def test_old_manifests_keep_their_version_when_read(tmp_path):
    """Versions 1 and 2 (written before version 3 existed) read as they are and are rewritten as they were."""
    for version in (1, 2):
        data = manifest_dict(format_version=version)
        if version == 2:
            data["shards"][0].update(index_offset=10, index_bytes=5, index_sha256="0" * 64)
        loaded = Manifest.from_dict(data)
        assert loaded.format_version == version and json.loads(loaded.to_json())["format_version"] == version


def test_load_manifest_rejects_escaping_names_written_by_hand(tmp_path):
    for bad in ("../evil.tar", "/etc/passwd"):
        data = manifest_dict()
        data["shards"][1]["name"] = bad
        (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
        with pytest.raises(ManifestError, match="unsafe shard name"):
            load_manifest(str(tmp_path))


def test_load_manifest_of_missing_dataset_says_so(tmp_path):
    with pytest.raises(ManifestError, match="no dataset at .*shardkit.json not found"):
        load_manifest(str(tmp_path / "nothing"))
    # a local copy of a remote dataset names the remote dataset
    with pytest.raises(ManifestError, match="^no dataset at s3://bucket/ds: shardkit.json not found"):
        load_manifest(str(tmp_path / "nothing"), display_url="s3://bucket/ds/shardkit.json")


def test_write_then_load_through_storage(tmp_path):
    m = manifest()
    storage = Storage(str(tmp_path / "ds"))
    write_manifest(storage, m)
    assert load_manifest(str(tmp_path / "ds")) == m
    assert (tmp_path / "ds" / MANIFEST_NAME).read_text() == m.to_json()
    assert sorted(os.listdir(tmp_path / "ds")) == [MANIFEST_NAME]  # no temporary file left behind


# -- atomicity: real writer processes killed with SIGKILL --------------------------------------------

WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from shardkit.formats import ShardWriter
    from shardkit.manifest import Manifest, TokenizerInfo, write_manifest

    url, start = sys.argv[1], int(sys.argv[2])
    with ShardWriter(url, shard_format="tar", max_samples=8, start_index=start) as writer:
        for i in range(24):
            writer.write(np.full(65, i + start, dtype=np.uint16))
    manifest = Manifest(shard_format="tar", token_dtype="uint16", seq_len=64, packing="concat",
                        tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=65536), shards=writer.shards)
    print("shards-written", flush=True)
    sys.stdin.readline()  # the parent kills us here, between the last shard and the manifest
    write_manifest(writer.storage, manifest)
""")


def run_writer_until_killed(url: str, start: int) -> None:
    child = subprocess.Popen([sys.executable, "-c", WRITER, url, str(start)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "shards-written"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.slow
def test_writer_killed_before_manifest_leaves_no_manifest(tmp_path):
    url = str(tmp_path / "ds")
    run_writer_until_killed(url, start=0)
    assert sorted(os.listdir(url)) == [f"shard-{i:06d}.tar" for i in range(3)]  # the shards are there...
    with pytest.raises(ManifestError, match="not found"):  # ...but no reader sees a dataset
        load_manifest(url)


@pytest.mark.slow
def test_writer_killed_before_manifest_keeps_the_previous_manifest(tmp_path):
    from shardkit.verify import verify_dataset

    url = str(tmp_path / "ds")
    previous = manifest(shards=(), sources=())
    write_manifest(Storage(url), previous)
    before = (tmp_path / "ds" / MANIFEST_NAME).read_bytes()
    run_writer_until_killed(url, start=0)
    assert (tmp_path / "ds" / MANIFEST_NAME).read_bytes() == before
    assert load_manifest(url) == previous and verify_dataset(Storage(url), previous) == []


MANIFEST_LOOP = textwrap.dedent("""
    import sys
    from shardkit.manifest import Manifest, ShardInfo, TokenizerInfo, write_manifest
    from shardkit.storage import Storage

    storage = Storage(sys.argv[1])
    shards = [ShardInfo(name=f"shard-{i:06d}.tar", samples=1, tokens=65, compressed_bytes=10240, raw_bytes=258,
                        sha256="0" * 64, has_doc_boundaries=False) for i in range(20000)]
    version = 0
    while True:  # rewrite a ~4 MB manifest forever; the parent kills us at a random moment
        write_manifest(storage, Manifest(shard_format="tar", token_dtype="uint16", seq_len=64, packing="concat",
                                         tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=256),
                                         shards=shards, build={"version": version}))
        if version == 0:
            print("first", flush=True)
        version += 1
""")


@pytest.mark.slow
def test_manifest_killed_mid_write_is_old_or_new_never_partial(tmp_path):
    url = str(tmp_path / "ds")
    delays = [0.0, 0.013, 0.029, 0.047, 0.071, 0.11]
    for delay in delays:
        child = subprocess.Popen([sys.executable, "-c", MANIFEST_LOOP, url], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "first"
            time.sleep(delay)
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
        loaded = load_manifest(url)  # parses completely: old or new, never a torn file
        assert loaded.num_samples == 20000 and isinstance(loaded.build["version"], int)


def test_json_seq_len_is_never_silently_truncated():
    with pytest.raises(ManifestError, match="seq_len must be a positive integer or variable, got 2048.5"):
        Manifest.from_dict(manifest_dict(seq_len=2048.5))


@pytest.mark.parametrize(("changes", "match"), [
    ({"compression": "zstd"}, "compression must be a JSON object"),
    ({"build": [1]}, "build must be a JSON object"),
    ({"sources": "abc"}, "sources must be a list of strings"),
    ({"sources": [1, 2]}, "sources must be a list of strings"),
    ({"shards": {"a": 1}}, "malformed manifest|shards must be a list"),
    ({"tokenizer": "x"}, "malformed manifest"),
])
def test_wrongly_shaped_json_fields_are_manifest_errors(changes, match):
    with pytest.raises(ManifestError, match=match):
        Manifest.from_dict(manifest_dict(**changes))


def test_nesting_of_64_levels_is_accepted_and_65_refused():
    def nested(depth):  # the manifest object itself is level 1
        return json.dumps(manifest_dict())[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}"
    assert Manifest.from_json(nested(63)) == manifest()
    with pytest.raises(ManifestError, match="more than 64 levels"):
        Manifest.from_json(nested(64))


@pytest.mark.parametrize("depth, match", [(5000, "nested too deeply"), (200, "more than 64 levels")])
def test_deeply_nested_manifest_is_a_manifest_error_not_a_traceback(tmp_path, depth, match):
    """Thousands of levels overflow json's recursive decoder; a few hundred parse but would overflow
    later recursive walks. Both are a one-line error from `verify`."""
    data = manifest_dict()
    text = json.dumps(data)[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}"
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError, match=match):
        load_manifest(str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "shardkit", "verify", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and match in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("tokens", [261, 325])
def test_packed_shards_must_hold_samples_times_sample_length_tokens(tokens):
    # 261: one token past 4 x 65 (not a multiple); 325: five samples' worth declared as four
    with pytest.raises(ManifestError, match="tokens != samples x 65"):
        check_counts(manifest(shards=(shard("s.tar", samples=4, tokens=tokens),)), source="m")


def test_the_first_offending_shard_is_named():
    # shard 0 breaks a later rule (tokens) than shard 1 (size): the error still names shard 0
    shards = (shard("first.tar", tokens=1040, samples=16, raw_bytes=2000), shard("second.tar", compressed_bytes=2**41))
    with pytest.raises(ManifestError, match="shard first.tar declares .*more uint16 tokens"):
        check_counts(manifest(shards=shards), source="m")
