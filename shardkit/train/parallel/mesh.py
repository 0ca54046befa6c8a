"""The parallel layout: four named mesh dimensions and the `DeviceMesh` they form.

`resolve_dims` is a pure function of the options and the world size, so every invalid layout fails
before any process-group work, with a message naming the option to change. The mesh's dimensions
are ordered outermost first, as torchtitan orders them: pipeline stages talk least (one activation
per micro-batch), tensor-parallel peers most (several collectives per block), so `tp` is innermost
and its ranks are neighbours on one node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardkit.options import option_name
from shardkit.train.config import ModelConfig, ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the four mesh dimensions (product = world size) and the pipeline schedule.

    Attributes:
        dp_replicate: replicas whose gradients are all-reduced.
        dp_shard: ranks that shard parameters, gradients and optimizer state (FSDP2).
        tp: tensor-parallel ranks.
        pp: pipeline stages (ranks along the layer stack).
        pp_schedule: 'gpipe', '1f1b' or 'interleaved1f1b'.
        pp_microbatches: micro-batches per pipeline step.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    local_sgd: bool = False  # --parallel diloco: the dp_replicate replicas train alone between outer syncs

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp > 1 and self.pp_schedule == "interleaved1f1b" else 1

    @property
    def data_parallel(self) -> str:
        """How the dp dims are applied: 'none', 'ddp' (1-D replication), 'fsdp' or 'hsdp' (FSDP2), or
        'diloco' (replicas not wrapped at all: shardkit.train.parallel.diloco synchronises them).

        Replication composed with TP or PP goes through FSDP2's HSDP with shard groups of one
        (DDP does not compose with DTensor parameters nor with pipeline stages)."""
        if self.local_sgd:
            return "diloco"
        if self.dp == 1:
            return "none"
        if self.dp_shard == 1 and self.tp == 1 and self.pp == 1:
            return "ddp"
        return "hsdp" if self.dp_replicate > 1 else "fsdp"

    def describe(self) -> str:
        used = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        return " x ".join(used) or "one process"


def resolve_dims(config: ParallelConfig, *, world_size: int, local_world_size: int, batch_size: int = 1) -> ParallelDims:
    """The mesh sizes for `world_size` ranks, or ValueError naming the option to change."""
    tp, pp = config.tp, config.pp
    replicate, shard = config.dp_replicate, config.dp_shard
    labels = {"dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "tp": "--tp", "pp": "--pp"}
    if replicate is None and shard is None:
        mode = config.parallel
        if mode == "auto":
            mode = "ddp" if tp == 1 and pp == 1 else "fsdp"
        if mode == "none":
            replicate, shard = 1, 1
        elif mode in ("ddp", "diloco"):
            replicate, shard = -1, 1
        elif mode == "fsdp":
            replicate, shard = 1, -1
        else:  # hsdp: shard within a node (or --shard-size ranks), replicate across
            shard = config.shard_size or max(1, local_world_size // (max(tp, 1) * max(pp, 1)))
            replicate = -1
            labels["dp_shard"] = "--shard-size" if config.shard_size else "--parallel hsdp's shard group (ranks per node)"
        if -1 in (tp, pp):  # the dims given explicitly take the rest; data parallelism gets none
            replicate, shard = (1 if replicate == -1 else replicate), (1 if shard == -1 else shard)
    sizes = {"dp_replicate": 1 if replicate is None else replicate, "dp_shard": 1 if shard is None else shard,
             "tp": tp, "pp": pp}
    known = math.prod(size for size in sizes.values() if size != -1)
    options = " x ".join(f"{labels[name]} {size}" for name, size in sizes.items() if size not in (1, -1))
    for name, size in sizes.items():
        if size == -1:
            if world_size % known:
                raise ValueError(f"world size {world_size} is not a multiple of {known} ({options}): "
                                 "change those options or the number of processes")
            sizes[name] = world_size // known
    if math.prod(sizes.values()) != world_size:
        hint = " (--parallel none runs one process; use ddp, fsdp or hsdp)" if config.parallel == "none" else ""
        raise ValueError(f"the mesh {' x '.join(f'{k} {v}' for k, v in sizes.items())} needs "
                         f"{math.prod(sizes.values())} processes but torchrun started {world_size}: "
                         f"change --dp-replicate/--dp-shard/--tp/--pp (one may be -1){hint}")
    if config.parallel == "hsdp" and config.shard_size and sizes["dp_shard"] != config.shard_size:
        raise ValueError(f"--parallel hsdp: world size {world_size} is not a multiple of --shard-size "
                         f"{config.shard_size} times --tp {tp} x --pp {pp}")
    if sizes["pp"] == 1 and config.pp_microbatches not in (None, 1):
        raise ValueError(f"--pp-microbatches {config.pp_microbatches} needs --pp > 1")
    stages = 2 if config.pp_schedule == "interleaved1f1b" else 1
    microbatches = config.pp_microbatches or sizes["pp"] * stages
    if sizes["pp"] > 1 and batch_size % microbatches:
        raise ValueError(f"--batch-size {batch_size} is not a multiple of --pp-microbatches {microbatches}: "
                         "each pipeline micro-batch must hold the same number of samples")
    if sizes["pp"] > 1 and config.pp_schedule == "interleaved1f1b" and microbatches % sizes["pp"]:
        raise ValueError(f"--pp-schedule interleaved1f1b needs --pp-microbatches ({microbatches}) to be a "
                         f"multiple of --pp ({sizes['pp']})")
    if sizes["dp_replicate"] * sizes["dp_shard"] > 1 and config.comm_hook != "none" and (sizes["dp_shard"] > 1 or tp > 1 or pp > 1):
        raise ValueError(f"--comm-hook {config.comm_hook} applies to plain DDP (--dp-replicate only) layouts")
    local_sgd = config.parallel == "diloco"
    if local_sgd and (sizes["dp_shard"] > 1 or sizes["tp"] > 1 or sizes["pp"] > 1):
        raise ValueError("--parallel diloco replicates the whole model on every rank: it does not compose with "
                         "--dp-shard, --tp or --pp yet (drop them)")
    return ParallelDims(**sizes, local_sgd=local_sgd, pp_schedule=config.pp_schedule, pp_microbatches=microbatches if sizes["pp"] > 1 else 1)


def check_model_fits(dims: ParallelDims, model: ModelConfig) -> None:
    """ValueError naming the option when `model` cannot be split as `dims` asks (before building it)."""
    if dims.tp > 1:
        for name, value in (("n_head", model.n_head), ("n_kv_head", model.kv_heads)):
            if value % dims.tp:
                raise ValueError(f"{option_name(name)} {value} is not divisible by --tp {dims.tp}: tensor parallelism "
                                 "splits attention by heads; pick a --tp that divides both")
        if model.hidden_size % dims.tp:
            raise ValueError(f"the MLP width {model.hidden_size} (--d-ff) is not divisible by --tp {dims.tp}")
        if model.seq_len is not None and model.seq_len % dims.tp:
            raise ValueError(f"--seq-len {model.seq_len} is not divisible by --tp {dims.tp}: sequence "
                             "parallelism splits the norms' activations by positions")
        padded = model.padded_vocab_size
        if padded is not None and padded % dims.tp:
            raise ValueError(f"the padded vocabulary {padded} (--vocab-size {model.vocab_size} rounded up to a multiple "
                             f"of --make-vocab-size-divisible-by {model.make_vocab_size_divisible_by}) is not "
                             f"divisible by --tp {dims.tp}: the embedding and loss are split by vocabulary; set "
                             f"--make-vocab-size-divisible-by to a multiple of {dims.tp}")
    if dims.pp > 1:
        stages = dims.pp * dims.stages_per_rank
        if model.n_layer < stages:
            raise ValueError(f"--n-layer {model.n_layer} is smaller than the {stages} pipeline stages "
                             f"(--pp {dims.pp}, --pp-schedule {dims.pp_schedule}): lower --pp")
        if model.document_mask:
            raise ValueError("--document-mask is not supported with --pp > 1 (segment ids do not travel "
                             "between stages)")


def build_mesh(dims: ParallelDims, device_type: str):
    """One `DeviceMesh` over all ranks with the four named dims, plus the flattened 'dp' dim the
    loader and the loss average use."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(getattr(dims, name) for name in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh
