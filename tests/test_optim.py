"""Learning-rate schedules and the AdamW parameter groups."""

from __future__ import annotations

import pytest
import torch

from shardkit.train.config import ModelConfig, OptimizerConfig
from shardkit.train.model import Transformer
from shardkit.train.optim import build_optimizer, build_scheduler, lr_factor


def factors(schedule: str, steps: int = 100, warmup: int = 10, **extra) -> list[float]:
    config = OptimizerConfig(schedule=schedule, warmup_steps=warmup, min_lr_ratio=0.1, **extra)
    return [lr_factor(s, total_steps=steps, config=config) for s in range(steps)]


def test_warmup_then_cosine():
    f = factors("cosine")
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:10], f[1:10]))
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx(0.1)


def test_warmup_stable_decay():
    f = factors("wsd", decay_fraction=0.2)
    assert f[10:80] == [1.0] * 70
    assert all(a > b for a, b in zip(f[80:], f[81:]))
    assert f[-1] == pytest.approx(0.1)


def test_constant_and_no_warmup():
    assert factors("constant", warmup=0) == [1.0] * 100


def test_scheduler_follows_the_pure_function():
    model = torch.nn.Linear(4, 4)
    config = OptimizerConfig(lr=1e-3, warmup_steps=3)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, total_steps=20)
    for step in range(20):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(step, total_steps=20, config=config))
        optimizer.step()
        scheduler.step()


def test_weight_decay_groups():
    model = Transformer(ModelConfig(vocab_size=50, seq_len=8, n_layer=1, n_head=2, d_model=16))
    decay, no_decay = build_optimizer(model, OptimizerConfig()).param_groups
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert id(model.tok_emb.weight) in ids(no_decay)  # tied embedding / output projection
    assert id(model.blocks[0].attn.q.weight) in ids(decay)
    assert id(model.blocks[0].norm1.weight) in ids(no_decay)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
