"""LoaderConfig: validation naming the option, keyword overrides of StreamingDataset, and the resume
state's order fields derived from the config; also the Python API's refusals of bad arguments."""

from __future__ import annotations

import dataclasses

import pytest

from loader_helpers import write_fixed
from shardkit import LoaderConfig, StreamingDataLoader, StreamingDataset
from shardkit.loaders.state import ORDER_FIELDS, LoaderState


@pytest.mark.parametrize("values, option", [
    ({"shuffle_window": 0}, "shuffle_window"), ({"seed": -1}, "seed"), ({"block_size": 0}, "block_size"),
    ({"num_partitions": 0}, "num_partitions"), ({"partial_batches": "keep"}, "partial_batches"),
    ({"epoch_size": 0}, "epoch_size"), ({"max_tokens": 0}, "max_tokens"), ({"token_window": 0}, "token_window"),
    ({"chunk_samples": 0}, "chunk_samples"), ({"cache_limit": 0}, "cache_limit"), ({"cache_wait": -1}, "cache_wait"),
    ({"shuffle": "no"}, "shuffle"), ({"prefetch": 1}, "prefetch"),
])
def test_validation_names_the_option(values, option):
    with pytest.raises(ValueError, match=f"^{option} "):
        LoaderConfig(**values)


def test_every_field_documents_itself():
    for f in dataclasses.fields(LoaderConfig):
        assert len(f.metadata.get("help", "")) > 10, f.name


def test_keyword_calls_and_config_give_the_same_dataset(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 100, per_shard=30)
    cache = str(tmp_path / "c")
    by_keywords = StreamingDataset(url, cache_dir=cache, shuffle_window=40, seed=3, block_size=10, rank=0,
                                   world_size=1)
    config = LoaderConfig(shuffle_window=40, seed=3, block_size=10)
    by_config = StreamingDataset(url, config, cache_dir=cache, rank=0, world_size=1)
    assert by_keywords.config == by_config.config == config
    assert (by_keywords.seed, by_keywords.shuffle_window) == (3, 40)  # options read as attributes
    # Overrides apply over a given config.
    assert StreamingDataset(url, config, cache_dir=cache, seed=9).config == dataclasses.replace(config, seed=9)
    ids = [[b["sample_id"].tolist() for b in StreamingDataLoader(ds, batch_size=5)] for ds in (by_keywords, by_config)]
    assert ids[0] == ids[1]


def test_unknown_keyword_and_wrong_config_are_type_errors(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 10, per_shard=10)
    with pytest.raises(TypeError, match="'shuffle_windw'"):
        StreamingDataset(url, cache_dir=str(tmp_path / "c"), shuffle_windw=10)
    with pytest.raises(TypeError, match="LoaderConfig"):
        StreamingDataset(url, {"seed": 1})


def test_state_order_fields_are_the_config_order_fields(tmp_path):
    marked = LoaderConfig.order_fields()
    assert set(marked) <= set(ORDER_FIELDS) and {"seed", "shuffle_window", "max_tokens"} <= set(marked)
    assert not {"cache_limit", "prefetch", "chunk_samples", "cache_wait"} & set(ORDER_FIELDS)
    url = str(tmp_path / "ds")
    write_fixed(url, 100, per_shard=30)
    saved = StreamingDataLoader(StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=1),
                                batch_size=5).state_dict()
    changes = {"shuffle": False, "seed": 1, "shuffle_window": 7, "block_size": 10, "num_partitions": 2,
               "partial_batches": "pad", "max_tokens": 64, "token_window": 100}
    assert set(changes) == set(marked) - {"epoch_size"}  # epoch_size: mixtures only, see the mixture tests
    for name, changed in changes.items():  # every order field is recorded; a change to it refuses the resume
        dataset = StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=1, **{name: changed})
        other = StreamingDataLoader(dataset, batch_size=None if dataset.max_tokens else 5)
        with pytest.raises(ValueError, match=f"{name}: saved"):
            other.load_state_dict(saved)
    assert LoaderState.from_dict(saved).to_dict() == saved
