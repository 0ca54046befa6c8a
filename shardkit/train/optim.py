"""AdamW (decoupled weight decay on matrices only) or plain SGD, and the learning-rate schedule.

The schedule is a pure function of the step (`lr_factor`), so resuming needs only the step count;
the `LambdaLR` wrapper exists so that the scheduler's state is checkpointed like any other.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardkit.train.config import OptimizerConfig


def lr_factor(step: int, *, total_steps: int, config: OptimizerConfig) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based).

    Warm-up rises linearly from 1/warmup to 1. Then `cosine` falls to `min_lr_ratio` at the last step,
    `wsd` stays at 1 until the final `decay_fraction` of the steps and falls linearly to `min_lr_ratio`,
    and `constant` stays at 1.
    """
    warmup = config.warmup_steps or 0
    if step < warmup:
        return (step + 1) / warmup
    floor = config.min_lr_ratio
    if config.schedule == "constant":
        return 1.0
    if config.schedule == "cosine":
        span = max(1, total_steps - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(config.decay_fraction * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
    return 1.0 - (1 - floor) * progress


def build_optimizer(model: nn.Module, config: OptimizerConfig, *, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW or plain SGD (`--optimizer-name`); weight decay only on parameters with two or more
    dimensions except embeddings.

    Norm gains and biases are not decayed (decaying them only fights the normalisation), nor is the
    embedding table, which with tied weights is also the output projection, as in Llama and OLMo.
    SGD has no momentum: it is the inner optimizer that makes `--parallel diloco` with one local step
    and an outer learning rate of 1 the same algorithm as DDP (see docs/PARALLELISM.md).
    """
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if config.optimizer_name == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=0.0, fused=fused or None)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                             fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps=total_steps, config=config))
