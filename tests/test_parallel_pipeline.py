"""Tied embeddings across pipeline stages, with real gloo processes: the first stage's embedding and the last
stage's output projection train as the one shared matrix of a single-process model, and stay bitwise equal."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardkit.train.config import ModelConfig, OptimizerConfig, ParallelConfig
from shardkit.train.model import Transformer
from shardkit.train.optim import build_optimizer
from shardkit.train.parallel import init_runtime, parallelize
from conftest import free_port

# GPT-2's vocabulary (50257, padded to 50304) on a tiny model: the shared matrix dominates the gradient.
MODEL = ModelConfig(vocab_size=50257, seq_len=16, n_layer=2, n_head=2, d_model=16)
STEPS, BATCH, CLIP = 4, 4, 0.25


def _batches():
    tokens = torch.randint(0, MODEL.vocab_size, (STEPS, BATCH, MODEL.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference() -> tuple[list[float], list[float]]:
    """Losses and gradient norms of the same steps in one process (the tied matrix is one parameter)."""
    torch.manual_seed(0)
    model = Transformer(MODEL)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
    losses, norms = [], []
    for inputs, targets in _batches():
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _worker(rank: int, port: int, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    config = ParallelConfig(pp=2, pp_schedule="gpipe")
    runtime = init_runtime(config, device="cpu", batch_size=BATCH)
    torch.manual_seed(0)
    parallel = parallelize(Transformer(MODEL), runtime, config, param_dtype=None, compile=False, activation_checkpointing=False)
    optimizer = build_optimizer(parallel.model, OptimizerConfig(lr=1e-2))
    copy = parallel.model.tok_emb.weight  # rank 1 keeps the embedding's module, tied to its output projection
    assert rank == 0 or parallel.model.lm_head.weight is copy
    if rank == 1:  # a stale copy (as after a load that went wrong): the broadcast restores the first stage's
        with torch.no_grad():
            copy.add_(1.0)
    parallel.broadcast_tied()
    losses, norms, equal = [], [], []
    for inputs, targets in _batches():
        loss = parallel.forward_backward(inputs, targets, None, scale=1.0, sync=True)
        norms.append(parallel.clip_grad_norm_(CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)  # the last stage reports pp x loss, the first 0
        losses.append(loss.item() / 2)
        copies = [torch.empty_like(copy) for _ in range(2)]
        dist.all_gather(copies, copy.detach())
        equal.append(torch.equal(*copies))
    results[rank] = {"losses": losses, "norms": norms, "equal": equal}
    dist.destroy_process_group()


@pytest.mark.slow
def test_pp2_tied_embeddings_train_like_one_process_and_stay_bitwise_equal():
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(free_port(), results), nprocs=2, start_method="spawn")
    losses, norms = _reference()
    for rank in range(2):
        assert results[rank]["equal"] == [True] * STEPS, rank
        assert results[rank]["losses"] == pytest.approx(losses, rel=1e-5), rank
        # The shared matrix's gradient counts once in the clipped norm (and clipping is active).
        assert results[rank]["norms"] == pytest.approx(norms, rel=1e-5), rank
    assert min(norms) > CLIP
