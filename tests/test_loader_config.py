"""LoaderConfig: validation naming the option, keyword overrides of StreamingDataset, and the resume
state's order fields derived from the config; also the Python API's refusals of bad arguments."""

from __future__ import annotations

import dataclasses

import pytest

from loader_helpers import write_fixed
from shardkit import LoaderConfig, StreamingDataLoader, StreamingDataset
from shardkit.loaders.state.loader_state import ORDER_FIELDS, LoaderState


def at(state, samples):
    """`state` moved to position `samples` of its epoch."""
    return {**state, "position": {**state["position"], "samples": samples}}


@pytest.mark.parametrize("values, option", [
    ({"shuffle_window": 0}, "shuffle_window"), ({"seed": -1}, "seed"), ({"block_size": 0}, "block_size"),
    ({"num_partitions": 0}, "num_partitions"), ({"partial_batches": "keep"}, "partial_batches"),
    ({"epoch_size": 0}, "epoch_size"), ({"max_tokens": 0}, "max_tokens"), ({"token_window": 0}, "token_window"),
    ({"chunk_samples": 0}, "chunk_samples"), ({"cache_limit": 0}, "cache_limit"), ({"cache_wait": -1}, "cache_wait"),
    ({"shuffle": "no"}, "shuffle"), ({"prefetch": 1}, "prefetch"), ({"token_dtype": "uint16"}, "token_dtype"),
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
    assert (by_keywords.config.seed, by_keywords.config.shuffle_window) == (3, 40)
    assert not hasattr(by_keywords, "seed")  # one place for the options: the config (no generated properties)
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
               "partial_batches": "pad", "max_tokens": 64, "token_window": 100, "skip_samples": (3,)}
    assert set(changes) == set(marked) - {"epoch_size"}  # epoch_size: mixtures only, see the mixture tests
    for name, changed in changes.items():  # every order field is recorded; a change to it refuses the resume
        dataset = StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=1, **{name: changed})
        other = StreamingDataLoader(dataset, batch_size=None if dataset.config.max_tokens else 5)
        with pytest.raises(ValueError, match=f"{name}: saved"):
            other.load_state_dict(saved)
    assert LoaderState.from_dict(saved).to_dict() == saved


def test_bad_topology_and_source_arguments_are_named(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 10, per_shard=10)
    for kwargs, message in [(dict(rank=0, world_size=0), "world_size must be >= 1, got 0"),
                            (dict(rank=-1, world_size=2), "rank must be >= 0"),
                            (dict(local_world_size=0), "local_world_size must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            StreamingDataset(url, cache_dir=str(tmp_path / "c"), **kwargs)
    with pytest.raises(TypeError, match="world_size must be an integer"):
        StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=2.0)
    with pytest.raises(TypeError, match="source must be a dataset URL .*got int 123"):
        StreamingDataset(123)
    with pytest.raises(TypeError, match="source must be"):
        StreamingDataset([])
    assert StreamingDataset(tmp_path / "ds", cache_dir=str(tmp_path / "c")).num_samples == 10  # a Path is a URL


def test_batch_larger_than_the_epoch_is_refused(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 10, per_shard=10)
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"batch_size=6 x world_size=2 is larger than the 10 samples"):
        next(iter(StreamingDataLoader(dataset, batch_size=6)))
    with pytest.raises(ValueError, match="batch_size=11"):
        list(StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=1, batch_size=11))
    padded = StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=2, partial_batches="pad")
    assert len(list(StreamingDataLoader(padded, batch_size=6))) == 1  # padding makes one batch: allowed


def test_state_beyond_the_epoch_is_refused(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 100, per_shard=30)
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=1), 5)
    state = loader.state_dict()
    StreamingDataLoader(loader.dataset, 5).load_state_dict(at(state, 100))  # the end: fine
    with pytest.raises(ValueError, match="position.samples=105 is beyond the end of epoch 0, which holds 100"):
        StreamingDataLoader(loader.dataset, 5).load_state_dict(at(state, 105))
