"""The parallelism and diloco sections (`--parallel`, `--tp`, `--pp`, `--sync-every`, ...), read by
`shardkit.train.parallel`: the mesh (`mesh.py`, `runtime.py`), the data-parallel wrappers
(`data_parallel.py`, `parallelize.py`) and DiLoCo's outer optimizer (`diloco.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option, option_name
from shardkit.train.config.checks import MAX_PP_MICROBATCHES, check, check_at_most

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp", "hsdp", "diloco")
SYNC_DTYPES = ("fp32", "bf16")
COMM_HOOKS = ("none", "bf16", "powersgd")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is replicated, sharded, split by tensors and by layers over the ranks torchrun starts.

    The ranks form one device mesh (pp, dp_replicate, dp_shard, tp); the product of the four sizes is
    the world size, and one of them may be -1 ("the rest"). See docs/PARALLELISM.md.
    """

    parallel: str = option("auto", "shorthand for the data-parallel dims: 'ddp' (--dp-replicate -1), 'fsdp' "
                           "(--dp-shard -1), 'hsdp' (shard within --shard-size ranks, replicate across), 'diloco' "
                           "(--dp-replicate -1 without gradient sync: local SGD with an outer optimizer, see the "
                           "diloco options), 'none' (no data parallelism), or 'auto' (ddp, or fsdp when --tp/--pp > 1)", choices=PARALLEL_MODES)
    dp_replicate: int | None = option(None, "data-parallel replicas (gradients all-reduced); -1: the rest; "
                                      "default: from --parallel")
    dp_shard: int | None = option(None, "data-parallel ranks that shard parameters, gradients and optimizer "
                                  "state (FSDP2); -1: the rest; default: from --parallel")
    tp: int = option(1, "tensor-parallel ranks: each block's matrices split by heads and columns; -1: the rest")
    pp: int = option(1, "pipeline stages: the block stack split by layer ranges; -1: the rest")
    pp_schedule: str = option("1f1b", "pipeline schedule: 'gpipe', '1f1b', or 'interleaved1f1b' "
                              "(2 stages per rank)", choices=PP_SCHEDULES)
    pp_microbatches: int | None = option(None, "micro-batches per pipeline step (each --batch-size batch is "
                                         "split into them); default: --pp (2 x --pp when interleaved)")
    comm_stats: bool = option(True, "count the bytes each collective kind moves per step (metrics.jsonl); "
                              "a dispatch mode with a little CPU overhead per op")
    comm_hook: str = option("none", "ddp gradient communication: 'none', 'bf16' (compress to bf16) or "
                            "'powersgd' (low-rank)", choices=COMM_HOOKS)
    powersgd_rank: int = option(4, "matrix rank of the PowerSGD approximation")
    shard_size: int | None = option(None, "hsdp: ranks per shard group; default: ranks per node (LOCAL_WORLD_SIZE)")
    backend: str = option("auto", "process-group backend: 'auto' (nccl on GPU, gloo on CPU), 'gloo' or 'nccl'",
                          choices=("auto", "gloo", "nccl"))

    def __post_init__(self) -> None:
        check(self.parallel in PARALLEL_MODES, f"--parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        check(self.comm_hook in COMM_HOOKS, f"--comm-hook must be one of {COMM_HOOKS}, got {self.comm_hook!r}")
        check(self.comm_hook == "none" or self.parallel in ("ddp", "auto"),
               f"--comm-hook {self.comm_hook} applies to --parallel ddp only, not {self.parallel}")
        check(self.powersgd_rank >= 1, f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")
        check(self.shard_size is None or self.shard_size >= 1, f"--shard-size must be >= 1, got {self.shard_size}")
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp}
        for name, size in sizes.items():
            check(size is None or size == -1 or size >= 1, f"{option_name(name)} must be >= 1 or -1 (the rest), got {size}")
        rest = [name for name, size in sizes.items() if size == -1]
        check(len(rest) <= 1, f"only one mesh dimension may be -1 (the rest), got {', '.join('--' + n for n in rest)}")
        check(self.parallel == "auto" or (self.dp_replicate is None and self.dp_shard is None),
               f"--parallel {self.parallel} sets the data-parallel dims itself: drop it (or use --parallel auto) "
               "when giving --dp-replicate/--dp-shard")
        check(self.pp_schedule in PP_SCHEDULES, f"--pp-schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        check(self.pp_microbatches is None or self.pp_microbatches >= 1,
               f"--pp-microbatches must be >= 1, got {self.pp_microbatches}")
        check_at_most("pp-microbatches", self.pp_microbatches, MAX_PP_MICROBATCHES, "micro-batches per step")


@dataclass(frozen=True, kw_only=True)
class DilocoConfig:
    """--parallel diloco: H local steps without gradient communication, then an outer optimizer step
    (SGD with Nesterov momentum) on the rank-averaged parameter change (see docs/PARALLELISM.md)."""

    sync_every: int = option(50, "H: inner optimizer steps between two synchronisations of a fragment")
    outer_lr: float = option(0.7, "outer optimizer learning rate (1 with momentum 0: plain parameter averaging)")
    outer_momentum: float = option(0.9, "outer optimizer momentum")
    outer_nesterov: bool = option(True, "Nesterov momentum in the outer optimizer")
    sync_fragments: int = option(1, "F: split the model into F fragments synchronised at staggered steps "
                                 "(streaming DiLoCo: the peak bandwidth drops by F)")
    sync_dtype: str = option("fp32", "dtype of the pseudo-gradient all-reduce: 'fp32' or 'bf16' (half the bytes)",
                             choices=SYNC_DTYPES)
    sync_delay: int = option(0, "1: launch the outer all-reduce asynchronously and apply it at the next "
                             "synchronisation of the fragment (bounded staleness 1); 0: apply it at once")

    def __post_init__(self) -> None:
        check(self.sync_every >= 1, f"--sync-every must be >= 1, got {self.sync_every}")
        check(self.outer_lr > 0, f"--outer-lr must be positive, got {self.outer_lr}")
        check(0 <= self.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        check(1 <= self.sync_fragments <= self.sync_every,
               f"--sync-fragments must be between 1 and --sync-every ({self.sync_every}), got {self.sync_fragments}")
        check(self.sync_dtype in SYNC_DTYPES, f"--sync-dtype must be one of {SYNC_DTYPES}, got {self.sync_dtype!r}")
        check(self.sync_delay in (0, 1), f"--sync-delay must be 0 or 1, got {self.sync_delay}")

