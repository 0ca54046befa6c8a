"""`shardkit convert --from mds`: datasets written by MosaicML Streaming's own `MDSWriter`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from convert_sources import random_documents, write_mds
from shardkit.tools.build import BuildInputError
from shardkit.tools.convert import ConvertConfig, run_convert
from test_build import documents_from_samples, read_samples


def convert(sources, output, **overrides):
    base = dict(inputs=tuple(map(str, sources)), source_format="mds", output=str(output), tokenizer="byte",
                seq_len=63, shard_size=20_000, unit_bytes=2048, progress=False, workers=2)
    base.update(overrides)
    return run_convert(ConvertConfig(**base))


@pytest.mark.parametrize("encoding, dtype, compression", [("ndarray:uint16", "uint16", "zstd"),
                                                          ("ndarray", "int32", None)])
def test_mds_samples_become_documents(tmp_path, encoding, dtype, compression):
    documents = random_documents(250, seed=10)
    write_mds(tmp_path / "mds", documents, encoding=encoding, dtype=dtype, compression=compression)
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    assert len(index["shards"]) > 1
    result = convert([tmp_path / "mds"], tmp_path / "ds")
    assert result.report["documents"]["written"] == 250 and result.report["bytes"]["balanced"]
    _, samples = read_samples(str(tmp_path / "ds"))
    found = documents_from_samples(samples)
    rows = [found[key] for key in sorted(found)]  # (shard, sample) order is the writer's order
    assert rows == [d.tolist() for d in documents]
    assert [s for s, _ in sorted(found)] == sorted(s for s, _ in found)


def test_a_shard_with_a_wrong_hash_is_named_or_counted(tmp_path):
    documents = random_documents(120, seed=11)
    write_mds(tmp_path / "mds", documents)
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    victim = tmp_path / "mds" / index["shards"][1]["zip_data"]["basename"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = convert([tmp_path / "mds"], tmp_path / "ds")
    docs = result.report["documents"]
    lost = index["shards"][1]["samples"]
    assert docs["rejected"] == lost and docs["written"] == 120 - lost and docs["balanced"]
    assert docs["rejected_by_reason"] == {"the shard fails its sha1 hash in index.json": lost}
    with pytest.raises(BuildInputError, match=rf"{victim.name}: sample 1: the shard fails its sha1 hash"):
        convert([tmp_path / "mds"], tmp_path / "fail", on_error="fail")


def test_ids_beyond_the_vocabulary_and_a_missing_column(tmp_path):
    documents = random_documents(40, seed=12)
    documents[3][0] = 999
    write_mds(tmp_path / "mds", documents)
    result = convert([tmp_path / "mds"], tmp_path / "ds")
    assert result.report["documents"]["rejected_by_reason"] == {"token id outside the vocabulary": 1}
    with pytest.raises(ValueError, match=r"index.json: shard 0: no column 'tokens' \(columns: id, input_ids\)"):
        convert([tmp_path / "mds"], tmp_path / "other", token_field="tokens")
    assert np.any(documents[3] == 999)
