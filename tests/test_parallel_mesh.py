"""The layout options -> mesh sizes (pure, no process group) and the pipeline's layer split."""

from __future__ import annotations

import pytest

from shardkit.train.config import ModelConfig, ParallelConfig
from shardkit.train.parallel.mesh import ParallelDims, check_model_fits, resolve_dims
from shardkit.train.parallel.pipeline import split_layers, stage_indices


def dims(world_size=4, local_world_size=None, batch_size=8, **options) -> ParallelDims:
    return resolve_dims(ParallelConfig(**options), world_size=world_size,
                        local_world_size=local_world_size or world_size, batch_size=batch_size)


def sizes(d: ParallelDims) -> tuple[int, int, int, int]:
    return d.dp_replicate, d.dp_shard, d.tp, d.pp


def test_shorthands_and_the_rest():
    assert sizes(dims(parallel="ddp")) == (4, 1, 1, 1) and dims(parallel="ddp").data_parallel == "ddp"
    assert sizes(dims(parallel="fsdp")) == (1, 4, 1, 1)
    assert sizes(dims(world_size=8, local_world_size=4, parallel="hsdp")) == (2, 4, 1, 1)
    assert sizes(dims(tp=2)) == (1, 2, 2, 1)  # auto with tp: FSDP over the rest
    assert sizes(dims(tp=2, dp_shard=2)) == (1, 2, 2, 1)
    assert sizes(dims(pp=2, dp_shard=-1)) == (1, 2, 1, 2)
    assert sizes(dims(tp=-1, pp=2)) == (1, 1, 2, 2)
    assert sizes(dims(dp_replicate=2, dp_shard=2)) == (2, 2, 1, 1)
    assert dims(dp_replicate=2, dp_shard=2).data_parallel == "hsdp"
    assert dims(dp_replicate=2, tp=2).data_parallel == "hsdp"  # replication with TP goes through FSDP2
    interleaved = dims(pp=2, dp_shard=2, pp_schedule="interleaved1f1b")
    assert (interleaved.stages_per_rank, interleaved.pp_microbatches) == (2, 4)
    assert dims(world_size=1).data_parallel == "none"


@pytest.mark.parametrize("options, world_size, message", [
    (dict(tp=3), 4, "--tp 3"),
    (dict(tp=2, pp=2, dp_shard=2), 4, "needs 8 processes"),
    (dict(tp=-1, pp=-1), 4, "only one mesh dimension may be -1"),
    (dict(parallel="ddp", dp_shard=2), 4, "--parallel ddp sets the data-parallel dims"),
    (dict(parallel="hsdp", shard_size=4), 6, "--shard-size 4"),
    (dict(parallel="none"), 2, "--parallel none"),
    (dict(tp=0), 4, "--tp must be >= 1"),
    (dict(pp=2, pp_microbatches=3, dp_shard=2), 4, "--pp-microbatches 3"),
    (dict(pp=2, pp_microbatches=2, pp_schedule="interleaved1f1b", dp_shard=1, tp=2), 4, None),
    (dict(pp=4, pp_microbatches=2, pp_schedule="interleaved1f1b"), 4, "multiple of --pp"),
    (dict(pp_microbatches=2), 4, "needs --pp > 1"),
])
def test_invalid_layouts_name_the_option(options, world_size, message):
    if message is None:
        dims(world_size=world_size, **options)
        return
    with pytest.raises(ValueError, match=message):
        dims(world_size=world_size, **options)


@pytest.mark.parametrize("model, layout, message", [
    (ModelConfig(n_head=4, n_kv_head=1), ParallelDims(tp=2, dp_shard=2), "--n-kv-head 1 is not divisible by --tp 2"),
    (ModelConfig(n_head=6, d_model=96), ParallelDims(tp=4), "--n-head 6"),
    (ModelConfig(vocab_size=255, n_head=3, d_model=48, d_ff=96), ParallelDims(tp=3),
     "padded vocabulary 256 .* --make-vocab-size-divisible-by to a multiple of 3"),
    (ModelConfig(seq_len=31), ParallelDims(tp=2), "--seq-len 31"),
    (ModelConfig(n_layer=2, tie_embeddings=False), ParallelDims(pp=2, pp_schedule="interleaved1f1b"), "--n-layer 2"),
])
def test_models_that_do_not_split_are_refused(model, layout, message):
    with pytest.raises(ValueError, match=message):
        check_model_fits(layout, model)
    check_model_fits(ParallelDims(), model)  # fine unsplit


@pytest.mark.parametrize("layout", [ParallelDims(tp=2), ParallelDims(tp=8), ParallelDims(pp=2), ParallelDims(pp=2, tp=2)])
def test_default_model_with_the_gpt2_vocabulary_splits(layout):
    """GPT-2's 50257 tokens (padded to 50304) split over any power-of-two --tp; --pp keeps tied embeddings."""
    check_model_fits(layout, ModelConfig(vocab_size=50257, n_layer=4, n_head=8, seq_len=64))


def test_layer_split_balances_parameters_and_covers_every_layer_once():
    # The first and last stages also hold the embedding and the output projection (3 layers' worth each).
    ranges = split_layers([10] * 8, 2, first_extra=30, last_extra=30)
    assert ranges == [range(0, 4), range(4, 8)]
    ranges = split_layers([10] * 8, 4, first_extra=20, last_extra=0)
    costs = [10 * len(r) + (20 if s == 0 else 0) for s, r in enumerate(ranges)]
    assert ranges[0] == range(0, 1) and max(costs) == 30  # the optimum: no stage above 30
    for stages in range(1, 9):
        ranges = split_layers([3, 1, 4, 1, 5, 9, 2, 6], stages, first_extra=7, last_extra=5)
        assert [i for r in ranges for i in r] == list(range(8)) and all(len(r) for r in ranges)
    with pytest.raises(ValueError, match="4 layers into 5"):
        split_layers([1] * 4, 5)
    assert stage_indices(ParallelDims(pp=2, pp_schedule="interleaved1f1b"), 1) == [1, 3]
