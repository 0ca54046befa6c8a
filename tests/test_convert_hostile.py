"""`shardkit convert` on hostile or damaged sources (issue 34, items 1-6): tiny hand-made files.

Each case is either counted (a damaged record, under `--on-error skip`) or refused before anything is
written: one line naming the file and the problem, exit 2 through the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import time
import tracemalloc

import numpy as np
import pytest

from convert_sources import (litdata_chunk_bytes, mds_entry, mds_shard_bytes, random_documents, write_hand_made_hf,
                             write_hand_made_litdata, write_hand_made_mds)
from shardkit.block_indexes import BLOCK_INDEXES_NAME
from shardkit.cli import main
from shardkit.manifest import MANIFEST_NAME, load_manifest
from shardkit.tools.build import BuildInputError
from shardkit.tools.convert import ConvertConfig, run_convert
from shardkit.tools.convert.megatron import encode_index
from test_build import documents_from_samples, read_samples


def convert(sources, output, source_format, **overrides):
    base = dict(inputs=tuple(map(str, sources)), source_format=source_format, output=str(output), tokenizer="byte",
                seq_len=63, shard_size=20_000, unit_bytes=1 << 20, progress=False, workers=1)
    base.update(overrides)
    return run_convert(ConvertConfig(**base))


def convert_cli(source, output, source_format, capsys) -> tuple[int, list[str]]:
    code = main(["convert", str(source), "--from", source_format, "--output", str(output), "--tokenizer", "byte",
                 "--seq-len", "63", "--workers", "1", "--no-progress"])
    return code, capsys.readouterr().err.strip().splitlines()


def assert_refused(code, err, output, *words):
    """One line, exit 2, naming what it should, and no output at all."""
    assert code == 2 and len(err) == 1, err
    assert "Traceback" not in err[0] and all(word in err[0] for word in words), err
    assert not output.exists() or not any(output.iterdir())


# -- 1: a Megatron pointer near 2**63 ---------------------------------------------------------------
def test_a_megatron_pointer_near_2_63_is_a_rejected_document_and_shifts_no_other(tmp_path):
    documents = random_documents(12, seed=40, longest=40)
    prefix = tmp_path / "corpus"
    (tmp_path / "corpus.bin").write_bytes(b"".join(d.astype(np.uint16).tobytes() for d in documents))
    data = encode_index(np.dtype(np.uint16), [len(d) for d in documents], np.arange(13))
    count = len(documents)
    pointers = np.frombuffer(data, "<i8", count, 34 + 4 * count).copy()
    victim = 5
    # pointer + length * 2 wraps below zero in int64: it then looked like a sequence inside the .bin
    pointers[victim] = 2**63 - 2
    (tmp_path / "corpus.idx").write_bytes(data[:34 + 4 * count] + pointers.tobytes() + data[34 + 12 * count:])
    docs = convert([prefix], tmp_path / "skip", "megatron").report["documents"]
    assert docs["rejected"] == 1 and docs["written"] == count - 1 and docs["balanced"]
    assert docs["examples"][0]["document"] == victim + 1 and "bytes outside the .bin" in docs["examples"][0]["reason"]
    _, samples = read_samples(str(tmp_path / "skip"))
    found = documents_from_samples(samples)
    assert sorted(found) == [(0, i) for i in range(count) if i != victim]
    assert all(found[(0, i)] == documents[i].tolist() for i in range(count) if i != victim)  # none shifted
    with pytest.raises(BuildInputError, match=rf"corpus.bin: document {victim + 1}: bytes outside the .bin"):
        convert([prefix], tmp_path / "fail", "megatron", on_error="fail")


# -- 2: an MDS shard that inflates past its declared size ---------------------------------------------
def zstd_of(*pieces: bytes, repeat_last: int = 1) -> bytes:
    """zstd of the pieces, the last one `repeat_last` times (streamed: the test never holds the whole)."""
    import zstandard

    compressor = zstandard.ZstdCompressor().compressobj()
    out = [compressor.compress(p) for p in pieces[:-1]]
    out += [compressor.compress(pieces[-1]) for _ in range(repeat_last)]
    return b"".join(out) + compressor.flush()


def write_mds_with(directory, entry, stored: bytes) -> None:
    """An MDS dataset of a good shard (5 samples: a conversion needs one document) and the shard `entry`,
    whose stored file holds `stored`."""
    good_raw = mds_shard_bytes(random_documents(5, seed=49))
    directory.mkdir(exist_ok=True)
    (directory / "good.mds").write_bytes(good_raw)
    (directory / (entry["zip_data"] or entry["raw_data"])["basename"]).write_bytes(stored)
    index = {"version": 2, "shards": [mds_entry(good_raw, 5, basename="good.mds"), entry]}
    (directory / "index.json").write_text(json.dumps(index))


def test_an_mds_shard_inflating_past_its_declared_size_is_refused_with_bounded_memory(tmp_path):
    from shardkit.tools.convert import mds
    from shardkit.tools.convert.documents import TokenSettings
    from shardkit.text.inputs import WorkUnit

    documents = random_documents(10, seed=41)
    raw = mds_shard_bytes(documents)
    bomb = zstd_of(raw, b"\0" * (1 << 20), repeat_last=64)  # 64 MiB of zeros after the declared shard
    directory = tmp_path / "mds"
    write_mds_with(directory, mds_entry(raw, len(documents), stored=bomb), bomb)
    assert len(bomb) < 64 * 1024
    docs = convert([directory], tmp_path / "ds", "mds").report["documents"]
    assert docs["rejected"] == 10 and docs["written"] == 5 and docs["balanced"]
    assert docs["rejected_by_reason"] == {f"the shard decompresses to more than the {len(raw)} bytes index.json "
                                          "declares": 10}

    shard = mds.expand_sources((str(directory),), token_field="input_ids", storage_options=None)[1][1]
    unit = WorkUnit(index=0, source=0, file_unit=0, kind="mds", first_record=0, payload=shard, input_offset=0,
                    records_in_payload=10)
    tracemalloc.start()
    result = mds.read_shard_unit(unit, TokenSettings(vocab_size=258, token_dtype="uint16"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(result.rejected) == 10 and peak < 8 * len(raw) + (2 << 20), peak  # not the 64 MiB it inflates to


@pytest.mark.parametrize("case", ["short", "trailing", "trailing-uncompressed"])
def test_an_mds_shard_of_another_size_or_with_bytes_after_its_last_sample_is_refused(tmp_path, case):
    raw = mds_shard_bytes(random_documents(10, seed=42))
    if case == "short":  # inflates to less than index.json declares
        declared, content = raw + b"\0" * 100, raw
        reason = f"the shard decompresses to {len(raw)} bytes, index.json declares {len(raw) + 100}"
    else:  # the declared size is right, but the samples end before it: bytes nobody reads
        declared = content = raw + b"hidden payload"
        reason = "14 bytes after the last sample"
    stored = None if case == "trailing-uncompressed" else zstd_of(content)
    directory = tmp_path / "mds"
    write_mds_with(directory, mds_entry(declared, 10, stored=stored), content if stored is None else stored)
    docs = convert([directory], tmp_path / "ds", "mds").report["documents"]
    assert docs["rejected"] == 10 and docs["balanced"], docs
    assert reason in docs["examples"][0]["reason"], docs["examples"][0]


# -- 3: names that leave the source directory -----------------------------------------------------------
def escaping_source(tmp_path, source_format):
    """A source whose index names `../private/id_rsa`, a file that exists outside it."""
    (tmp_path / "private").mkdir()
    secret = tmp_path / "private" / "id_rsa"
    documents = random_documents(5, seed=43)
    directory = tmp_path / "src"
    if source_format == "mds":
        index = write_hand_made_mds(directory, documents)
        secret.write_bytes((directory / "shard.00000.mds").read_bytes())
        index["shards"][0]["raw_data"]["basename"] = "../private/id_rsa"
        (directory / "index.json").write_text(json.dumps(index))
    elif source_format == "litdata":
        index = write_hand_made_litdata(directory, documents)
        secret.write_bytes((directory / "chunk-0-0.bin").read_bytes())
        index["chunks"][0]["filename"] = "../private/id_rsa"
        (directory / "index.json").write_text(json.dumps(index))
    else:
        state = write_hand_made_hf(directory, documents)
        secret.write_bytes((directory / "data-00000-of-00001.arrow").read_bytes())
        state["_data_files"][0]["filename"] = "../private/id_rsa"
        (directory / "state.json").write_text(json.dumps(state))
    return directory


@pytest.mark.parametrize("source_format, index_name", [("mds", "index.json"), ("litdata", "index.json"),
                                                       ("hf", "state.json")])
def test_a_file_name_leaving_the_source_is_refused(tmp_path, capsys, source_format, index_name):
    directory = escaping_source(tmp_path, source_format)
    code, err = convert_cli(directory, tmp_path / "ds", source_format, capsys)
    assert_refused(code, err, tmp_path / "ds", f"{directory / index_name}", "'../private/id_rsa'",
                   "must stay inside")


# -- 4: index.json of the wrong shape ----------------------------------------------------------------
def mds_variants():
    entry = mds_entry(mds_shard_bytes([[1, 2, 3]]), 1)

    def shard(**changes):
        return {"version": 2, "shards": [{**entry, **changes}]}

    return {
        "a list": ([entry], "not an MDS index (a JSON object is expected, got a list)"),
        "no shards": ({"version": 2}, "not an MDS index (no shards)"),
        "shards not a list": ({"shards": {"0": entry}}, "shards must be a list"),
        "a shard not an object": ({"shards": ["shard.00000.mds"]}, "shard 0 must be an object"),
        "no raw_data": (shard(raw_data=None), "shard 0: raw_data must be an object"),
        "samples a string": (shard(samples="10"), "shard 0: samples must be an integer >= 0, got '10'"),
        "negative samples": (shard(samples=-5), "shard 0: samples must be an integer >= 0, got -5"),
        "negative bytes": (shard(raw_data={**entry["raw_data"], "bytes": -1}),
                           "shard 0: raw_data.bytes must be an integer >= 0, got -1"),
        "column sizes short": (shard(column_sizes=[]), "shard 0: column_names, column_encodings and column_sizes"),
        "hashes a list": (shard(raw_data={**entry["raw_data"], "hashes": ["sha1"]}),
                          "shard 0: raw_data.hashes must be an object"),
        "unknown codec": (shard(compression="lz77", zip_data=entry["raw_data"]), "compression 'lz77' is not read"),
    }


def litdata_variants():
    chunk = {"filename": "chunk-0-0.bin", "chunk_size": 1, "chunk_bytes": 16, "dim": 1}
    config = {"data_format": ["no_header_tensor:15"], "compression": None}
    return {
        "a list": ([chunk], "not a LitData index (a JSON object is expected, got a list)"),
        "no chunks": ({"config": config}, "not a LitData index (no chunks)"),
        "config a list": ({"config": [], "chunks": [chunk]}, "config must be an object"),
        "chunk not an object": ({"config": config, "chunks": [1]}, "chunk 0 must be an object"),
        "no filename": ({"config": config, "chunks": [{"chunk_size": 1}]}, "chunk 0: filename must be a string"),
        "negative chunk_size": ({"config": config, "chunks": [{**chunk, "chunk_size": -3}]},
                                "chunk 0: chunk_size must be an integer >= 0, got -3"),
        "chunk_size a float": ({"config": config, "chunks": [{**chunk, "chunk_size": 1.5}]},
                               "chunk 0: chunk_size must be an integer >= 0, got 1.5"),
        "data_format a string": ({"config": {**config, "data_format": "no_header_tensor:15"}, "chunks": [chunk]},
                                 "config.data_format must be a list"),
        "not JSON": ("{'chunks': [", "not a LitData index (Expecting"),
    }


@pytest.mark.parametrize("source_format, name", [("mds", n) for n in mds_variants()]
                         + [("litdata", n) for n in litdata_variants()])
def test_an_index_of_the_wrong_shape_is_one_line_and_exit_2(tmp_path, capsys, source_format, name):
    directory = tmp_path / "src"
    if source_format == "mds":
        write_hand_made_mds(directory, [[1, 2, 3]])
        index, words = mds_variants()[name]
    else:
        write_hand_made_litdata(directory, [[1, 2, 3]])
        index, words = litdata_variants()[name]
    (directory / "index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    code, err = convert_cli(directory, tmp_path / "ds", source_format, capsys)
    assert_refused(code, err, tmp_path / "ds", f"{directory / 'index.json'}", words)


def test_a_state_json_of_the_wrong_shape_is_one_line_and_exit_2(tmp_path, capsys):
    directory = tmp_path / "src"
    write_hand_made_hf(directory, [[1, 2, 3]])
    for state, words in [([], "a JSON object is expected, got a list"), ({"_data_files": "x"}, "must be a list"),
                         ({"_data_files": [{"filename": 3}]}, "_data_files 0: filename must be a string")]:
        (directory / "state.json").write_text(json.dumps(state))
        code, err = convert_cli(directory, tmp_path / "ds", "hf", capsys)
        assert_refused(code, err, tmp_path / "ds", f"{directory / 'state.json'}", words)


# -- 5: a declared count the file cannot hold -------------------------------------------------------
@pytest.mark.parametrize("source_format", ["litdata", "mds"])
def test_a_count_the_file_cannot_hold_is_refused_in_bounded_memory(tmp_path, capsys, source_format):
    directory = tmp_path / "src"
    documents = random_documents(10, seed=44)
    if source_format == "litdata":
        index = write_hand_made_litdata(directory, documents)
        index["chunks"][0]["chunk_size"] = 10**12
        size, what = (directory / "chunk-0-0.bin").stat().st_size, "chunk 0 (chunk-0-0.bin) declares"
    else:
        index = write_hand_made_mds(directory, documents)
        index["shards"][0]["samples"] = 10**12
        size, what = (directory / "shard.00000.mds").stat().st_size, "shard 0 (shard.00000.mds) declares"
    (directory / "index.json").write_text(json.dumps(index))
    tracemalloc.start()
    began = time.perf_counter()
    with pytest.raises(ValueError, match=rf"{re.escape(what)} 1000000000000 .*, but its {size} bytes hold at most "
                                         rf"{(size - 8) // 4}"):
        convert([directory], tmp_path / "ds", source_format)
    seconds = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 32 << 20 and seconds < 30, (peak, seconds)
    code, err = convert_cli(directory, tmp_path / "ds", source_format, capsys)
    assert_refused(code, err, tmp_path / "ds", f"{directory / 'index.json'}", "declares 1000000000000")


def test_a_compressed_shard_whose_bytes_cannot_hold_its_count_is_refused_in_bounded_memory(tmp_path):
    """A compressed shard's size is known only once it is inflated: the worker refuses it there (bounded by
    what it inflated to), instead of rejecting 10**12 samples one by one."""
    from shardkit.tools.convert import mds
    from shardkit.tools.convert.documents import TokenSettings
    from shardkit.text.inputs import WorkUnit

    raw = mds_shard_bytes(random_documents(10, seed=45))
    stored = zstd_of(raw)
    entry = mds_entry(raw, 10, stored=stored)
    write_mds_with(tmp_path / "mds", entry, stored)
    shard = mds.expand_sources((str(tmp_path / "mds"),), token_field="input_ids", storage_options=None)[1][1]
    # What expand_sources refuses for a file this small (the raw size 4 * 10**12 cannot come out of it)
    # reaches a worker if the file is swapped for a smaller one after the index was read.
    shard = dataclasses.replace(shard, samples=10**12, raw_bytes=4 * 10**12 + 8)
    unit = WorkUnit(index=0, source=0, file_unit=0, kind="mds", first_record=0, payload=shard, input_offset=0,
                    records_in_payload=10**12)
    tracemalloc.start()
    with pytest.raises(ValueError, match=rf"shard.00000.mds.zstd: index.json declares 1000000000000 samples, but the "
                                         rf"shard's {len(raw)} bytes hold at most {(len(raw) - 8) // 4}"):
        mds.read_shard_unit(unit, TokenSettings(vocab_size=258, token_dtype="uint16"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak


# -- 6: --overwrite removes only what the previous run recorded --------------------------------------
def test_overwrite_keeps_a_users_file_named_like_a_shard(tmp_path):
    directory = tmp_path / "src"
    write_hand_made_litdata(directory, random_documents(300, seed=46))
    out = tmp_path / "ds"
    first = convert([directory], out, "litdata", shard_size=4000)
    (out / "shard-notes.csv").write_text("mine")
    (out / "shard-000999.arrow.bak").write_text("mine too")
    second = convert([directory], out, "litdata", seq_len=31, overwrite=True, shard_size=1 << 20)
    assert (out / "shard-notes.csv").read_text() == "mine" and (out / "shard-000999.arrow.bak").read_text() == "mine too"
    assert len(second.manifest.shards) < len(first.manifest.shards)
    kept = {p.name for p in out.iterdir()}
    # The manifest's companion shardkit.blocks (the shards' block indexes) belongs to the dataset, as the JSON does.
    assert kept == {s.name for s in load_manifest(str(out)).shards} | {MANIFEST_NAME, BLOCK_INDEXES_NAME,
                                                                       "build_report.json", "shard-notes.csv",
                                                                       "shard-000999.arrow.bak"}


def test_litdata_chunk_bytes_helper_reads_back(tmp_path):
    """The hand-made chunk is what the reader expects (guards the helpers the cases above rely on)."""
    documents = random_documents(7, seed=47)
    chunk = litdata_chunk_bytes(documents)
    assert struct.unpack_from("<I", chunk)[0] == 7
    write_hand_made_litdata(tmp_path / "lit", documents)
    docs = convert([tmp_path / "lit"], tmp_path / "ds", "litdata").report["documents"]
    assert docs["written"] == 7 and docs["rejected"] == 0


def compressed_shard_declaring(directory, samples: int) -> tuple[bytes, bytes]:
    """(raw, stored) of a zstd shard of 10 samples whose entry declares `samples` and the raw size they need."""
    raw = mds_shard_bytes(random_documents(10, seed=48))
    stored = zstd_of(raw)
    entry = mds_entry(raw, samples, stored=stored)
    entry["raw_data"]["bytes"] = 4 * samples + 8
    write_mds_with(directory, entry, stored)
    return raw, stored


def test_a_compressed_shard_declaring_more_than_its_codec_can_inflate_is_refused_up_front(tmp_path, capsys):
    _, stored = compressed_shard_declaring(tmp_path / "mds", 10**12)
    code, err = convert_cli(tmp_path / "mds", tmp_path / "ds", "mds", capsys)
    assert_refused(code, err, tmp_path / "ds", str(tmp_path / "mds" / "index.json"), "shard 1 (shard.00000.mds.zstd)",
                   f"declares 4000000000008 decompressed bytes, but its {len(stored)} bytes of zstd inflate to at most "
                   f"{len(stored) << 15}")


def test_a_compressed_shard_inflating_short_of_its_declared_samples_stops_in_one_line(tmp_path, capsys):
    """Within what its codec could inflate (so the index passes), but the bytes it does inflate to cannot
    hold the samples declared: the worker stops the conversion instead of rejecting each one."""
    raw, _ = compressed_shard_declaring(tmp_path / "mds", 10**6)
    code, err = convert_cli(tmp_path / "mds", tmp_path / "ds", "mds", capsys)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert f"shard.00000.mds.zstd: index.json declares 1000000 samples, but the shard's {len(raw)} bytes hold at " \
           f"most {(len(raw) - 8) // 4}" in err[0]
    # what a stop under --on-error fail leaves too: the build state, no shard and no manifest
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["_build"]
