"""Pipeline parallelism with `torch.distributed.pipelining`: the block stack split into stages.

The layers are cut into contiguous ranges whose parameter counts are as even as possible (the first
stage also holds the embedding, the last the final norm and output projection), one stage per rank,
or two per rank for the interleaved 1F1B schedule (stage s on pp rank s mod pp, so each rank holds
an early and a late range and the bubble shrinks by half). Each rank keeps one `Transformer` that
owns only its stages' layers, with the parameter names of the whole model, so optimizer and
checkpoints see the usual names; a `Stage` view per stage runs the forward.

Tied embeddings (Megatron's way): the first stage holds the token embedding, the last the output
projection, each a copy of the one shared matrix. Both copies start equal (broadcast from the first
stage), and after every backward their gradients are summed between the two stages (`TiedEmbedding`),
so the same optimizer update keeps them bitwise equal. The last stage keeps the embedding's module
(never run) beside its output projection, sharing the parameter as the whole model does, so that its
names, optimizer groups and checkpoint entries are the whole model's; a checkpoint stores the matrix once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.train.model import Transformer, forward_layers
from shardkit.train.parallel.mesh import ParallelDims


def split_layers(weights: list[int], stages: int, *, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the largest stage's parameter count.

    Args:
        weights: parameters per layer.
        stages: number of ranges (every range holds at least one layer).
        first_extra, last_extra: parameters the first and last stages hold besides their layers.
    """
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} pipeline stages")
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)

    def cost(start: int, end: int, stage: int) -> int:
        return (prefix[end] - prefix[start] + (first_extra if stage == 0 else 0)
                + (last_extra if stage == stages - 1 else 0))

    # best[s][i]: the smallest largest-stage cost of putting the first i layers into s + 1 stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, i, 0)
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], cost(j, i, s))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, end = [], n
    for s in range(stages - 1, 0, -1):
        bounds.append(range(cut[s][end], end))
        end = cut[s][end]
    bounds.append(range(0, end))
    return bounds[::-1]


def stage_indices(dims: ParallelDims, pp_rank: int) -> list[int]:
    """The stages pp rank `pp_rank` runs: [r], or [r, r + pp] for the interleaved schedule."""
    return [pp_rank + k * dims.pp for k in range(dims.stages_per_rank)]


class Stage(nn.Module):
    """One pipeline stage: a view of the owner's modules for one layer range (it owns no parameters
    of its own; the owner `Transformer` and this view share the same submodules)."""

    def __init__(self, owner: Transformer, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.config = owner.config
        self.sequence_shards = owner.sequence_shards
        self.tok_emb = owner.tok_emb if first else None
        if last and not first and owner.tok_emb is not None:
            # The tied embedding's module, not run here: in this view's tree FSDP sees both users of the
            # shared parameter (a view holding only `lm_head` would leave the owner's embedding stale).
            self.tied_embedding = owner.tok_emb
        self.pos_emb = owner.pos_emb if first else None
        self.drop = owner.drop
        self.rope = owner.rope
        self.blocks = nn.ModuleDict({str(i): owner.blocks[str(i)] for i in layers})
        self.norm = owner.norm if last else None
        self.lm_head = owner.lm_head if last else None
        self.padding_bias = owner.padding_bias if last else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return forward_layers(self, inputs)


def pipeline_split(model: Transformer, dims: ParallelDims, pp_rank: int) -> tuple[Transformer, list[int], list[range]]:
    """Prune `model` (built whole, identically on every rank) to the layers pp rank `pp_rank` runs.

    Returns the pruned owner, its stage indices and every stage's layer range. The views are made
    by `make_stages` after tensor parallelism has replaced the owner's parameters.
    """
    num_stages = dims.pp * dims.stages_per_rank
    per_layer = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    embed = sum(p.numel() for p in model.tok_emb.parameters())
    embed += sum(p.numel() for p in model.pos_emb.parameters()) if model.pos_emb is not None else 0
    head = sum(p.numel() for p in model.norm.parameters()) + model.lm_head.weight.numel()
    ranges = split_layers(per_layer, num_stages, first_extra=embed, last_extra=head)
    mine = stage_indices(dims, pp_rank)
    owned = sorted(i for s in mine for i in ranges[s])
    # ModuleDict keyed by the layer index keeps the names `blocks.N.` of the whole model.
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in owned})
    first, last = 0 in mine, num_stages - 1 in mine
    if not first:
        model.pos_emb = None
        if not (last and model.config.tie_embeddings):  # the last stage keeps a tied embedding's module
            model.tok_emb = None
    if not last:
        model.norm = model.lm_head = None
    return model, mine, ranges


def make_stages(owner: Transformer, mine: list[int], ranges: list[range]) -> list[Stage]:
    last = len(ranges) - 1
    return [Stage(owner, ranges[s], first=s == 0, last=s == last) for s in mine]


def build_schedule(stages: list[nn.Module], indices: list[int], dims: ParallelDims, *, device: torch.device,
                   pp_group, loss_fn) -> Any:
    """The pipeline schedule over this rank's stages (`--pp-schedule`, `--pp-microbatches`).

    Gradients are not rescaled by the schedule (`scale_grads=False`): `loss_fn` divides by the number
    of micro-batches itself, so that gradient accumulation over several `step` calls stays a plain sum.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    num_stages = dims.pp * dims.stages_per_rank
    pipeline_stages = [PipelineStage(stage, index, num_stages, device, group=pp_group)
                       for stage, index in zip(stages, indices)]
    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}
    schedule_class = schedules[dims.pp_schedule]
    if dims.pp_schedule == "interleaved1f1b":
        return schedule_class(pipeline_stages, n_microbatches=dims.pp_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(pipeline_stages[0], n_microbatches=dims.pp_microbatches, loss_fn=loss_fn, scale_grads=False)




def _local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds (a DTensor's local shard, or the tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass
class TiedEmbedding:
    """The embedding matrix the first and last pipeline stages share, and their two-rank process group.

    Attributes:
        owner: this rank's `Transformer` (its `tok_emb.weight` is this stage's copy).
        group: the first-stage rank and the last-stage rank with this rank's coordinates on the other
            mesh dims (so that both hold the same shard of the matrix under FSDP and TP).
        first: whether this rank holds the first stage (else the last).
    """

    owner: nn.Module
    group: Any
    first: bool

    @property
    def weight(self) -> nn.Parameter:
        return self.owner.tok_emb.weight

    def sum_gradients(self) -> None:
        """Add the other stage's gradient to this stage's (after the backward of an optimizer step)."""
        weight, grad = self.weight, self.weight.grad
        if hasattr(grad, "placements") and grad.placements != weight.placements:
            # Under TP the embedding's backward may leave a replicated gradient of the row-split matrix:
            # split it like the matrix (a local slice), so both stages reduce the same shard.
            weight.grad = grad = grad.redistribute(placements=weight.placements)
        dist.all_reduce(_local_shard(grad), group=self.group)

    def broadcast(self) -> None:
        """Copy the first stage's matrix to the last stage's (at start and after a checkpoint load)."""
        with torch.no_grad():
            dist.broadcast(_local_shard(self.weight), group_src=0, group=self.group)


def tie_embedding(owner: Transformer, mesh, mine: list[int], num_stages: int) -> TiedEmbedding | None:
    """The shared embedding of a pipeline with tied embeddings, or None on a middle stage or without tying.

    Collective: every rank creates every first/last pair's group, in the same order."""
    ranks = mesh.mesh  # rank numbers laid out as (pp, dp_replicate, dp_shard, tp)
    pairs = torch.stack([ranks[0].flatten(), ranks[-1].flatten()], dim=1).tolist()
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    first, last = 0 in mine, num_stages - 1 in mine
    if group is None or not (first or last):
        return None
    return TiedEmbedding(owner=owner, group=group, first=first)
