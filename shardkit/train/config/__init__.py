"""Trainer configuration: one frozen, keyword-only dataclass per component, each in the module named for
its section and read by that component, composed into `TrainConfig` (torchtitan's `config/` shape).

=================  ==================  ========================================================================
section            dataclass           read by
=================  ==================  ========================================================================
training           TrainingConfig      the loop (`loop.py`, `step.py`): steps, micro-steps, evaluation, seed
mixed_precision    PrecisionConfig     `precision.py`: the compute dtype and fp16's loss scaling
compile            CompileConfig       `parallel/parallelize.py`, `parallel/compile.py`: torch.compile, AC
model              ModelConfig         `model.py`, `checkpoint.py` (the model a checkpoint records)
data               DataConfig          `data.py`: the training and evaluation loaders (every LoaderConfig field)
optimizer          OptimizerConfig     `optim.py`: the inner optimizer and its learning-rate schedule
parallelism        ParallelConfig      `parallel/`: the device mesh and the data-parallel wrappers
diloco             DilocoConfig        `parallel/diloco.py`: the outer optimizer
checkpoint         CheckpointConfig    `checkpoint.py`: saves, retention, what to resume from
logging            LoggingConfig       `metrics.py` and the sample log: what the run writes and serves
=================  ==================  ========================================================================

Every field carries its help text in `metadata["help"]`; `shardkit.train.options` turns the fields into
command-line options one-to-one (`--lr 3e-4` or `--optimizer.lr 3e-4`), grouped by section in `--help`, so
`--help` is this package's documentation. Checks live in each section's `__post_init__` and name the option to
change; the checks that span sections are `TrainConfig`'s. Field names are unique across sections so that the
short form `--NAME` is never ambiguous.
"""

from shardkit.train.config.checks import (FLOAT32_MAX, FLOAT32_TINY, MAX_BATCH_SIZE, MAX_EVAL_BATCHES,
                                          MAX_GLOBAL_BATCH_TOKENS, MAX_MICRO_STEPS, MAX_NUM_WORKERS, MAX_OVERFLOW_STEPS,
                                          MAX_PARAMETERS, MAX_PP_MICROBATCHES, MAX_STEPS, MAX_VOCAB_MULTIPLE)
from shardkit.train.config.checkpoint import CheckpointConfig
from shardkit.train.config.compile import COMPILE_MODES, CompileConfig
from shardkit.train.config.data import DataConfig, data_entries
from shardkit.train.config.model import MODEL_STYLES, ModelConfig
from shardkit.train.config.observability import LoggingConfig
from shardkit.train.config.optimizer import OPTIMIZERS, SCHEDULES, OptimizerConfig
from shardkit.train.config.parallelism import (COMM_HOOKS, PARALLEL_MODES, PP_SCHEDULES, SYNC_DTYPES, DilocoConfig,
                                               ParallelConfig)
from shardkit.train.config.precision import PRECISIONS, PrecisionConfig
from shardkit.train.config.trainer import (LOOP_SECTIONS, PRESETS, SECTIONS, TrainConfig, describe_step,
                                           with_step_size)
from shardkit.train.config.training import TrainingConfig
from shardkit.train.config.values import build_section, config_from_dict, nest_options, section_options
from shardkit.train.step_ranges import format_steps, parse_steps

__all__ = [
    "COMM_HOOKS", "COMPILE_MODES", "FLOAT32_MAX", "FLOAT32_TINY", "LOOP_SECTIONS", "MAX_BATCH_SIZE",
    "MAX_EVAL_BATCHES", "MAX_GLOBAL_BATCH_TOKENS", "MAX_MICRO_STEPS", "MAX_NUM_WORKERS", "MAX_OVERFLOW_STEPS",
    "MAX_PARAMETERS", "MAX_PP_MICROBATCHES", "MAX_STEPS", "MAX_VOCAB_MULTIPLE", "MODEL_STYLES", "OPTIMIZERS",
    "PARALLEL_MODES", "PP_SCHEDULES", "PRECISIONS", "PRESETS", "SCHEDULES", "SECTIONS", "SYNC_DTYPES",
    "CheckpointConfig", "CompileConfig", "DataConfig", "DilocoConfig", "LoggingConfig", "ModelConfig",
    "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "TrainConfig", "TrainingConfig", "build_section",
    "config_from_dict", "data_entries", "describe_step", "format_steps", "nest_options", "parse_steps",
    "section_options", "with_step_size",
]
