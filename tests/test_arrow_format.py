"""The Arrow IPC shard format: read by plain pyarrow, foreign schemas refused."""

from __future__ import annotations

import numpy as np
import pytest
from format_samples import make_samples

from shardkit.errors import CorruptShardError
from shardkit.formats import write_dataset
from shardkit.manifest import TokenizerInfo


def test_pyarrow_reads_arrow_shard(tmp_path):
    import pyarrow as pa

    rng = np.random.default_rng(3)
    samples = make_samples(rng, 20, 50257)
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=50257),
                             seq_len=None, packing="none", shard_format="arrow")
    table = pa.ipc.open_file(str(tmp_path / "ds" / manifest.shards[0].name)).read_all()
    assert table.column_names == ["tokens", "doc_starts", "doc_source", "doc_index"]
    for want, tokens in zip(samples, table.column("tokens").to_pylist()):
        assert tokens == want.tokens.tolist()

def test_arrow_with_a_foreign_schema_is_rejected():
    import pyarrow as pa

    from shardkit.formats import decode_shard

    sink = pa.BufferOutputStream()
    table = pa.table({"tokens": pa.array([[1, 2]], pa.list_(pa.int64()))})
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(CorruptShardError, match="corrupt shard f.arrow: wrong Arrow schema"):
        decode_shard(sink.getvalue().to_pybytes(), shard_format="arrow", token_dtype="uint16", shard="f.arrow",
                     raw_bytes=10**6)
    with pytest.raises(CorruptShardError, match="not a readable Arrow IPC file"):
        decode_shard(b"garbage" * 100, shard_format="arrow", token_dtype="uint16", shard="f.arrow", raw_bytes=10)
