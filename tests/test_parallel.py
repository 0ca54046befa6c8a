"""Process groups and model wrapping with real gloo processes: gradient sync toggling and comm hooks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardkit.train.config import ModelConfig, ParallelConfig
from shardkit.train.model import Transformer
from shardkit.train.parallel import gradient_sync, init_runtime, parallelize
from conftest import free_port

MODEL = ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16)


def wrap_model(model, runtime, config):
    return parallelize(model, runtime, config, param_dtype=None, compile=False, activation_checkpointing=False).model


def _grads(module):
    return torch.cat([p.grad.flatten() for p in module.parameters()])


def _worker(rank: int, port: int, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    runtime = init_runtime(ParallelConfig(parallel="ddp"), device="cpu")
    data = torch.randint(0, 64, (2, 2, 4, 17), generator=torch.Generator().manual_seed(0))  # [rank, micro, B, T]

    def loss(model, micro, r=rank):
        tokens = data[r, micro]
        return torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) / 2

    torch.manual_seed(0)
    reference = Transformer(MODEL)
    for r in range(2):  # the full global batch, computed locally
        for micro in range(2):
            (loss(reference, micro, r) / 2).backward()
    torch.manual_seed(0)
    ddp = wrap_model(Transformer(MODEL), runtime, ParallelConfig(parallel="ddp"))
    with gradient_sync(ddp, "ddp", enabled=False):
        loss(ddp, 0).backward()
    local = _grads(ddp.module).clone()
    gathered = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered, local)
    unsynced_differ = not torch.allclose(gathered[0], gathered[1])
    with gradient_sync(ddp, "ddp", enabled=True):
        loss(ddp, 1).backward()
    synced = _grads(ddp.module)
    hooked = {}
    for hook in ("bf16", "powersgd"):
        torch.manual_seed(0)
        model = wrap_model(Transformer(MODEL), runtime, ParallelConfig(parallel="ddp", comm_hook=hook))
        loss(model, 0).backward()
        hooked[hook] = _grads(model.module)
    torch.manual_seed(0)
    plain = wrap_model(Transformer(MODEL), runtime, ParallelConfig(parallel="ddp"))
    loss(plain, 0).backward()
    results[rank] = {
        "unsynced_differ": unsynced_differ,
        "matches_full_batch": torch.allclose(synced, _grads(reference), rtol=1e-5, atol=1e-7),
        "bf16_close": torch.allclose(hooked["bf16"], _grads(plain.module), rtol=2e-2, atol=1e-4),
        "powersgd_finite": bool(torch.isfinite(hooked["powersgd"]).all()),
    }
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_accumulation_syncs_only_on_the_last_micro_step_and_hooks_work():
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(free_port(), results), nprocs=2, start_method="spawn")
    for rank in range(2):
        assert results[rank] == {"unsynced_differ": True, "matches_full_batch": True, "bf16_close": True,
                                 "powersgd_finite": True}, rank


def test_runtime_rejects_impossible_layouts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--parallel none"):
        init_runtime(ParallelConfig(parallel="none"), device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="--shard-size 4"):  # no divisor: 6 ranks in shard groups of 4
        init_runtime(ParallelConfig(parallel="hsdp", shard_size=4), device="cpu")


def test_single_process_needs_no_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    runtime = init_runtime(ParallelConfig(), device="cpu")
    assert (runtime.mode, runtime.world_size, runtime.distributed) == ("none", 1, False)


WARNS_ON_REJOIN = """
import logging
from shardkit.train.config import ParallelConfig
from shardkit.train.parallel import init_runtime
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
init_runtime(ParallelConfig(), device="cpu")
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher, variable", [("torch.distributed.run", None), ("torch.distributed.run", "1"),
                                                ("shardkit.train.elastic", None)],
                         ids=["torchrun-unset", "torchrun-set", "shardkit-launcher"])
def test_rank_0_warns_when_torchrun_shares_its_store_with_an_elastic_job(tmp_path, launcher, variable):
    """A real torchrun agent (c10d rendezvous, restarts allowed) tells its workers it shares its store; without
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a node that leaves never rejoins, and rank 0 says so naming it.
    `python -m shardkit.train.elastic` is torchrun with the variable set: no warning to forget."""
    import subprocess
    import sys

    script = tmp_path / "runtime.py"
    script.write_text(WARNS_ON_REJOIN)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    if variable:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = variable
    result = subprocess.run([sys.executable, "-m", launcher, "--standalone", "--nproc_per_node", "1",
                             "--max-restarts", "1", str(script)], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "never rejoin" in line]
    if variable or launcher != "torch.distributed.run":
        assert warnings == [], result.stderr
    else:
        assert len(warnings) == 1 and "WARNING" in warnings[0], result.stderr
        assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node" in warnings[0]


def test_a_single_node_run_without_restarts_is_not_warned_about_rejoining(monkeypatch, caplog):
    from shardkit.train.parallel.runtime import warn_if_nodes_cannot_rejoin

    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert not warn_if_nodes_cannot_rejoin()
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert warn_if_nodes_cannot_rejoin()
