"""`skip_samples`: the order's inverse, the filtered order, and real loaders on real shards (absent ids, the
rest once per epoch, equal per-rank counts, exact and elastic resume, documents resolved through provenance)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from loader_helpers import VOCAB, fixed_sample, write_fixed
from resume_contract import check_elastic_resume, check_resume, stream_until
from shardkit.loaders.dataloader import StreamingDataLoader
from shardkit.loaders.dataset import StreamingDataset
from shardkit.loaders.order.epochs import epoch_order
from shardkit.formats import write_dataset
from shardkit.loaders.order.epochs import ExcludedOrder
from shardkit.loaders.order.skipping import normalize_skip
from shardkit.manifest import TokenizerInfo

NUM_SAMPLES = 300
SKIP = {0, 3, 50, 51, 52, 200, 299}


@pytest.mark.parametrize("options", [
    dict(), dict(shuffle=False, num_partitions=3), dict(num_partitions=3, shuffle_window=5, epoch=1),
    dict(num_partitions=7, block_size=3, shuffle_window=4, seed=5, epoch=2), dict(num_partitions=40, shuffle_window=3),
])
def test_positions_of_inverts_the_order_and_skipping_removes_exactly_the_ids(options):
    order = epoch_order([10, 0, 7, 13, 1, 9], **options)
    full = order.sample_ids(np.arange(len(order)))
    np.testing.assert_array_equal(order.positions_of(full), np.arange(len(order)))
    skipped = [0, 5, 6, 22, 39]
    filtered = ExcludedOrder(order, order.positions_of(np.array(skipped)))
    assert filtered.num_positions == len(order) - len(skipped)
    np.testing.assert_array_equal(filtered.sample_ids(np.arange(filtered.num_positions)),
                                  full[~np.isin(full, skipped)])
    np.testing.assert_array_equal(filtered.partition_of(np.arange(filtered.num_positions)),
                                  order.partition_of(np.flatnonzero(~np.isin(full, skipped))))


def test_skip_values_normalise_and_bad_ones_name_the_entry():
    # Ranges stay intervals (issue 25 item 6): ids and overlapping or adjacent ranges merge into disjoint runs.
    assert normalize_skip("9, 3-5 web.jsonl#2 3") == ((3, 5), 9, ("web.jsonl", 2))
    assert normalize_skip("10 0-2000000000 6") == ((0, 2000000000),)
    assert normalize_skip([("web.jsonl", 2), 9, np.int64(3), [4, 8]]) == ((3, 9), ("web.jsonl", 2))
    assert normalize_skip([3, 4, 5, 9]) == normalize_skip("3-5,9")  # the expanded form of older states
    for bad, message in (("7-3", "range '7-3'"), ("x", "entry 'x'"), ([-1], "negative"), ([("a", -2)], "entry"),
                         ([(5, 2)], "range 5-2")):
        with pytest.raises(ValueError, match=message):
            normalize_skip(bad)


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("skip") / "ds")
    write_fixed(url, NUM_SAMPLES, per_shard=64)
    return url


def loader(url, rank, world_size, *, batch_size=4, **options):
    dataset = StreamingDataset(url, rank=rank, world_size=world_size, shuffle_window=16, cache_dir=url + "-cache",
                               **options)
    return StreamingDataLoader(dataset, batch_size=batch_size)


def test_skipped_ids_are_absent_the_rest_once_per_epoch_balanced_and_in_the_original_order(dataset_url):
    world, epochs = 3, 2
    per_rank = [stream_until(loader(dataset_url, r, world, skip_samples=SKIP), epochs) for r in range(world)]
    plain = [stream_until(loader(dataset_url, r, world), 1) for r in range(world)]
    assert len({len(batches) for batches in per_rank}) == 1, "ranks got unequal batch counts"
    steps = len(per_rank[0]) // epochs
    kept = NUM_SAMPLES - len(SKIP)
    assert steps == kept // (world * 4) == len(loader(dataset_url, 1, world, skip_samples=SKIP))  # drops kept % 12
    for epoch in range(epochs):
        got = Counter(int(i) for batches in per_rank for b in batches[epoch * steps:(epoch + 1) * steps] for i in b)
        assert not SKIP & set(got) and max(got.values()) == 1 and len(got) == steps * world * 4
    # The order of the rest is the unfiltered order with the skipped ids taken out.
    order = loader(dataset_url, 0, world).dataset.source.order(0, 1)
    full = order.sample_ids(np.arange(order.num_positions))
    kept_order = full[~np.isin(full, list(SKIP))]
    for step in range(steps):
        union = np.sort(np.concatenate([per_rank[r][step] for r in range(world)]))
        np.testing.assert_array_equal(union, np.sort(kept_order[step * world * 4:(step + 1) * world * 4]))
    assert len(plain[0]) == NUM_SAMPLES // (world * 4)


def test_resume_is_exact_and_elastic_with_skipped_samples(dataset_url):
    figures = check_resume(lambda rank, world: loader(dataset_url, rank, world, skip_samples=SKIP), world_size=2)
    assert figures["steps_per_epoch"] == (NUM_SAMPLES - len(SKIP)) // 8
    check_elastic_resume(lambda rank, world: loader(dataset_url, rank, world, skip_samples=SKIP), before=2, after=3)


def test_the_state_records_the_skipped_samples_and_refuses_another_set(dataset_url):
    first = loader(dataset_url, 0, 1, skip_samples=SKIP)
    next(iter(first))
    state = first.state_dict()
    assert state["order"]["skip_samples"] == [0, 3, [50, 52], 200, 299]
    with pytest.raises(ValueError, match=r"skip_samples: saved \(0, 3, \(50, 52\)"):
        loader(dataset_url, 0, 1, skip_samples=SKIP - {3}).load_state_dict(state)
    with pytest.raises(ValueError, match="skip_samples"):
        loader(dataset_url, 0, 1).load_state_dict(state)


def test_documents_are_resolved_through_provenance(tmp_path):
    # fixed_sample: sample i holds documents 2i and 2i + 1 of source 0; document 101 is in sample 50 only.
    url = str(tmp_path / "ds")
    write_dataset(url, (fixed_sample(i, 17) for i in range(100)), seq_len=16, packing="concat", max_samples=32,
                  tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB), sources=("/data/docs.jsonl",))
    dataset = StreamingDataset(url, skip_samples=[("docs.jsonl", 101), ("/data/docs.jsonl", 8), 7],
                               cache_dir=str(tmp_path / "cache"))
    assert dataset.source.skipped_ids().tolist() == [4, 7, 50]
    got = [int(i) for b in StreamingDataLoader(dataset, batch_size=3) for i in b["sample_id"]]
    assert len(got) == len(set(got)) == 96 and not {4, 7, 50} & set(got)  # 97 kept, the drop policy leaves 1
    for entry, message in (((("docs.jsonl", 10**6)), "no sample holds document docs.jsonl#1000000"),
                           ((("other.jsonl", 1)), "source 'other.jsonl' is not an input")):
        with pytest.raises(ValueError, match=message):
            StreamingDataset(url, skip_samples=[entry], cache_dir=str(tmp_path / "cache")).source.skipped_ids()


def test_bad_skip_samples_are_clear_errors(dataset_url):
    with pytest.raises(ValueError, match="sample id 300 is out of range"):
        loader(dataset_url, 0, 1, skip_samples=[300]).dataset.source.skipped_ids()
    with pytest.raises(ValueError, match="not a mixture"):
        from shardkit.loaders.order.mixing import Stream
        StreamingDataset([Stream(dataset_url), Stream(dataset_url)], skip_samples=[1])


def test_the_trainer_takes_skip_samples_as_text():
    from shardkit.train.options import parse_train_args

    config = parse_train_args(["--data", "ds", "--skip-samples", "5,7-9 web.jsonl#3"])
    assert config.data.loader.skip_samples == (5, (7, 9), ("web.jsonl", 3))


def test_a_huge_range_stays_two_numbers_and_is_refused_against_the_epoch(dataset_url):
    """Issue 25 item 6: `--skip-samples 0-2000000000` was expanded into a set before its range check (OOM)."""
    dataset = loader(dataset_url, 0, 1, skip_samples="0-2000000000").dataset
    assert dataset.config.skip_samples == ((0, 2000000000),)
    with pytest.raises(ValueError, match="sample id 2000000000 is out of range: the dataset holds 300 samples"):
        dataset.source.skipped_ids()
    inside = loader(dataset_url, 0, 1, skip_samples="10-289")  # a range the dataset holds: 280 samples leave
    batches = list(inside)
    assert len(batches) == (NUM_SAMPLES - 280) // 4
    assert not {int(i) for b in batches for i in b["sample_id"]} & set(range(10, 290))
    state = inside.state_dict()
    assert state["order"]["skip_samples"] == [[10, 289]]  # the state holds the interval, not 280 ids
