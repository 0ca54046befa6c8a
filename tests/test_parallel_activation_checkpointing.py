"""`apply_ac`: blocks recompute their activations in the backward, gradients are unchanged, and checkpoints
(DCP model and optimizer state, DiLoCo's state) have the same keys with and without it, so a checkpoint saved
with activation checkpointing loads without it and the other way round."""

from __future__ import annotations

import pytest
import torch

from shardkit.train.checkpoint import STATE_DICT_OPTIONS, Checkpointer, find_latest
from shardkit.train.config import DilocoConfig, ModelConfig, OptimizerConfig
from shardkit.train.model import Transformer
from shardkit.train.optim import build_optimizer, build_scheduler
from shardkit.train.parallel.activation_checkpointing import apply_ac
from shardkit.train.parallel.diloco import Diloco

CONFIG = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16)


def make(seed: int, *, ac: bool):
    torch.manual_seed(seed)
    model = Transformer(CONFIG)
    if ac:
        apply_ac(model)
    optimizer = build_optimizer(model, OptimizerConfig(warmup_steps=1))
    return model, optimizer, build_scheduler(optimizer, OptimizerConfig(warmup_steps=1), total_steps=10)


def train(model, optimizer, scheduler, steps: int, seed: int = 7) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (3, 17), generator=gen)
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_blocks_recompute_in_the_backward_and_train_bitwise_alike():
    plain, checkpointed = make(0, ac=False), make(0, ac=True)
    calls = []
    checkpointed[0].blocks[0].attn.q.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    assert train(*checkpointed, 3) == train(*plain, 3)
    assert len(calls) == 6  # forward and recompute, each step
    for a, b in zip(plain[0].state_dict().values(), checkpointed[0].state_dict().values()):
        assert torch.equal(a, b)


def test_state_dict_names_do_not_change():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    plain, checkpointed = make(0, ac=False), make(0, ac=True)
    for state in (plain, checkpointed):
        train(*state, 1)
    assert any("_checkpoint_wrapped_module" in name for name, _ in checkpointed[0].named_parameters())
    assert list(checkpointed[0].state_dict()) == list(plain[0].state_dict())
    model_state, optim_state = get_state_dict(plain[0], plain[1], options=STATE_DICT_OPTIONS)
    ac_model_state, ac_optim_state = get_state_dict(checkpointed[0], checkpointed[1], options=STATE_DICT_OPTIONS)
    assert list(ac_model_state) == list(model_state) and list(ac_optim_state) == list(optim_state)
    diloco = [Diloco(model, DilocoConfig(), world_size=1).names for model, _, _ in (plain, checkpointed)]
    assert diloco[0] == diloco[1]


@pytest.mark.parametrize("saved_with_ac", [True, False])
def test_a_checkpoint_resumes_with_activation_checkpointing_switched(tmp_path, saved_with_ac):
    """Saved after 2 steps with (or without) activation checkpointing, resumed without (or with) it: the next
    steps match the uninterrupted run exactly, so weights and optimizer moments came back."""
    source = make(0, ac=saved_with_ac)
    train(*source, 2)
    checkpointer = Checkpointer(tmp_path, rank=0)
    checkpointer.save(2, model=source[0], optimizer=source[1], scheduler=source[2], rank_state={},
                      meta={"world_size": 1})
    resumed = make(1, ac=not saved_with_ac)
    checkpointer.load(find_latest(tmp_path), model=resumed[0], optimizer=resumed[1], scheduler=resumed[2],
                      world_size=1)
    assert train(*resumed, 2, seed=9) == train(*source, 2, seed=9)


def test_parallelize_applies_it(monkeypatch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from shardkit.train.config import ParallelConfig
    from shardkit.train.parallel import init_runtime, parallelize

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    runtime = init_runtime(ParallelConfig(), device="cpu")
    for ac in (False, True):
        parallel = parallelize(Transformer(CONFIG), runtime, ParallelConfig(), param_dtype=None, compile=False,
                               activation_checkpointing=ac)
        assert [isinstance(block, CheckpointWrapper) for block in parallel.model.blocks] == [ac, ac]
