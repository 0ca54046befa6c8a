"""DiLoCo: local SGD with an outer optimizer (Douillard et al. 2023; Streaming DiLoCo, 2025).

Every rank trains its own replica with the inner optimizer and no gradient communication. Every H
(`--sync-every`) inner steps, a fragment of the model is synchronised: each rank's pseudo-gradient
(global - local, the global copy being the parameters of the last synchronisation) is averaged over
the ranks with one all-reduce, the outer optimizer (SGD, Nesterov momentum by default) applies the
average to the global copy, and the replica restarts from the new global parameters.

- Fragments (`--sync-fragments F`): parameters are cut into F contiguous fragments of about equal
  size; fragment f synchronises after the inner steps s with s % H == f*H//F, so at most one
  fragment's bytes are on the wire at a time and the peak bandwidth drops by F.
- Delay (`--sync-delay 1`): the all-reduce of sync k is launched asynchronously on a group of its own
  and overlaps the next H inner steps; the averaged pseudo-gradient of sync k is applied at sync k+1.
  After sync k the global copy is G_k = outer(G_{k-1}, avg delta_{k-1}) and the replica restarts from
  G_k - delta_k: the applied updates of every rank plus its own work of the last H steps, which the
  global copy receives (averaged) one sync later. So a replica misses only the other ranks' last H
  steps (bounded staleness 1), and never loses or repeats its own: delta_{k+1} is measured from that
  restart point. (Restarting from G_k alone would make every replica redo the last H steps, and the
  outer optimizer would then apply nearly the same pseudo-gradient twice: at H = 50 with Nesterov
  momentum that diverged.) This rank's delta_k is per-rank state, checkpointed with its replica.
- Metrics: bytes handed to the collectives this module issues, and the seconds a step waited for them.

`build_sync` returns the object the training loop calls after every optimizer step: `Diloco` for
`--parallel diloco`, a meter over DDP's gradient buckets for `ddp` (so the two report the same
figures), and a no-op otherwise.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.train.config import DilocoConfig
from shardkit.train.parallel.activation_checkpointing import parameter_name

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class NoSync:
    """Modes with nothing to synchronise after a step, or whose communication is not metered."""

    def after_inner_step(self, step: int) -> None:
        pass

    def step_metrics(self, step: int, tokens_per_step: int) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def resume_state(self, saved_meta: dict[str, Any]) -> dict[str, Any]:
        """Nothing to load; a DiLoCo checkpoint is refused: its "model" is one replica (the rank that wrote
        it), not the global parameters, and an outer update may be pending, so continuing it without
        DiLoCo would silently drop the other replicas' work."""
        if saved_meta.get("diloco") is not None:
            raise ValueError("the checkpoint was saved by a --parallel diloco run: its model entry is one rank's "
                             "replica, not the global parameters, and an outer update may be pending; resume it "
                             "with --parallel diloco (the same sync options), or start over with --resume none")
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def meta(self) -> dict[str, Any]:
        return {}


class _Meter(NoSync):
    """Bytes sent and seconds blocked, per step and in total (per rank)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.total_bytes = 0
        self.step_bytes = 0
        self.step_blocked = 0.0

    def step_metrics(self, step: int, tokens_per_step: int) -> dict[str, Any]:
        record = {"comm_bytes": self.step_bytes, "comm_blocked_s": self.step_blocked,
                  # Per rank: this rank's bytes over the tokens this rank trained on.
                  "comm_bytes_per_token": self.total_bytes * self.world_size / (step * tokens_per_step)}
        self.step_bytes, self.step_blocked = 0, 0.0
        return record


class DdpCommMeter(_Meter):
    """Counts what DDP all-reduces: a comm hook that does DDP's own all-reduce (average of the
    gradient bucket) and records the bucket bytes and how long backward waited for the last bucket.

    DDP launches a bucket's all-reduce as soon as its gradients are ready, so most of it overlaps the
    backward pass; the time blocked is from the launch of the last bucket (the end of the backward
    compute) to the completion of every bucket's all-reduce.
    """

    def __init__(self, ddp: nn.Module, world_size: int):
        super().__init__(world_size)
        self._last_launch = 0.0
        self._done = 0.0
        ddp.register_comm_hook(None, self._hook)

    def _hook(self, process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer().div_(group.size())
        self.step_bytes += buffer.numel() * buffer.element_size()
        self.total_bytes += buffer.numel() * buffer.element_size()
        self._last_launch = time.perf_counter()
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def finished(fut):
            self._done = max(self._done, time.perf_counter())
            return fut.value()[0]

        return future.then(finished)

    def after_inner_step(self, step: int) -> None:
        self.step_blocked += max(0.0, self._done - self._last_launch)


class Diloco(_Meter):
    """Global parameters, outer optimizer, fragments and delayed updates of one DiLoCo replica.

    Args:
        model: the (unwrapped) model this rank trains; its parameters are the local replica.
        config: the diloco options.
        world_size: ranks that average their pseudo-gradients.
        rank: this rank (its replica and inner optimizer state are checkpointed under its own key).
        optimizer: the inner optimizer.
        group: process group of the outer all-reduces (a group of its own, so that an all-reduce in
            flight does not hold up the training loop's collectives queued behind it).
    """

    def __init__(self, model: nn.Module, config: DilocoConfig, *, world_size: int, rank: int = 0,
                 optimizer: torch.optim.Optimizer | None = None, group=None):
        super().__init__(world_size)
        self.config = config
        self.group = group
        self.model, self.optimizer, self.rank = model, optimizer, rank
        # Names as without activation checkpointing's wrappers: the state is keyed by them.
        named = [(parameter_name(name), p) for name, p in model.named_parameters() if p.requires_grad]
        if config.sync_fragments > len(named):
            raise ValueError(f"--sync-fragments {config.sync_fragments} is more than the model's "
                             f"{len(named)} parameter tensors; use at most {len(named)}")
        self.names = [name for name, _ in named]
        self.local = [p for _, p in named]
        self.global_params = [p.detach().clone() for p in self.local]
        self.fragments = split_fragments([p.numel() for p in self.local], config.sync_fragments)
        momentum = config.outer_momentum
        # Nesterov needs momentum in torch's SGD; with momentum 0 both are the plain step.
        self.outer = torch.optim.SGD(self.global_params, lr=config.outer_lr, momentum=momentum,
                                     nesterov=config.outer_nesterov and momentum > 0)
        if momentum > 0:
            # Zero buffers give the same first step as torch's lazy clone (0 * m + g == g) and a state
            # of fixed shape, which a checkpoint can load into.
            for param in self.global_params:
                self.outer.state[param]["momentum_buffer"] = torch.zeros_like(param)
        dtype, device = _DTYPES[config.sync_dtype], self.local[0].device
        sizes = [sum(self.local[i].numel() for i in indices) for indices in self.fragments]
        self.pending = ([torch.zeros(size, dtype=dtype, device=device) for size in sizes]
                        if config.sync_delay else [])
        self.has_pending = [False] * len(self.pending)
        self._work: list[Any] = [None] * len(self.pending)
        # Delay only: this rank's own pseudo-gradient of its fragment's last sync, in fp32, not yet in
        # the global copy; the replica stands at global - own after a sync.
        self.own = ([torch.zeros(size, dtype=torch.float32, device=device) for size in sizes]
                    if config.sync_delay else [])

    def offset(self, fragment: int) -> int:
        return fragment * self.config.sync_every // self.config.sync_fragments

    def fragments_due(self, step: int) -> list[int]:
        """Fragments that synchronise after inner step `step` (1-based)."""
        return [f for f in range(len(self.fragments)) if step % self.config.sync_every == self.offset(f)]

    def after_inner_step(self, step: int) -> None:
        for fragment in self.fragments_due(step):
            self.sync(fragment)

    @torch.no_grad()
    def sync(self, fragment: int) -> None:
        indices = self.fragments[fragment]
        # The replica started this round from global - own (own is all zeros without delay).
        start = torch.cat([self.global_params[i].flatten() for i in indices])
        if self.config.sync_delay:
            start = start - self.own[fragment].to(start.dtype)
        delta = start - torch.cat([self.local[i].flatten() for i in indices])
        # Divided before the sum, as DDP does, so that bf16 cannot overflow for many ranks.
        buffer = delta.to(_DTYPES[self.config.sync_dtype], copy=True).div_(self.world_size)
        self.step_bytes += buffer.numel() * buffer.element_size()
        self.total_bytes += buffer.numel() * buffer.element_size()
        if self.config.sync_delay:
            work = self._all_reduce(buffer, async_op=True)
            ready = self._finish(fragment)  # the previous sync's average, if there was one
            self.pending[fragment], self._work[fragment] = buffer, work
            self.has_pending[fragment] = True
            if ready is not None:
                self._outer_step(indices, ready)
            self.own[fragment].copy_(delta)
            self._restart(indices, self.own[fragment])
        else:
            started = time.perf_counter()
            self._all_reduce(buffer, async_op=False)
            self.step_blocked += time.perf_counter() - started
            self._outer_step(indices, buffer)
            self._restart(indices, None)

    def _restart(self, indices: list[int], own: torch.Tensor | None) -> None:
        """Set the fragment's replica parameters to the global copy, minus `own` when given."""
        for i in indices:
            self.local[i].copy_(self.global_params[i])
        if own is not None:
            for i, part in self._parts(indices, own):
                self.local[i].sub_(part.to(self.local[i].dtype))

    def _parts(self, indices: list[int], flat: torch.Tensor):
        """(i, the part of the fragment's flat vector `flat` that is parameter i, shaped like it)."""
        parts = flat.split([self.local[i].numel() for i in indices])
        return [(i, part.view_as(self.local[i])) for i, part in zip(indices, parts)]

    def _all_reduce(self, buffer: torch.Tensor, *, async_op: bool):
        if self.world_size == 1 and not dist.is_initialized():
            return None
        return dist.all_reduce(buffer, group=self.group, async_op=async_op)

    def _finish(self, fragment: int) -> torch.Tensor | None:
        """Wait for the fragment's delayed all-reduce; its averaged pseudo-gradient, or None."""
        if not self.has_pending[fragment]:
            return None
        work = self._work[fragment]
        if work is not None:
            started = time.perf_counter()
            work.wait()
            self.step_blocked += time.perf_counter() - started
            self._work[fragment] = None
        return self.pending[fragment]

    def _outer_step(self, indices: list[int], average: torch.Tensor) -> None:
        for i, part in self._parts(indices, average.float()):
            self.global_params[i].grad = part
        self.outer.step()
        for i in indices:
            self.global_params[i].grad = None

    # Checkpointing: every rank holds the same global parameters, momentum and averaged pending
    # pseudo-gradients (they come out of all-reduces), so DCP keeps one copy of each. The replicas
    # and their inner optimizer states differ between syncs, but DCP keeps one copy of the trainer's
    # "model" and "optim" entries: each rank's own go under `replica_rank_R` as well, with (delay) the
    # rank's own pseudo-gradients not yet in the global copy.
    def state_dict(self) -> dict[str, Any]:
        state = {"diloco": self._shared_state()}
        replica: dict[str, Any] = {}
        if self.optimizer is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict
            replica["model"], replica["optim"] = get_state_dict(self.model, self.optimizer)
        if self.own:
            replica["own"] = {str(f): own for f, own in enumerate(self.own)}
        if replica:
            state[f"replica_rank_{self.rank}"] = replica
        return state

    def _shared_state(self) -> dict[str, Any]:
        for fragment in range(len(self.pending)):
            self._finish(fragment)  # an all-reduce in flight is completed now: same values, earlier
        state = {"global": dict(zip(self.names, self.global_params)),
                 "counters": json.dumps({"has_pending": self.has_pending})}
        if self.config.outer_momentum > 0:
            state["momentum"] = {name: self.outer.state[p]["momentum_buffer"]
                                 for name, p in zip(self.names, self.global_params)}
        if self.pending:
            state["pending"] = {str(f): buffer for f, buffer in enumerate(self.pending)}
        return state

    def meta(self) -> dict[str, Any]:
        return {"diloco": {"sync_fragments": self.config.sync_fragments, "sync_delay": self.config.sync_delay,
                           "sync_dtype": self.config.sync_dtype,
                           "outer_momentum": self.config.outer_momentum > 0}}

    def resume_state(self, saved_meta: dict[str, Any]) -> dict[str, Any]:
        """What to load from a checkpoint whose marker is `saved_meta`: nothing when it was not
        saved by a diloco run (the global copy then starts from the loaded parameters).

        Raises:
            ValueError: it was saved with another fragment layout, delay, sync dtype or momentum.
        """
        saved = saved_meta.get("diloco")
        if saved is None:
            return {}
        current = self.meta()["diloco"]
        changed = sorted(key for key in current if saved.get(key) != current[key])
        if changed:
            raise ValueError("the checkpoint was saved by a diloco run with "
                             + ", ".join(f"{key} {saved.get(key)} (now {current[key]})" for key in changed)
                             + ": resume with the same --sync-fragments, --sync-delay, --sync-dtype and "
                               "--outer-momentum (zero or not)")
        state = self.state_dict()
        replica = f"replica_rank_{self.rank}"
        if replica in state:
            if saved_meta.get("world_size") != self.world_size:
                del state[replica]  # another world size: every replica starts from the saved "model"
            else:  # loaded into copies, then set: the live tensors also receive the "model" entry
                state[replica] = _clone_tensors(state[replica])
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a loaded state (the tensors were loaded in place), or restart the global copy
        from the current parameters when `state` is empty."""
        if not state:
            for global_param, local in zip(self.global_params, self.local):
                global_param.copy_(local)
            return
        counters = json.loads(state["diloco"]["counters"])
        self.has_pending = list(counters["has_pending"])
        replica = state.get(f"replica_rank_{self.rank}")
        if replica is None and self.own:
            # Another world size: the saved replicas are gone, and their own pseudo-gradients are in
            # the pending averages. Every replica restarts from the global copy (nothing counted twice).
            for fragment, indices in enumerate(self.fragments):
                self.own[fragment].zero_()
                self._restart(indices, None)
            return
        if replica is None:
            return
        for fragment, own in enumerate(self.own):
            own.copy_(replica["own"][str(fragment)])
        if "model" in replica:
            from torch.distributed.checkpoint.state_dict import set_state_dict
            set_state_dict(self.model, self.optimizer, model_state_dict=replica["model"],
                           optim_state_dict=replica["optim"])


def _clone_tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _clone_tensors(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_clone_tensors(value) for value in tree]
    return tree


def split_fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Cut parameter indices 0..len(sizes)-1 into `count` contiguous, non-empty runs of about equal
    total size (a pure function of the sizes): a tensor joins the fragment whose share of the total
    holds its midpoint, as long as every later fragment keeps at least one tensor."""
    total, n = sum(sizes), len(sizes)
    fragments, start, before = [], 0, 0  # `before`: total size of the tensors already placed
    for fragment in range(count):
        end, seen = start + 1, before + sizes[start]
        limit = n if fragment == count - 1 else n - (count - 1 - fragment)
        target = total * (fragment + 1) / count
        while end < limit and (fragment == count - 1 or seen + sizes[end] / 2 <= target):
            seen += sizes[end]
            end += 1
        fragments.append(list(range(start, end)))
        start, before = end, seen
    return fragments


def build_sync(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str, config: DilocoConfig, *,
               rank: int, world_size: int) -> NoSync:
    """What the training loop calls after each optimizer step for `mode` (collective in diloco mode:
    every rank creates the outer all-reduce group)."""
    if mode == "diloco":
        group = dist.new_group() if dist.is_initialized() else None
        sync = Diloco(model, config, world_size=world_size, rank=rank, optimizer=optimizer, group=group)
        logger.info("diloco: %d fragment(s) of %s parameters, sync every %d steps, outer lr %g momentum %g%s, "
                    "%s all-reduce, delay %d", len(sync.fragments),
                    "/".join(str(sum(sync.local[i].numel() for i in f)) for f in sync.fragments),
                    config.sync_every, config.outer_lr, config.outer_momentum,
                    " nesterov" if config.outer_nesterov else "", config.sync_dtype, config.sync_delay)
        return sync
    if mode == "ddp" and hasattr(model, "register_comm_hook") and not _has_comm_hook(model):
        return DdpCommMeter(model, world_size)
    return NoSync()


def _has_comm_hook(ddp: nn.Module) -> bool:
    """Whether a comm hook (bf16, PowerSGD) is registered already: DDP takes only one, and those
    runs are not metered."""
    return bool(getattr(ddp, "_comm_hooks", None))
