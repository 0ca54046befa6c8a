"""The code snippets of docs/FORMAT.md read real shards."""

from __future__ import annotations

import numpy as np
from format_samples import make_samples, tokenizer

from shardkit.formats import write_dataset


def test_format_doc_snippets_read_real_shards(tmp_path):
    """docs/FORMAT.md's reader snippets (tarfile+zstandard+numpy; pyarrow alone) work on real shards."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md").read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", doc, flags=re.S):
        exec(compile(block, "docs/FORMAT.md", "exec"), namespace)
    rng = np.random.default_rng(12)
    samples = make_samples(rng, 25, 50257)
    # Tar in both layouts (groups of about 8 KB: several per shard), and arrow.
    for shard_format, options in (("tar", {"block_bytes": 8192}), ("tar", {"tar_layout": "samples"}), ("arrow", {})):
        url = tmp_path / f"{shard_format}-{'-'.join(map(str, options.values()))}"
        manifest = write_dataset(str(url), samples, tokenizer=tokenizer(50257), seq_len=None, packing="none",
                                 shard_format=shard_format, max_samples=10, **options)
        got = []
        for shard in manifest.shards:
            data = (url / shard.name).read_bytes()
            if shard_format == "tar":
                got.extend(namespace["read_tar_shard"](data))
            else:
                got.extend((namespace["read_arrow_shard"](data, i), None) for i in range(shard.samples))
                assert np.array_equal(namespace["read_arrow_shard"](str(url / shard.name), 3), got[-shard.samples + 3][0])
        assert len(got) == len(samples)
        for want, (tokens, docs) in zip(samples, got):
            np.testing.assert_array_equal(tokens, want.tokens)
            if docs is not None:
                np.testing.assert_array_equal(docs, np.stack([want.doc_starts, want.doc_source, want.doc_index], axis=1))
    assert "10,240 zero bytes" in doc  # the empty-shard claim, checked here:
    from shardkit.formats import arrays_from_samples, encode_shard

    assert encode_shard(arrays_from_samples([], "uint16"), shard_format="tar", token_dtype="uint16").data == bytes(10240)
