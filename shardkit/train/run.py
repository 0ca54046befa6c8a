"""What a training run holds while it runs: one object that `loop` builds and `step` works on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardkit.metrics import TrainerMetrics
from shardkit.train.checkpoint import Checkpointer
from shardkit.train.config import TrainConfig
from shardkit.train.data import EvalData, TrainStream
from shardkit.train.metrics import MetricsLogger, PendingSteps, SampleLog
from shardkit.train.parallel import ParallelModel, Runtime
from shardkit.train.parallel.diloco import NoSync
from shardkit.train.precision import LossScaler, PrecisionChoice
from shardkit.train.run_lease import RunLease
from shardkit.train.step_ranges import StepRanges


@dataclass
class Run:
    """Everything a training run holds while it runs."""

    config: TrainConfig
    runtime: Runtime
    run_dir: Path
    model: torch.nn.Module  # wrapped for the parallel layout (under pipeline parallelism: this rank's stages)
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: TrainStream
    eval_data: EvalData | None
    checkpointer: Checkpointer
    metrics: MetricsLogger
    sample_log: SampleLog | None
    precision: PrecisionChoice  # resolved from --precision
    flops_per_token: float
    peak_flops: float | None
    sync: NoSync = field(default_factory=NoSync)  # after-step synchronisation (diloco) and comm metering
    step: int = 0
    tokens_per_step: int = 0  # each data-parallel batch once: tensor and pipeline peers train on the same tokens
    pending: PendingSteps | None = None  # the steps since the last sync point, their numbers on the device
    resumed_step: int | None = None
    resumed_path: str | None = None
    saved_step: int | None = None
    stop_signal: list[int] = field(default_factory=list)
    watch: TrainerMetrics | None = None  # Prometheus metrics and the starvation alarm
    skip_steps: StepRanges = StepRanges()  # --skip-steps and those the resumed checkpoint recorded
    scaler: LossScaler | None = None  # fp16's dynamic loss scaling
    lease: RunLease | None = None  # rank 0: this job's lease on the run directory (one job writes it)
