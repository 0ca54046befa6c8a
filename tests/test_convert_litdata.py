"""`shardkit convert --from litdata`: datasets written by `litdata.optimize(..., item_loader=TokensLoader())`."""

from __future__ import annotations

import json

import pytest

from convert_sources import random_documents, write_litdata
from shardkit.tools.build import BuildInputError
from shardkit.tools.convert import ConvertConfig, run_convert
from test_build import documents_from_samples, read_samples


def convert(sources, output, **overrides):
    base = dict(inputs=tuple(map(str, sources)), source_format="litdata", output=str(output), tokenizer="byte",
                seq_len=63, shard_size=20_000, unit_bytes=2048, progress=False, workers=2)
    base.update(overrides)
    return run_convert(ConvertConfig(**base))


@pytest.mark.parametrize("dtype", ["int32", "uint16"])
def test_litdata_items_become_documents(tmp_path, dtype):
    documents = random_documents(300, seed=13)
    write_litdata(tmp_path / "lit", documents, dtype=dtype)
    index = json.loads((tmp_path / "lit" / "index.json").read_text())
    assert len(index["chunks"]) > 1 and index["config"]["item_loader"] == "TokensLoader"
    result = convert([tmp_path / "lit"], tmp_path / "ds")
    assert result.report["documents"]["written"] == 300 and result.report["bytes"]["balanced"]
    _, samples = read_samples(str(tmp_path / "ds"))
    found = documents_from_samples(samples)
    order = {c["filename"]: n for n, c in enumerate(index["chunks"])}  # sources are listed in chunk order
    assert len(order) == len(result.manifest.sources)
    assert [found[key] for key in sorted(found)] == [d.tolist() for d in documents]


def test_ids_beyond_the_vocabulary_are_named_or_counted(tmp_path):
    documents = random_documents(60, seed=14)
    documents[5][2] = 4000
    write_litdata(tmp_path / "lit", documents)
    result = convert([tmp_path / "lit"], tmp_path / "ds")
    assert result.report["documents"]["rejected_by_reason"] == {"token id outside the vocabulary": 1}
    with pytest.raises(BuildInputError, match=r"chunk-0-0.bin: item 6: token id outside the vocabulary: 4000"):
        convert([tmp_path / "lit"], tmp_path / "fail", on_error="fail")


def test_a_truncated_chunk_is_named_or_counted(tmp_path):
    write_litdata(tmp_path / "lit", random_documents(200, seed=15))
    index = json.loads((tmp_path / "lit" / "index.json").read_text())
    chunk = tmp_path / "lit" / index["chunks"][-1]["filename"]
    chunk.write_bytes(chunk.read_bytes()[:-6])
    docs = convert([tmp_path / "lit"], tmp_path / "cut").report["documents"]
    assert docs["rejected"] == index["chunks"][-1]["chunk_size"] and docs["balanced"] and docs["in"] == 200
    with pytest.raises(BuildInputError, match=rf"{chunk.name}: item 1: the chunk's item offsets do not tile"):
        convert([tmp_path / "lit"], tmp_path / "fail", on_error="fail")
