"""The data fingerprint: its value is pinned by saved loader states, so the fast numpy path must give
exactly the bytes of the json.dumps formula, whatever the names hold."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_helpers import write_fixed

import shardkit.loaders.state.fingerprint as fingerprint_module
from shardkit.loaders.dataset import StreamingDataset
from shardkit.loaders.state.fingerprint import data_fingerprint, shard_entries
from shardkit.loaders.order.mixing import Stream
from shardkit.manifest import Manifest, ShardInfo, TokenizerInfo
from shardkit.shard_columns import ShardColumns

# Every kind of character json.dumps escapes or rewrites, between plain names (runs on both paths).
TRICKY = ['a"quoted".tar', "tab\there.tar", "bell\x07.tar", "del\x7f.tar", "caf\u00e9/\u00fc.tar",
          "\u65e5\u672c.tar", "smile\U0001F642.tar", "line\nfeed.tar", "unit\x1fsep.tar", "\u2028sep.tar"]


def reference(manifests: list[Manifest], weights: list) -> str:
    """The formula saved states depend on, written the slow and obvious way."""
    entries = [[[s.name, s.samples, s.sha256] for s in m.shards] for m in manifests]
    return hashlib.sha256(json.dumps([entries, weights]).encode()).hexdigest()[:32]


def manifest_of(names: list[str], samples: list[int]) -> Manifest:
    rng = np.random.default_rng(len(names))
    shards = [ShardInfo(name=n, samples=k, tokens=0, compressed_bytes=k, raw_bytes=k,
                        sha256=rng.integers(0, 256, 32, dtype=np.uint8).tobytes().hex(), has_doc_boundaries=False)
              for n, k in zip(names, samples)]
    return Manifest(shard_format="tar", token_dtype="uint16", seq_len=None, packing="none",
                    tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=256), shards=tuple(shards))


@pytest.mark.parametrize("chunk", [3, 1 << 13])  # chunks cut between and around the special names
def test_fast_path_equals_the_json_formula_for_tricky_names(monkeypatch, chunk):
    monkeypatch.setattr(fingerprint_module, "_CHUNK", chunk)
    names = [f"shards/plain-{i:03d}.tar" for i in range(12)]
    for k, tricky in enumerate(TRICKY):
        names.insert(1 + 2 * k, tricky)  # alone, in pairs, at chunk edges
    names += ["x.tar", "y" * 300 + ".tar", 'last"one.tar']
    counts = [0, 1, 9, 10, 99, 100, 2**62, 12345, 7] * 5
    first = manifest_of(names, counts[:len(names)])
    second = manifest_of(["one.tar"], [3])
    weights = [0.25, {"schedule": [[0, 1.0]]}]
    assert data_fingerprint([first], []) == reference([first], [])
    assert data_fingerprint([first, second], weights) == reference([first, second], weights)
    assert data_fingerprint([manifest_of([], [])], []) == reference([manifest_of([], [])], [])
    # Columns (what a manifest read through the binary index holds) give the same bytes.
    columnar = dataclasses.replace(first, shards=ShardColumns.from_shards(first.shards))
    assert data_fingerprint([columnar], []) == reference([first], [])


def test_entries_escape_what_a_manifest_cannot_hold_too():
    # Backslashes are refused in shard names, but the entries of any columns must still match json.
    names = ["a\\b.tar", "plain.tar", '\\"\u00e9']
    encoded = [n.encode() for n in names]
    columns = ShardColumns(names=b"".join(encoded), name_offsets=np.cumsum([0] + [len(e) for e in encoded]),
                           sha256=np.zeros((3, 32), dtype=np.uint8), has_doc_boundaries=np.zeros(3, bool),
                           samples=np.array([1, 22, 333]), tokens=np.zeros(3, np.int64),
                           compressed_bytes=np.zeros(3, np.int64), raw_bytes=np.zeros(3, np.int64))
    expected = ", ".join(json.dumps([n, k, "0" * 64]) for n, k in zip(names, [1, 22, 333]))
    assert shard_entries(columns, 0, 3).decode() == expected


name_text = st.text(st.characters(blacklist_characters="\x00\\/", blacklist_categories=("Cs",)), min_size=1,
                    max_size=12).filter(lambda n: n not in (".", "..", "shardkit.json", "shardkit.index") and not (len(n) > 1 and n[1] == ":"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(name_text, st.integers(0, 2**63 - 1)), max_size=20, unique_by=lambda e: e[0]))
def test_any_valid_names_and_counts_match_the_formula(entries):
    manifest = manifest_of([n for n, _ in entries], [k for _, k in entries])
    assert data_fingerprint([manifest], [1.0]) == reference([manifest], [1.0])


def test_dataset_fingerprints_use_the_formula(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first, second = write_fixed(a, 120, seq_len=8, per_shard=50), write_fixed(b, 60, seq_len=8, per_shard=50)
    single = StreamingDataset(a, cache_dir=str(tmp_path / "cache"), rank=0, world_size=1)
    assert single.identity() == reference([first], []) == single.stream_identities()[0]
    mixed = StreamingDataset([Stream(a, 2.0), Stream(b, 1.0)], cache_dir=str(tmp_path / "cache"), rank=0, world_size=1)
    assert mixed.identity() == reference([first, second], [2.0, 1.0])
    assert mixed.stream_identities() == [reference([first], []), reference([second], [])]


def test_the_former_fingerprint_method_warns_and_answers_the_identity(tmp_path):
    from shardkit.loaders import StreamingDataset
    from train_runs import write_byte_dataset

    write_byte_dataset(str(tmp_path / "data"), num_samples=8, samples_per_shard=4)
    dataset = StreamingDataset(str(tmp_path / "data"))
    with pytest.warns(DeprecationWarning, match=r"now StreamingDataset.identity\(\)"):
        assert dataset.fingerprint() == dataset.identity()
