"""`shardkit convert` / `shardkit export`: round trips against the formats' own libraries, bad input, determinism."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from convert_sources import megatron, random_documents, read_megatron, write_megatron
from shardkit.cli import main
from shardkit.tools.build import BuildInputError
from shardkit.tools.convert import ConvertConfig, run_convert
from shardkit.tools.convert.config import ExportConfig
from shardkit.tools.convert.export import run_export
from test_build import documents_from_samples, read_samples

BYTE_VOCAB = 258  # the "byte" tokenizer: ids 0-255, EOS 256, BOS 257


def convert(sources, output, **overrides):
    base = dict(inputs=tuple(map(str, sources)), source_format="megatron", output=str(output), tokenizer="byte",
                seq_len=63, shard_size=20_000, unit_bytes=2048, progress=False, workers=1)
    base.update(overrides)
    return run_convert(ConvertConfig(**base))


def export(dataset, prefix, **overrides):
    return run_export(ExportConfig(dataset=str(dataset), target_format="megatron", output=str(prefix),
                                   progress=False, **overrides))


def assert_documents(output, expected, source=0):
    """Every document of `expected` is in the dataset, token for token, under its index, in order."""
    _, samples = read_samples(str(output))
    found = documents_from_samples(samples)
    assert sorted(k for k in found if k[0] == source) == [(source, i) for i in range(len(expected))]
    for i, tokens in enumerate(expected):
        assert found[(source, i)] == tokens.tolist(), f"document {i}"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A Megatron dataset written by megatron-core: 400 documents, every 25th stored as two sequences."""
    directory = tmp_path_factory.mktemp("megatron")
    documents = random_documents(400)
    write_megatron(directory / "corpus_text_document", documents, split_every=25)
    return directory / "corpus_text_document", documents


@pytest.mark.parametrize("packing", ["concat", "none", "bestfit"])
def test_megatron_round_trip_keeps_every_token_and_document(tmp_path, source, packing):
    prefix, documents = source
    assert [d.tolist() for d in read_megatron(prefix)] == [d.tolist() for d in documents]  # the reference reads it so
    result = convert([prefix], tmp_path / "ds", packing=packing, workers=2)
    assert result.report["documents"] == {**result.report["documents"], "in": 400, "written": 400, "rejected": 0,
                                          "balanced": True}
    assert result.report["bytes"]["balanced"]
    assert_documents(tmp_path / "ds", documents)

    export(tmp_path / "ds", tmp_path / "back" / "corpus")
    back = megatron().IndexedDataset(str(tmp_path / "back" / "corpus"))  # Megatron's own reader opens it
    if packing != "bestfit":  # bestfit gives a long document back as its full windows and its tail
        assert back.document_indices.tolist() == list(range(401))
        assert [d.tolist() for d in read_megatron(tmp_path / "back" / "corpus")] == [d.tolist() for d in documents]
    assert back.sequence_lengths.sum() == sum(len(d) for d in documents)
    assert (tmp_path / "back" / "corpus.bin").read_bytes() == prefix.with_suffix(".bin").read_bytes() \
        or packing == "bestfit"


def test_export_records_the_tokenizer_and_convert_reads_it_back(tmp_path, source):
    prefix, documents = source
    first = convert([prefix], tmp_path / "ds")
    assert main(["export", str(tmp_path / "ds"), "--to", "megatron", "--output", str(tmp_path / "back" / "corpus"),
                 "--no-progress"]) == 0
    again = convert([tmp_path / "back" / "corpus"], tmp_path / "again", tokenizer=None)
    assert again.manifest.tokenizer == first.manifest.tokenizer
    assert_documents(tmp_path / "again", documents)
    assert [s.sha256 for s in again.manifest.shards] == [s.sha256 for s in first.manifest.shards]


def test_a_source_without_tokenizer_identity_is_refused(tmp_path, source, capsys):
    prefix, _ = source
    code = main(["convert", str(prefix), "--from", "megatron", "--output", str(tmp_path / "ds"), "--seq-len", "63",
                 "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--tokenizer is required" in err and str(prefix) in err


def test_export_samples_writes_each_sample_as_a_document(tmp_path, source):
    prefix, documents = source
    convert([prefix], tmp_path / "ds")
    export(tmp_path / "ds", tmp_path / "back" / "samples", unit="sample")
    manifest, samples = read_samples(str(tmp_path / "ds"))
    back = read_megatron(tmp_path / "back" / "samples")
    assert len(back) == manifest.num_samples == len(samples)
    assert all(b.tolist() == s.tokens.tolist() for b, s in zip(back, samples))
    with pytest.raises(FileExistsError, match="--overwrite"):
        export(tmp_path / "ds", tmp_path / "back" / "samples")


def test_output_does_not_depend_on_workers_or_unit_size(tmp_path, source):
    prefix, _ = source
    one = convert([prefix], tmp_path / "one", workers=1, unit_bytes=512)
    two = convert([prefix], tmp_path / "two", workers=2, unit_bytes=64 * 1024)
    assert one.manifest.to_json() == two.manifest.to_json()


def test_megatron_units_are_read_by_threads_of_this_process(tmp_path, source):
    """Reader threads, not worker processes: the ids reach the packer without a pickle and a pipe (the open
    filesystem a reader caches is then this process's)."""
    from shardkit.tools.convert import megatron as megatron_source

    megatron_source._filesystem.cache_clear()
    convert([source[0]], tmp_path / "ds", workers=2)
    assert megatron_source._filesystem.cache_info().currsize == 1


def test_several_sources_keep_their_own_indices(tmp_path):
    parts = [random_documents(30, seed=1), random_documents(20, seed=2)]
    for number, documents in enumerate(parts):
        write_megatron(tmp_path / f"part{number}", documents)
    result = convert([tmp_path / "part0", tmp_path / "part1"], tmp_path / "ds")
    assert result.manifest.sources == (str(tmp_path / "part0.bin"), str(tmp_path / "part1.bin"))
    assert_documents(tmp_path / "ds", parts[0], source=0)
    assert_documents(tmp_path / "ds", parts[1], source=1)


# -- bad input ----------------------------------------------------------------------------------------
def copy_source(source, directory):
    prefix, documents = source
    directory.mkdir()
    for suffix in (".bin", ".idx"):
        (directory / f"corpus{suffix}").write_bytes(prefix.with_suffix(suffix).read_bytes())
    return directory / "corpus", documents


def sequence_table(prefix):
    data = prefix.with_suffix(".idx").read_bytes()
    count = struct.unpack_from("<Q", data, 18)[0]
    return data, count, np.frombuffer(data, "<i8", count, 34 + 4 * count)


def test_a_truncated_bin_is_named_or_counted(tmp_path, source, capsys):
    prefix, documents = copy_source(source, tmp_path / "src")
    data = prefix.with_suffix(".bin").read_bytes()
    prefix.with_suffix(".bin").write_bytes(data[:-1000])
    lost = sum(1 for d in np.cumsum([len(d) * 2 for d in documents]) if d > len(data) - 1000)
    result = convert([prefix], tmp_path / "skip")
    docs = result.report["documents"]
    assert docs["rejected"] == lost > 0 and docs["in"] == 400 == docs["written"] + docs["rejected"]
    assert "truncated .bin" in docs["examples"][0]["reason"] and docs["examples"][0]["document"] == 400 - lost + 1
    code = main(["convert", str(prefix), "--from", "megatron", "--output", str(tmp_path / "fail"), "--tokenizer",
                 "byte", "--seq-len", "63", "--on-error", "fail", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert f"corpus.bin: document {400 - lost + 1}:" in err and "truncated .bin" in err


def test_idx_offsets_past_the_data_are_named_or_counted(tmp_path, source):
    prefix, documents = copy_source(source, tmp_path / "src")
    data, count, pointers = sequence_table(prefix)
    patched = pointers.copy()
    reference = megatron().IndexedDataset(str(prefix))  # held: its arrays are views of its memory map
    sequence = int(reference.document_indices[100])  # document 100 is one sequence
    del reference
    patched[sequence] = prefix.with_suffix(".bin").stat().st_size + 64
    prefix.with_suffix(".idx").write_bytes(data[:34 + 4 * count] + patched.tobytes() + data[34 + 12 * count:])
    result = convert([prefix], tmp_path / "skip")
    docs = result.report["documents"]
    assert docs["rejected"] == 1 and docs["examples"][0]["document"] == 101
    assert docs["rejected_by_reason"] == {"bytes outside the .bin": 1}
    _, samples = read_samples(str(tmp_path / "skip"))
    assert (0, 100) not in documents_from_samples(samples)
    with pytest.raises(BuildInputError, match=r"corpus.bin: document 101: .*\.idx offsets past the data"):
        convert([prefix], tmp_path / "fail", on_error="fail")


def test_token_ids_beyond_the_vocabulary_are_named_or_counted(tmp_path):
    documents = random_documents(50, seed=3)
    documents[7][5] = 300  # the byte tokenizer has 258 ids
    write_megatron(tmp_path / "corpus", documents)
    result = convert([tmp_path / "corpus"], tmp_path / "skip")
    assert result.report["documents"]["rejected"] == 1
    assert result.report["documents"]["examples"][0] == {
        "file": str(tmp_path / "corpus.bin"), "document": 8,
        "reason": f"token id outside the vocabulary: 300 at position 5, the vocabulary is [0, {BYTE_VOCAB})"}
    assert result.report["documents"]["rejected_by_reason"] == {"token id outside the vocabulary": 1}
    with pytest.raises(BuildInputError, match="corpus.bin: document 8: token id outside the vocabulary: 300"):
        convert([tmp_path / "corpus"], tmp_path / "fail", on_error="fail")


def test_a_file_that_is_not_an_index_is_one_error(tmp_path, source, capsys):
    prefix, _ = copy_source(source, tmp_path / "src")
    data = bytearray(prefix.with_suffix(".idx").read_bytes())
    prefix.with_suffix(".idx").write_bytes(bytes(data[:-8]))
    code = main(["convert", str(prefix), "--from", "megatron", "--output", str(tmp_path / "ds"), "--tokenizer",
                 "byte", "--seq-len", "63", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "corpus.idx" in err and "truncated or not an index" in err


def test_unreferenced_bytes_after_the_last_sequence_are_reported(tmp_path, source):
    prefix, _ = copy_source(source, tmp_path / "src")
    with open(prefix.with_suffix(".bin"), "ab") as fh:
        fh.write(b"\0" * 100)
    report = convert([prefix], tmp_path / "ds").report
    assert report["file_errors"][0]["unread_bytes"] == 100 and report["bytes"]["balanced"]
    assert "referenced by no .idx entry" in report["file_errors"][0]["reason"]


@pytest.mark.slow
def test_convert_sigkill_matrix_gives_byte_identical_output(tmp_path):
    """The build's SIGKILL harness (tests/kill_harness.py) on `shardkit convert`: kills at seeded moments,
    reruns to the end; every output is byte for byte the uninterrupted conversion's."""
    import subprocess
    import sys
    from pathlib import Path

    write_megatron(tmp_path / "corpus", random_documents(1500, seed=6))
    (tmp_path / "work").mkdir()
    here = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, str(here / "kill_harness.py"), "convert", str(tmp_path / "corpus"),
                          str(tmp_path / "work"), "12", "1"], capture_output=True, text=True, timeout=300, cwd=here.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["runs"] >= 12 and result["killed_mid_build"] >= 8, result
    assert result["mismatches"] == 0 and result["byte_mismatches"] == 0, result
    assert result["late_kill_outputs"] >= 1 and result["resumed_outputs"] == result["late_kill_outputs"], result
    assert result["reused_shards"] > 0 and result["reuse_mismatches"] == 0 and result["rewritten_shards"] == 0, result
    assert result["leftovers"] == 0 and result["orphaned_workers"] == 0, result
