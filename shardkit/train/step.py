"""One optimizer step of the training loop: `train_step` (forward and backward over the micro-batches,
clipping, the update) and `skip_step` (--skip-steps), each returning a `StepResult` for the bookkeeping.

Nothing here turns a device number into a Python one: the loss and the gradient norm stay tensors until
the loop's next sync point (see `shardkit.train.loop.after_step`).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardkit.train import faults
from shardkit.train.metrics import CollectiveCounter

from shardkit.train.run import Run

# A stop signal (SIGTERM/SIGINT) that arrives during a long gradient accumulation is honoured between micro-steps:
# at once in one process; several ranks agree on it every this many micro-steps (one small all-reduce), so that
# every rank leaves the step at the same micro-step. A step of at most this many micro-steps ends first.
STOP_CHECK_MICRO_STEPS = 64


@dataclass
class StepResult:
    """What one optimizer step leaves for the bookkeeping; loss and grad norm stay on the device."""

    step: int
    sample_ids: list[int] = field(default_factory=list)
    loss: torch.Tensor | None = None  # the mean over the micro-steps; None: a skipped step (--skip-steps)
    grad_norm: torch.Tensor | None = None
    lr: float = 0.0
    data_wait: float = 0.0  # seconds blocked on the loader
    seconds: float = 0.0
    comm: dict[str, int] | None = None  # bytes per collective kind (`CollectiveCounter`), if counted
    # Left between two micro-steps on a stop signal: the step made no update, and this is the loader's state at
    # its start (what a checkpoint of the last completed step holds).
    interrupted: bool = False
    loader_state_before: dict | None = None


def train_step(run: Run, step: int) -> StepResult:
    """Forward and backward over the step's micro-batches (gradients synced on the last only), gradient
    clipping, the update. Under fp16 an overflowing step consumes its batches but skips the update."""
    faults.inject_now("step", step, run.runtime.rank)
    config = run.config
    result = StepResult(step=step, lr=run.optimizer.param_groups[0]["lr"])
    started = time.perf_counter()
    scale = loss_scale(run, step)
    loss_sum = torch.zeros((), device=run.runtime.device)
    if interruptible(run):
        result.loader_state_before = run.data.state_dict()
    with collective_counter(run) as counter:
        for micro in range(config.training.grad_accum):
            if micro and result.loader_state_before is not None and stop_asked(run, micro):
                run.optimizer.zero_grad(set_to_none=True)  # the partial accumulation is dropped with the step
                result.interrupted = True
                return result
            waited = time.perf_counter()
            batch = next(run.data)  # on the device already (see `TrainStream`): this only waits for the loader
            result.data_wait += time.perf_counter() - waited
            result.sample_ids += batch.sample_ids
            with run.runtime.autocast(run.precision.compute_dtype):
                loss_sum += run.parallel.forward_backward(batch.inputs, batch.targets, batch.segment_ids,
                                                          scale=scale / config.training.grad_accum,
                                                          sync=micro == config.training.grad_accum - 1)
        if run.scaler is not None:
            run.scaler.unscale_(run.optimizer)  # clip the true gradients
        result.grad_norm = run.parallel.clip_grad_norm_(config.optimizer.grad_clip or math.inf)
        if run.scaler is not None:
            run.scaler.step(run.optimizer)
        else:
            run.optimizer.step()
        advance_schedule(run)
        run.optimizer.zero_grad(set_to_none=True)
    result.loss = loss_sum / config.training.grad_accum
    result.comm = counter.record() if counter is not None else None
    result.seconds = time.perf_counter() - started
    return result


def skip_step(run: Run, step: int) -> StepResult:
    """--skip-steps: draw this step's batches and drop them (no forward, no update). The step counter and
    the learning-rate schedule advance as if the step were taken, so every other step gets the batch and
    the learning rate it would have had; the sample log keeps the dropped ids, marked skipped."""
    faults.inject_now("step", step, run.runtime.rank)
    result = StepResult(step=step)
    for _ in range(run.config.training.grad_accum):
        result.sample_ids += next(run.data).sample_ids
    advance_schedule(run)
    if run.runtime.is_main:
        print(f"step {step:>6}/{run.config.training.steps} | skipped (--skip-steps): {len(result.sample_ids)} samples per "
              "rank drawn and dropped", flush=True)
    return result


def interruptible(run: Run) -> bool:
    """Whether a stop signal can end this run's steps between micro-steps (see `STOP_CHECK_MICRO_STEPS`)."""
    limit = STOP_CHECK_MICRO_STEPS if run.runtime.distributed else 1
    return run.config.training.grad_accum > limit


def stop_asked(run: Run, micro: int) -> bool:
    """Whether the step must end before micro-step `micro` (> 0): a stop signal came, on any rank. Several
    ranks ask each other only every `STOP_CHECK_MICRO_STEPS` micro-steps, all at the same ones."""
    if not run.runtime.distributed:
        return bool(run.stop_signal)
    if micro % STOP_CHECK_MICRO_STEPS:
        return False
    flag = torch.tensor([float(bool(run.stop_signal))], device=run.runtime.device)
    dist.all_reduce(flag)
    return flag.item() > 0


def collective_counter(run: Run):
    """Counts the bytes each collective kind moves in a step's forward, backward and update (a context
    whose value is the counter, or None when not counting)."""
    if run.config.parallelism.comm_stats and run.runtime.distributed:
        return CollectiveCounter()
    return contextlib.nullcontext()


def advance_schedule(run: Run) -> None:
    """Step the learning-rate schedule, also after a step without an update (--skip-steps, an fp16
    overflow): the schedule follows the step count, so every later step keeps its rate."""
    with warnings.catch_warnings():  # torch warns when the schedule moves before any optimizer step
        warnings.simplefilter("ignore", UserWarning)
        run.scheduler.step()


def loss_scale(run: Run, step: int) -> float:
    """What this step's losses are multiplied by before the backward pass: fp16's loss scale (far
    beyond fp16's range when the fault injection asks this step to overflow), else 1."""
    if run.scaler is None:
        return 1.0
    return run.scaler.scale * (faults.FORCED_OVERFLOW_FACTOR if faults.overflow_now(step, run.runtime.rank) else 1.0)
