"""The model a checkpoint records: every `ModelConfig` field, compared on resume field by field, and tied
weights saved once."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardkit.options import option_name
from shardkit.train.checkpoint import Checkpointer, find_latest
from shardkit.train.checkpoint_model import model_differences, model_record, model_to_resume, saved_model_config
from shardkit.train.config import ModelConfig, OptimizerConfig
from shardkit.train.model import Transformer, tied_weights
from shardkit.train.optim import build_optimizer, build_scheduler

BASE = ModelConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)
# Derived from the dataclass: a field added to ModelConfig is checked here without a change to this file.
ARCHITECTURE = [f.name for f in dataclasses.fields(ModelConfig) if not f.metadata.get("resumable_change")]
RESUMABLE = [f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("resumable_change")]


def changed(config: ModelConfig, name: str) -> ModelConfig:
    """`config` with another valid value of field `name` (the first candidate that makes a valid config)."""
    f = next(f for f in dataclasses.fields(ModelConfig) if f.name == name)
    value = getattr(config, name)
    if f.metadata.get("choices"):
        candidates = [choice for choice in f.metadata["choices"] if choice != value]
    elif isinstance(value, bool):
        candidates = [not value]
    elif value is None:
        candidates = [1, 2, 128, 1024]
    else:
        candidates = [value * 2, value + 1, value / 2, 0.5]
    for candidate in candidates:
        try:
            other = dataclasses.replace(config, **{name: type(value)(candidate) if value is not None else candidate})
        except (TypeError, ValueError):
            continue
        if getattr(other, name) != value:
            return other
    raise AssertionError(f"no other valid value found for ModelConfig.{name}: add a candidate to changed()")


def resume_into(saved: ModelConfig, current: ModelConfig, *, from_checkpoint: bool = False) -> ModelConfig:
    return model_to_resume("ckpt", {"model": model_record(saved)}, current, from_checkpoint=from_checkpoint,
                           dataset_vocab=256)


def test_the_record_holds_every_field_and_rebuilds_the_same_config():
    record = model_record(BASE)
    assert set(record) == {f.name for f in dataclasses.fields(ModelConfig)} | {"padded_vocab_size"}
    assert saved_model_config(record, path="ckpt") == BASE


@pytest.mark.parametrize("name", ARCHITECTURE)
def test_every_architecture_field_changed_on_resume_is_refused(name):
    other = changed(BASE, name)
    message = f"{option_name(name)}: checkpoint {getattr(BASE, name)}, this run {getattr(other, name)}"
    with pytest.raises(ValueError, match="saved for another model: .*" + message.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        resume_into(BASE, other)


@pytest.mark.parametrize("name", RESUMABLE)
def test_fields_declared_resumable_may_change(name):
    other = changed(BASE, name)
    if other.padded_vocab_size != BASE.padded_vocab_size:  # the padding multiple: only while the size stays
        other = dataclasses.replace(other, make_vocab_size_divisible_by=64)
    assert resume_into(BASE, other) == other


def test_dropout_is_a_resumable_change():
    assert "dropout" in RESUMABLE


def test_a_checkpoint_saved_before_vocabulary_padding_keeps_its_vocabulary():
    """Its record has no make_vocab_size_divisible_by: it held exactly --vocab-size rows (50257 for GPT-2)."""
    gpt2 = dataclasses.replace(BASE, vocab_size=50257)
    record = {k: v for k, v in model_record(gpt2).items() if k not in ("make_vocab_size_divisible_by",
                                                                         "padded_vocab_size")}
    old = saved_model_config(record, path="ckpt")
    assert old.padded_vocab_size == 50257
    assert model_differences(old, gpt2) == ["padded vocabulary (--vocab-size rounded up to a multiple of "
                                            "--make-vocab-size-divisible-by 1 / 128): checkpoint 50257, this run 50304"]
    assert model_differences(old, dataclasses.replace(gpt2, make_vocab_size_divisible_by=1)) == []


def test_no_model_options_rebuild_the_checkpoints_model_if_it_suits_the_dataset():
    saved = dataclasses.replace(BASE, n_layer=5, rope_theta=500.0, dropout=0.1)
    assert resume_into(saved, BASE, from_checkpoint=True) == saved
    with pytest.raises(ValueError, match="--seq-len: checkpoint 64, the dataset's samples 32"):
        resume_into(dataclasses.replace(saved, seq_len=64), BASE, from_checkpoint=True)
    with pytest.raises(ValueError, match="--vocab-size: checkpoint 100, the dataset's tokenizer 256"):
        resume_into(dataclasses.replace(saved, vocab_size=100), BASE, from_checkpoint=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tied_weights_are_saved_once_and_loaded_into_both_names(tmp_path):
    def state(seed):
        torch.manual_seed(seed)
        model = Transformer(BASE)
        optimizer = build_optimizer(model, OptimizerConfig(warmup_steps=0))
        return model, optimizer, build_scheduler(optimizer, OptimizerConfig(warmup_steps=0), total_steps=10)

    model, optimizer, scheduler = state(0)
    checkpointer = Checkpointer(tmp_path / "new", rank=0, aliases=tied_weights(BASE))
    checkpointer.save(1, model=model, optimizer=optimizer, scheduler=scheduler, rank_state={}, meta={"world_size": 1})
    saved = dcp.FileSystemReader(str(find_latest(tmp_path / "new"))).read_metadata().state_dict_metadata
    assert "model.tok_emb.weight" in saved and "model.lm_head.weight" not in saved
    # A checkpoint saved before (both names stored) loads too.
    Checkpointer(tmp_path / "old", rank=0).save(1, model=model, optimizer=optimizer, scheduler=scheduler,
                                                 rank_state={}, meta={"world_size": 1})
    for directory in ("new", "old"):
        fresh, fresh_optimizer, fresh_scheduler = state(1)
        checkpointer.load(find_latest(tmp_path / directory), model=fresh, optimizer=fresh_optimizer,
                          scheduler=fresh_scheduler, world_size=1)
        assert fresh.lm_head.weight is fresh.tok_emb.weight
        assert torch.equal(fresh.tok_emb.weight, model.tok_emb.weight), directory
