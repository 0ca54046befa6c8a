"""Parallelism as named mesh dimensions (torchtitan's shape).

- `mesh`: `ParallelDims` from the options (dp_replicate, dp_shard, tp, pp) and the `DeviceMesh`.
- `runtime`: the process group, device and mesh of this process (`init_runtime`).
- `data_parallel`: DDP, FSDP2 and HSDP over the dp dims.
- `tensor`: `apply_tp`, Megatron-style tensor + sequence parallelism.
- `pipeline`: layer ranges balanced by parameters, stages and schedules.
- `parallelize`: composes them in one fixed order into a `ParallelModel`.
"""

from shardkit.train.parallel.data_parallel import bf16_allreduce_hook, gradient_sync, reshard_after_eval, unwrap
from shardkit.train.parallel.mesh import ParallelDims, check_model_fits, resolve_dims
from shardkit.train.parallel.parallelize import ParallelModel, parallelize
from shardkit.train.parallel.runtime import Runtime, close_runtime, init_runtime

__all__ = ["ParallelDims", "ParallelModel", "Runtime", "bf16_allreduce_hook", "check_model_fits", "close_runtime",
           "gradient_sync", "init_runtime", "parallelize", "reshard_after_eval", "resolve_dims", "unwrap"]
