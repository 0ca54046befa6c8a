"""`shardkit convert --from hf`: `datasets` save_to_disk directories and Parquet files with a token-id column."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from convert_sources import random_documents, write_hf
from shardkit.cli import main
from shardkit.tools.build import BuildInputError
from shardkit.tools.convert import ConvertConfig, run_convert
from test_build import documents_from_samples, read_samples


def convert(sources, output, **overrides):
    base = dict(inputs=tuple(map(str, sources)), source_format="hf", output=str(output), tokenizer="byte",
                seq_len=63, shard_size=20_000, unit_bytes=2048, progress=False, workers=1)
    base.update(overrides)
    return run_convert(ConvertConfig(**base))


def documents_by_source(output):
    _, samples = read_samples(str(output))
    found = documents_from_samples(samples)
    by_source: dict[int, list] = {}
    for (source, index), tokens in sorted(found.items()):
        by_source.setdefault(source, []).append((index, tokens))
    return by_source


def test_save_to_disk_rows_become_documents(tmp_path):
    documents = random_documents(2600, seed=4, longest=24)
    write_hf(tmp_path / "hf", documents)
    files = json.loads((tmp_path / "hf" / "state.json").read_text())["_data_files"]
    assert len(files) == 2  # several Arrow files, each its own source, each of several record batches
    with pa.OSFile(str(tmp_path / "hf" / files[0]["filename"])) as fh:
        assert len(list(pa.ipc.open_stream(fh))) > 1
    result = convert([tmp_path / "hf"], tmp_path / "ds", workers=2)
    report = result.report
    assert report["documents"]["in"] == 2600 == report["documents"]["written"] and report["bytes"]["balanced"]
    assert result.manifest.sources == tuple(str(tmp_path / "hf" / f["filename"]) for f in files)
    found = documents_by_source(tmp_path / "ds")
    assert [[index for index, _ in found[source]] for source in (0, 1)] == [list(range(1300))] * 2  # row numbers
    rows = [tokens for source in (0, 1) for _, tokens in found[source]]
    assert rows == [d.tolist() for d in documents]  # every row, in order, token for token
    again = convert([tmp_path / "hf"], tmp_path / "again", workers=1, unit_bytes=1 << 20)
    assert again.manifest.to_json() == result.manifest.to_json()


def test_parquet_with_a_token_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    documents = random_documents(200, seed=5)
    datasets.Dataset.from_dict({"ids": [d.tolist() for d in documents]}).to_parquet(str(tmp_path / "train.parquet"),
                                                                                  batch_size=50)
    result = convert([tmp_path / "train.parquet"], tmp_path / "ds", token_field="ids", packing="none")
    assert result.report["documents"]["written"] == 200
    found = documents_by_source(tmp_path / "ds")[0]
    assert [index for index, _ in found] == list(range(200))
    assert [tokens for _, tokens in found] == [d.tolist() for d in documents]


def test_bad_rows_are_named_or_counted(tmp_path):
    rows = [[1, 2, 3], None, [4, 5, 300], [], [6, None, 7], [8, 9]]
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))}), tmp_path / "bad.parquet")
    result = convert([tmp_path / "bad.parquet"], tmp_path / "ds")
    docs = result.report["documents"]
    assert docs["in"] == 6 and docs["written"] == 2 and docs["rejected"] == 4 and docs["balanced"]
    assert [e["row"] for e in docs["examples"]] == [2, 3, 4, 5]
    assert docs["rejected_by_reason"] == {"the token list is null": 1, "token id outside the vocabulary": 1,
                                          "empty document": 1, "the token list holds a null id": 1}
    assert sorted(documents_by_source(tmp_path / "ds")[0]) == [(0, [1, 2, 3]), (5, [8, 9])]
    with pytest.raises(BuildInputError, match=r"bad.parquet: row 2: the token list is null"):
        convert([tmp_path / "bad.parquet"], tmp_path / "fail", on_error="fail")


def test_a_text_column_is_refused_row_by_row(tmp_path):
    pq.write_table(pa.table({"input_ids": ["not ids", "at all"]}), tmp_path / "text.parquet")
    with pytest.raises(BuildInputError, match="text.parquet: row 1: the token column is string, not a list"):
        convert([tmp_path / "text.parquet"], tmp_path / "ds", on_error="fail")


def test_a_missing_column_or_a_dataset_dict_is_one_error(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1, 2]]}),
                                   "test": datasets.Dataset.from_dict({"input_ids": [[3]]})})
    splits.save_to_disk(str(tmp_path / "dict"))
    capsys.readouterr()  # datasets' own progress bars
    code = main(["convert", str(tmp_path / "dict"), "--from", "hf", "--output", str(tmp_path / "ds"), "--tokenizer",
                 "byte", "--seq-len", "63", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is a DatasetDict (splits: train, test)" in err
    with pytest.raises(ValueError, match=r"data-00000-of-00001.arrow: .*no column 'tokens' \(columns: input_ids\); "
                                         "choose one with --token-field"):
        convert([tmp_path / "dict" / "train"], tmp_path / "wrong", token_field="tokens")
