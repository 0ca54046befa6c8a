"""DiLoCo's outer step, fragments and delayed updates on a tiny model whose updates are known, in a
one-process gloo group (real all-reduces); the options that configure it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.train.config import DilocoConfig, config_from_dict
from shardkit.train.parallel.diloco import Diloco, split_fragments


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group()
    finally:
        dist.destroy_process_group()


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2))


def train_known_updates(diloco: Diloco, model: Two, steps: int) -> list[torch.Tensor]:
    """Inner step k moves every parameter by -10**(k-1) from where the replica stands; returns the
    global parameters (a, b concatenated) after each step."""
    history = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(10.0 ** (step - 1))
        diloco.after_inner_step(step)
        history.append(torch.cat([p.flatten() for p in diloco.global_params]).clone())
    return history


def test_sync_every_step_with_unit_outer_lr_is_plain_averaging(group):
    model = Two()
    diloco = Diloco(model, DilocoConfig(sync_every=1, outer_lr=1.0, outer_momentum=0.0), world_size=1, group=group)
    history = train_known_updates(diloco, model, 3)
    assert [h[0].item() for h in history] == [-1.0, -11.0, -111.0]  # every update applied when computed
    assert torch.equal(torch.cat([p.flatten() for p in model.parameters()]), history[-1])  # replica restarts there


def test_delay_applies_the_update_of_the_previous_sync(group):
    model = Two()
    diloco = Diloco(model, DilocoConfig(sync_every=1, outer_lr=1.0, outer_momentum=0.0, sync_delay=1),
                    world_size=1, group=group)
    history = train_known_updates(diloco, model, 4)
    # Sync k applies the pseudo-gradient of sync k-1 (10**(k-2)); sync 1 has nothing to apply yet.
    assert [h[0].item() for h in history] == [0.0, -1.0, -11.0, -111.0]
    # The replica keeps its own work not yet applied (10**3 of sync 4): it stands at global - own, so
    # with one rank and plain averaging it never loses or repeats a step.
    assert diloco.own[0][0].item() == 1000.0
    assert model.a.detach().tolist() == [-1111.0] * 3


def test_delayed_replica_measures_each_round_from_its_restart_point(group):
    """With momentum and H = 2, the pseudo-gradient of a round is only that round's steps (not the
    previous round's again), and the outer optimizer sees exactly the sequence 11, 1100, 110000."""
    model = Two()
    config = DilocoConfig(sync_every=2, outer_lr=0.5, outer_momentum=0.5, outer_nesterov=True, sync_delay=1)
    diloco = Diloco(model, config, world_size=1, group=group)
    history = train_known_updates(diloco, model, 6)
    reference = Two()  # the same outer optimizer fed the expected pseudo-gradients one sync late
    outer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.5, nesterov=True)
    expected = []
    for step, applied in ((2, None), (4, 11.0), (6, 1100.0)):
        if applied is not None:
            for param in reference.parameters():
                param.grad = torch.full_like(param, applied)
            outer.step()
        expected.append(reference.a[0].item())
    assert [history[step - 1][0].item() for step in (2, 4, 6)] == expected
    assert diloco.own[0][0].item() == 110000.0
    assert model.a[0].item() == expected[-1] - 110000.0


def test_outer_nesterov_momentum_and_sync_every_h(group):
    model = Two()
    diloco = Diloco(model, DilocoConfig(sync_every=2, outer_lr=0.5, outer_momentum=0.5, outer_nesterov=True),
                    world_size=1, group=group)
    history = train_known_updates(diloco, model, 4)
    # Steps 1+2 move the replica by 11 -> pseudo-gradient d1 = 11; buf = d1, nesterov step = d1 + 0.5*buf.
    g2 = -0.5 * (11 + 0.5 * 11)
    d2 = 1100.0  # steps 3+4 from the synchronised parameters
    buf = 0.5 * 11 + d2
    g4 = g2 - 0.5 * (d2 + 0.5 * buf)
    assert [h[0].item() for h in history] == [0.0, g2, g2, g4]


def test_fragments_sync_at_staggered_steps_and_bytes_are_counted(group):
    model = Two()
    diloco = Diloco(model, DilocoConfig(sync_every=4, sync_fragments=2, outer_lr=1.0, outer_momentum=0.0,
                                        sync_dtype="bf16"), world_size=1, group=group)
    assert diloco.fragments == [[0], [1]]
    assert [diloco.fragments_due(step) for step in range(1, 9)] == [[], [1], [], [0], [], [1], [], [0]]
    bytes_per_step = []
    for step in range(1, 9):
        diloco.after_inner_step(step)
        bytes_per_step.append(diloco.step_metrics(step, tokens_per_step=10)["comm_bytes"])
    assert bytes_per_step == [0, 2 * 2, 0, 3 * 2, 0, 2 * 2, 0, 3 * 2]  # bf16: 2 bytes per element


def test_checkpointed_state_continues_a_delayed_run_exactly(group):
    """state_dict() completes the all-reduce in flight; a fresh Diloco given that state carries on
    as if never interrupted (what DCP does with these tensors, minus the files)."""
    config = DilocoConfig(sync_every=2, sync_fragments=2, outer_momentum=0.9, sync_delay=1)
    model = Two()
    diloco = Diloco(model, config, world_size=1, group=group)
    reference = train_known_updates(diloco, model, 8)

    model = Two()
    first = Diloco(model, config, world_size=1, group=group)
    train_known_updates(first, model, 3)
    saved = {key: _clone(value) for key, value in first.state_dict().items()}
    resumed_model = Two()
    resumed_model.load_state_dict(model.state_dict())
    second = Diloco(resumed_model, config, world_size=1, group=group)
    target = second.state_dict()
    for name, tensor in _tensors(target):  # DCP loads in place
        tensor.copy_(dict(_tensors(saved))[name])
    target["diloco"]["counters"] = saved["diloco"]["counters"]
    second.load_state_dict(target)
    history = []
    for step in range(4, 9):
        with torch.no_grad():
            for param in resumed_model.parameters():
                param.sub_(10.0 ** (step - 1))
        second.after_inner_step(step)
        history.append(torch.cat([p.flatten() for p in second.global_params]))
    assert all(torch.equal(a, b) for a, b in zip(history, reference[3:]))


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return {k: _clone(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}/{key}")


def test_split_fragments_is_contiguous_balanced_and_complete():
    for sizes, count in (([10] * 8, 4), ([100, 1, 1, 1], 4), ([1, 1, 100, 1, 1], 2), ([5] * 7, 3), ([3], 1)):
        fragments = split_fragments(sizes, count)
        assert len(fragments) == count and all(fragments)
        assert [i for f in fragments for i in f] == list(range(len(sizes)))
    assert split_fragments([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_too_many_fragments_is_refused():
    with pytest.raises(ValueError, match="--sync-fragments 3 is more than the model's 2"):
        Diloco(Two(), DilocoConfig(sync_every=4, sync_fragments=3), world_size=1)


@pytest.mark.parametrize("values, message", [
    ({"parallelism": {"parallel": "ddp"}, "diloco": {"sync_every": 4}}, "apply to --parallel diloco only"),
    ({"parallelism": {"parallel": "diloco"}, "diloco": {"sync_every": 2, "sync_fragments": 3}}, "--sync-fragments"),
    ({"parallelism": {"parallel": "diloco"}, "diloco": {"sync_delay": 2}}, "--sync-delay must be 0 or 1"),
    ({"parallelism": {"parallel": "diloco"}, "diloco": {"sync_dtype": "fp16"}}, "--sync-dtype"),
    ({"optimizer": {"optimizer_name": "lion"}}, "--optimizer-name"),
])
def test_bad_options_name_the_option(values, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(values)


def test_cli_generates_the_diloco_section():
    from shardkit.train.options import parse_train_args

    config = parse_train_args(["--data", "x", "--parallel", "diloco", "--sync-every", "8", "--outer-nesterov", "false",
                               "--sync-fragments", "2", "--sync-dtype", "bf16", "--optimizer-name", "sgd"])
    assert (config.diloco.sync_every, config.diloco.outer_nesterov, config.diloco.sync_fragments,
            config.diloco.sync_dtype, config.optimizer.optimizer_name) == (8, False, 2, "bf16", "sgd")


def test_delayed_run_resumed_at_another_world_size_restarts_replicas_from_the_global_copy(group):
    """The saved replicas and their own pseudo-gradients belong to the old ranks; those pseudo-gradients
    are in the pending averages already, so every new replica starts from the global copy, own zero."""
    config = DilocoConfig(sync_every=2, outer_momentum=0.0, outer_lr=1.0, sync_delay=1)
    model = Two()
    first = Diloco(model, config, world_size=1, group=group)
    train_known_updates(first, model, 4)
    saved = {key: _clone(value) for key, value in first.state_dict().items()}
    assert not torch.equal(model.a.detach(), first.global_params[0])  # the replica is ahead by its own

    resumed_model = Two()
    resumed_model.load_state_dict(model.state_dict())  # what the trainer loads: the saved "model"
    second = Diloco(resumed_model, config, world_size=1, group=group)
    target = second.resume_state({**second.meta(), "world_size": 2})
    assert not any(key.startswith("replica_rank_") for key in target)
    for name, tensor in _tensors(target):
        tensor.copy_(dict(_tensors(saved))[name])
    target["diloco"]["counters"] = saved["diloco"]["counters"]
    second.load_state_dict(target)
    assert torch.equal(resumed_model.a.detach(), second.global_params[0])
    assert torch.equal(resumed_model.b.detach(), second.global_params[1])
    assert all(not own.any() for own in second.own)
    assert torch.equal(second.pending[0], saved["diloco"]["pending"]["0"])  # still applied at the next sync
