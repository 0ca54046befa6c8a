"""The training loop: build everything from a `TrainConfig`, train, evaluate, checkpoint, close.

Reads top to bottom like nanoGPT's train.py: `build` sets up the process group, model, optimizer,
data, checkpoints and metrics (resuming if asked); `train` runs the optimizer steps; `close` ends
the run. Everything that decides the result (init seed, sample order, RNG state) is explicit, so an
interrupted run resumed from its checkpoint repeats the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.metrics import TrainerMetrics
from shardkit.options import option_name
from shardkit.train import faults, rng
from shardkit.train.checkpoint import Checkpointer, find_resumable, model_record, model_to_resume, read_marker
from shardkit.train.config import TrainConfig, format_steps, parse_steps
from shardkit.train.step_ranges import StepRanges
from shardkit.train.data import EvalData, TrainStream, check_dataset, check_same_tokens, to_batch
from shardkit.train.metrics import (CollectiveCounter, MetricsLogger, SampleLog, peak_flops, peak_memory_gib,
                                    step_metrics)
from shardkit.train.parallel.diloco import NoSync, build_sync
from shardkit.train.model import Transformer, flops_per_token, tied_weights
from shardkit.train.optim import build_optimizer, build_scheduler, lr_factor
from shardkit.train.parallel import ParallelModel, Runtime, close_runtime, init_runtime, parallelize
from shardkit.train.precision import (COMPUTE_DTYPES, FORCED_OVERFLOW_FACTOR, LossScaler, build_loss_scaler,
                                      choose_precision, device_has_native_bf16)

logger = logging.getLogger(__name__)


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
    precision: str  # 'bf16', 'fp16' or 'fp32', resolved from --precision
    flops_per_token: float
    peak_flops: float | None
    sync: NoSync = field(default_factory=NoSync)  # after-step synchronisation (diloco) and comm metering
    step: int = 0
    data_wait: float = 0.0  # seconds the current step waited for batches
    resumed_step: int | None = None
    resumed_path: str | None = None
    saved_step: int | None = None
    stop_signal: list[int] = field(default_factory=list)
    watch: TrainerMetrics | None = None  # Prometheus metrics and the starvation alarm
    skip_steps: StepRanges = StepRanges()  # --skip-steps and those the resumed checkpoint recorded
    scaler: LossScaler | None = None  # fp16's dynamic loss scaling


def default_run_dir(config: TrainConfig) -> Path:
    name = config.data.data.rstrip("/").rsplit("/", 1)[-1] or "data"
    return Path("runs") / f"{config.preset}-{name}"


def build(config: TrainConfig) -> Run:
    """Set up the process group, model, optimizer, data, metrics and checkpoints; resume if asked."""
    if not config.data.data:
        raise ValueError("--data is required: the URL of a shardkit dataset (a prefix holding shardkit.json)")
    check_metrics_ports(config.logging.metrics_port, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    runtime = init_runtime(config.parallelism, device=config.device, batch_size=config.data.batch_size)
    manifest = check_dataset(config.data.data, config.data, seq_len=config.model.seq_len, what="--data")
    if config.data.eval_data:
        held_out = check_dataset(config.data.eval_data, config.data, seq_len=manifest.seq_len, what="--eval-data")
        check_same_tokens(manifest, held_out, what=f"--eval-data {config.data.eval_data}",
                          against=f"--data {config.data.data}")
    vocab = manifest.tokenizer.vocab_size
    if config.model.vocab_size is not None and config.model.vocab_size < vocab:
        raise ValueError(f"--vocab-size {config.model.vocab_size} is smaller than the dataset's tokenizer "
                         f"vocabulary ({vocab}); leave it unset (the model pads it, see --make-vocab-size-divisible-by)")
    model_config = dataclasses.replace(config.model, vocab_size=config.model.vocab_size or vocab,
                                       seq_len=manifest.seq_len)
    run_dir = Path(config.logging.run_dir) if config.logging.run_dir else default_run_dir(config)
    checkpoint_dir = Path(config.checkpoint.checkpoint_dir or run_dir / "checkpoints")
    # The checkpoint to resume from is chosen before the model is built: it may say which model to build.
    resume_from = checkpoint_to_resume(config.checkpoint.resume, checkpoint_dir)
    if resume_from[0] is not None:
        model_config = model_to_resume(resume_from[0], read_marker(resume_from[0]), model_config, dataset_vocab=vocab,
                                       from_checkpoint=bool(config.checkpoint.model_from_checkpoint))
    precision = choose_precision(config.precision, device_type=runtime.device.type,
                                 native_bf16=device_has_native_bf16(runtime.device))
    # config.json records the precision used; the checks run again on it ('auto' may have chosen fp16).
    config = dataclasses.replace(config, model=model_config, precision=precision.name)

    # Same seed on every rank: identical initial weights without a broadcast (FSDP shards them after).
    torch.manual_seed(config.seed)
    model = Transformer(model_config).to(runtime.device)
    num_parameters = model.num_parameters()
    parallel = parallelize(model, runtime, config.parallelism, param_dtype=precision.compute_dtype,
                           compile=config.compile, activation_checkpointing=config.activation_checkpointing,
                           compile_mode=config.compile_mode)
    wrapped = parallel.model
    optimizer = build_optimizer(wrapped, config.optimizer, fused=runtime.device.type == "cuda")
    scheduler = build_scheduler(optimizer, config.optimizer, config.steps)
    # Dropout draws differ per rank; seeded so that a run is reproducible.
    torch.manual_seed(config.seed + 1 + runtime.rank)

    checkpointer = Checkpointer(checkpoint_dir, rank=runtime.rank, keep=config.checkpoint.keep,
                                async_save=config.checkpoint.async_save, aliases=tied_weights(model_config))
    run = Run(config=config, runtime=runtime, run_dir=run_dir, model=wrapped, parallel=parallel, optimizer=optimizer,
              scheduler=scheduler, data=TrainStream(config.data, runtime),
              eval_data=EvalData(config.data.eval_data, config.data, runtime) if config.data.eval_data else None,
              checkpointer=checkpointer, metrics=None, sample_log=None,  # type: ignore[arg-type]
              precision=precision.name, flops_per_token=flops_per_token(model_config, num_parameters),
              peak_flops=peak_flops(runtime.device, precision=precision.name),
              sync=build_sync(wrapped, optimizer, runtime.mode, config.diloco, rank=runtime.rank,
                              world_size=runtime.world_size),
              scaler=build_loss_scaler(precision.name, device=runtime.device, mode=runtime.mode,
                                       sharded=runtime.dims.tp > 1 or runtime.dims.pp > 1,
                                       init_scale=config.loss_scale,
                                       growth_interval=config.loss_scale_growth_interval))
    run.watch = _trainer_metrics(config, runtime)
    resume(run, *resume_from)
    run.skip_steps = parse_steps(run.config.skip_steps)
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(run.config.to_dict(), indent=1) + "\n")
        if config.logging.log_sample_ids:
            SampleLog.truncate_all(run_dir, run.step)
            SampleLog.record_streams(run_dir, run.step, run.data.streams())
        logger.info("%s model, %.2fM parameters, %s on %d rank(s), %s, run dir %s", model_config.style,
                    num_parameters / 1e6, runtime.dims.describe(), runtime.world_size, precision.name, run_dir)
        logger.info("precision %s: %s", precision.name, precision.reason)
    _barrier()
    run.metrics = MetricsLogger(run_dir, is_main=runtime.is_main, total_steps=config.steps,
                                log_every=config.logging.log_every, tensorboard=config.logging.tensorboard,
                                resume_step=run.step)
    if run.resumed_step is not None:  # the record tests (and people) check: which checkpoint this run continued
        run.metrics.log({"step": run.step, "resumed_from": run.resumed_path}, echo=False)
    if config.logging.log_sample_ids:
        run.sample_log = SampleLog(run_dir, rank=runtime.rank)
    return run


def check_metrics_ports(port: int, *, local_ranks: int) -> None:
    """Refuse --metrics-port when a local rank's port (port + local rank) would pass 65535: before any
    process group exists, so that every rank stops with this message instead of one rank failing alone
    and the others in a collective."""
    if port and port + local_ranks - 1 > 65535:
        raise ValueError(f"--metrics-port {port} + local rank goes up to {port + local_ranks - 1} with {local_ranks} "
                         f"ranks on this node, beyond 65535: use --metrics-port {65536 - local_ranks} or lower")


def _trainer_metrics(config: TrainConfig, runtime: Runtime) -> TrainerMetrics:
    log = config.logging
    return TrainerMetrics(rank=runtime.rank, port=log.metrics_port and log.metrics_port + runtime.local_rank,
                          address=log.metrics_address,
                          window=log.starvation_window, threshold=log.starvation_threshold, warn=runtime.is_main,
                          num_workers=config.data.num_workers)


def checkpoint_to_resume(choice: str, directory: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint `--resume` names ('auto': the newest complete one in `directory`, if any; 'none':
    None), and the newer damaged ones skipped with their problem."""
    if choice == "none":
        return None, []
    path, skipped = find_resumable(directory) if choice == "auto" else (Path(choice), [])
    for bad, problem in skipped:
        logger.warning("skipping damaged checkpoint %s: %s", bad, problem)
    if path is None and skipped:
        raise ValueError(f"no valid checkpoint in {directory}: "
                         + "; ".join(f"{bad.name}: {problem}" for bad, problem in skipped)
                         + "; delete them or start over with --resume none")
    return path, skipped


def resume(run: Run, path: Path | None, skipped: list[tuple[Path, str]]) -> None:
    """Load checkpoint `path` (from `checkpoint_to_resume`; None: nothing to resume), whose model
    `model_to_resume` has matched with the run's."""
    if path is None:
        return
    fresh = [{k: v for k, v in group.items() if k != "params"} for group in run.optimizer.param_groups]
    with run.watch.checkpoint("load"):
        loaded = run.checkpointer.load(path, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                                       world_size=run.runtime.world_size,
                                       extra=run.sync.resume_state(read_marker(path)))
    run.parallel.broadcast_tied()  # the two pipeline stages' copies of a tied embedding start equal again
    run.sync.load_state_dict(loaded.extra)
    run.step = run.resumed_step = loaded.step
    # Skipped steps stay skipped: a resume without (or with other) --skip-steps adds the checkpoint's.
    skip_steps = parse_steps(run.config.skip_steps) | parse_steps(loaded.meta.get("skip_steps", ""))
    run.config = dataclasses.replace(run.config, skip_steps=format_steps(skip_steps))
    run.resumed_path = path.name
    _resume_loss_scale(run, loaded.meta)
    _rescale_schedule(run, loaded.meta.get("steps"))
    # This run's hyperparameters win over the checkpoint's (`shardkit tune --sampler pbt` perturbs them on resume).
    run.scheduler.base_lrs = [options["initial_lr"] for options in fresh]
    for group, options, factor in zip(run.optimizer.param_groups, fresh, run.scheduler.lr_lambdas):
        group.update(options, lr=options["initial_lr"] * factor(run.scheduler.last_epoch))
    # The loader state is global (a position in a topology-independent order), so rank 0's state
    # also serves a resumed run with another world size; the loader refuses what it cannot continue.
    run.data.load_state_dict(loaded.rank_state["loader"])
    if loaded.same_topology:
        rng.set_state(loaded.rank_state["rng"])
    elif run.runtime.is_main:
        logger.warning("checkpoint %s was saved by %s ranks, now %d: resharded; RNG streams restart from the seed",
                       path, loaded.meta.get("world_size"), run.runtime.world_size)
    if run.runtime.is_main:
        skipped_note = "".join(f" (skipped damaged {bad.name})" for bad, _ in skipped)
        print(f"resumed from {path} at step {run.step}{skipped_note}", flush=True)


def _resume_loss_scale(run: Run, meta: dict[str, Any]) -> None:
    """fp16 goes on with the checkpoint's loss scale, growth count and skipped-step total (kept in the
    marker, like --skip-steps); a checkpoint of a bf16/fp32 run, or a run that is not fp16, starts afresh."""
    saved = meta.get("loss_scaler")
    if run.scaler is not None and saved is not None:
        run.scaler.load_state_dict(saved)
    elif run.runtime.is_main and (run.scaler is not None or saved is not None):
        logger.info("the checkpoint was saved by a %s run, this run is %s: %s", meta.get("precision", "bf16/fp32"),
                    run.precision, "the loss scale starts at --loss-scale" if run.scaler is not None
                    else "its loss scale is not used")


def _rescale_schedule(run: Run, saved_steps: int | None) -> None:
    """A run resumed with another `--steps` follows the schedule for the new total from its next step on
    (say, a WSD run extended while stable), and says what that does to the learning rate."""
    if saved_steps is None or saved_steps == run.config.steps:
        return
    # The optimizer came back holding the old schedule's rate for the next step: replace it now.
    old_lr = run.optimizer.param_groups[0]["lr"]
    factor = lr_factor(run.step, total_steps=run.config.steps, config=run.config.optimizer)
    for group, base in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
        group["lr"] = base * factor
    if run.runtime.is_main:
        print(f"--steps changed from {saved_steps} (checkpoint) to {run.config.steps}: the learning-rate schedule "
              f"is rescaled to {run.config.steps} steps; the next step's lr is {run.optimizer.param_groups[0]['lr']:.3e} "
              f"(the old schedule's: {old_lr:.3e})", flush=True)


def save_checkpoint(run: Run) -> None:
    if run.step in (run.resumed_step, run.saved_step):
        return  # nothing trained since the checkpoint this run resumed from or saved last: it is this state
    meta = {"world_size": run.runtime.world_size, "parallel": run.runtime.dims.describe(),
            "model": model_record(run.config.model), "preset": run.config.preset, "steps": run.config.steps,
            "skip_steps": run.config.skip_steps, "precision": run.precision,
            **({"loss_scaler": run.scaler.state_dict()} if run.scaler is not None else {}),
            **run.sync.meta()}
    rank_state = {"loader": run.data.state_dict(), "rng": rng.get_state()}
    with run.watch.checkpoint("save"):
        run.checkpointer.save(run.step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                              rank_state=rank_state, meta=meta, extra=run.sync.state_dict())
    run.saved_step = run.step


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _autocast(run: Run):
    # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and single-process runs use autocast.
    dtype = COMPUTE_DTYPES[run.precision]
    enabled = dtype is not None and run.runtime.mode not in ("fsdp", "hsdp")
    return torch.autocast(run.runtime.device.type, dtype=dtype or torch.float32, enabled=enabled)




@contextlib.contextmanager
def _stop_on_signals(run: Run):
    """SIGTERM/SIGINT only set a flag: the loop saves a checkpoint at the end of the current step."""
    def handler(signum, _frame):
        run.stop_signal.append(signum)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def train(run: Run) -> int:
    """Run the optimizer steps from `run.step` to `--steps`. Returns the exit code (0, or 128 + signal)."""
    with _stop_on_signals(run):
        return _train_steps(run)


def _train_steps(run: Run) -> int:
    config, runtime = run.config, run.runtime
    run.model.train()
    # Each data-parallel batch once: tensor and pipeline peers of a dp rank train on the same tokens.
    tokens_per_step = config.data.batch_size * config.model.seq_len * config.grad_accum * runtime.dp_size
    every = config.checkpoint.checkpoint_every
    while run.step < config.steps:
        faults.inject_now("step", run.step + 1, runtime.rank)
        if run.step + 1 in run.skip_steps:
            _skip_step(run)
            continue
        started = time.perf_counter()
        sample_ids: list[int] = []
        # Counts the bytes each collective kind moves in this step's forward, backward and update.
        comm = CollectiveCounter() if config.parallelism.comm_stats and runtime.distributed else contextlib.nullcontext()
        with comm:
            loss_sum, grad_norm, lr = _optimizer_step(run, sample_ids)
        data_wait = run.data_wait
        run.step += 1
        run.sync.after_inner_step(run.step)
        # One all-reduce carries the loss, the data wait, whether any rank got SIGTERM/SIGINT, and how
        # many ranks finished writing a background checkpoint (it completes once all have).
        flags = [data_wait, float(bool(run.stop_signal)), float(run.checkpointer.background_written())]
        summary = torch.cat([(loss_sum / config.grad_accum).reshape(1),
                             torch.tensor(flags, device=runtime.device, dtype=torch.float32)])
        if dist.is_initialized():
            dist.all_reduce(summary)
            summary[:2] /= runtime.world_size
        loss_value, wait_value, stop, written = summary.tolist()
        if run.checkpointer.saving_in_background and written == runtime.world_size:
            run.checkpointer.wait()
        step_time = time.perf_counter() - started
        if run.sample_log is not None:
            run.sample_log.log(run.step, sample_ids)
        record = step_metrics(step=run.step, loss=loss_value, lr=lr, grad_norm=float(grad_norm),
                              step_time=step_time, data_wait=wait_value, tokens=tokens_per_step,
                              world_size=runtime.world_size, flops_per_token=run.flops_per_token,
                              peak=run.peak_flops, memory_gib=peak_memory_gib(runtime.device),
                              comm=comm.record() if isinstance(comm, CollectiveCounter) else None)
        record |= run.sync.step_metrics(run.step, tokens_per_step)
        if run.scaler is not None:
            record |= run.scaler.step_metrics()
        run.metrics.log(record)
        run.watch.step(record, tokens=tokens_per_step)
        if run.eval_data is not None and config.eval_every and run.step % config.eval_every == 0:
            run.metrics.log({"step": run.step, "eval_loss": evaluate(run)}, echo=True)
        if stop:
            save_checkpoint(run)
            if runtime.is_main:
                print(f"stopped by a signal after step {run.step}; checkpoint saved, resume with --resume auto",
                      flush=True)
            return 128 + (run.stop_signal[0] if run.stop_signal else signal.SIGTERM)
        if every and run.step % every == 0 and run.step < config.steps:
            save_checkpoint(run)
    if config.checkpoint.save_final:  # before the final evaluation: nothing after training may lose it
        save_checkpoint(run)
    if run.eval_data is not None and (not config.eval_every or run.step % config.eval_every):
        run.metrics.log({"step": run.step, "eval_loss": evaluate(run)}, echo=True)
    return 0


def _skip_step(run: Run) -> None:
    """--skip-steps: draw this step's batches and drop them (no forward, no update). The step counter and
    the learning-rate schedule advance as if the step were taken, so every other step gets the batch and
    the learning rate it would have had; the sample log keeps the dropped ids, marked skipped."""
    sample_ids: list[int] = []
    for _ in range(run.config.grad_accum):
        sample_ids += next(run.data)["sample_id"].tolist()
    run.step += 1
    _advance_schedule(run)
    run.sync.after_inner_step(run.step)
    if run.sample_log is not None:
        run.sample_log.log(run.step, sample_ids, skipped=True)
    run.metrics.log({"step": run.step, "skipped": True, "samples": len(sample_ids)}, echo=False)
    if run.runtime.is_main:
        print(f"step {run.step:>6}/{run.config.steps} | skipped (--skip-steps): {len(sample_ids)} samples per rank "
              "drawn and dropped", flush=True)
    every = run.config.checkpoint.checkpoint_every
    if every and run.step % every == 0 and run.step < run.config.steps:
        save_checkpoint(run)


def _advance_schedule(run: Run) -> None:
    """Step the learning-rate schedule, also after a step without an update (--skip-steps, an fp16
    overflow): the schedule follows the step count, so every later step keeps its rate."""
    with warnings.catch_warnings():  # torch warns when the schedule moves before any optimizer step
        warnings.simplefilter("ignore", UserWarning)
        run.scheduler.step()


def _loss_scale(run: Run) -> float:
    """What this step's losses are multiplied by before the backward pass: fp16's loss scale (far
    beyond fp16's range when the fault injection asks this step to overflow), else 1."""
    if run.scaler is None:
        return 1.0
    overflow = faults.overflow_now(run.step + 1, run.runtime.rank)
    return run.scaler.scale * (FORCED_OVERFLOW_FACTOR if overflow else 1.0)


def _optimizer_step(run: Run, sample_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The micro-steps of one optimizer step (their sample ids appended to `sample_ids`), gradient
    clipping and the update; returns (summed micro-step losses, grad norm, lr). Under fp16 an
    overflowing step consumes its batches but skips the update (see `LossScaler`)."""
    config = run.config
    run.data_wait = 0.0
    loss_sum = torch.zeros((), device=run.runtime.device)
    loss_scale = _loss_scale(run)
    for micro in range(config.grad_accum):
        waited = time.perf_counter()
        batch = to_batch(next(run.data), run.runtime.device)
        run.data_wait += time.perf_counter() - waited
        sample_ids += batch.sample_ids
        # Sync gradients only on the last micro-step: earlier ones just accumulate locally.
        with _autocast(run):
            loss = run.parallel.forward_backward(batch.inputs, batch.targets, batch.segment_ids,
                                                 scale=loss_scale / config.grad_accum,
                                                 sync=micro == config.grad_accum - 1)
        loss_sum += loss
    if run.scaler is not None:
        run.scaler.unscale_(run.optimizer)  # clip the true gradients
    grad_norm = run.parallel.clip_grad_norm_(config.optimizer.grad_clip or math.inf)
    lr = run.optimizer.param_groups[0]["lr"]
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
    else:
        run.optimizer.step()
    _advance_schedule(run)
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, lr


def evaluate(run: Run) -> float:
    """Mean loss over the held-out batches, averaged over ranks. Runs under no_grad: a DDP forward
    with grad enabled would expect a backward before the next one."""
    batches = _read_eval_batches(run)
    run.model.eval()
    total = torch.zeros(2, device=run.runtime.device, dtype=torch.float64)
    with torch.no_grad():
        for raw in batches:
            batch = to_batch(raw, run.runtime.device)
            # Summed, not averaged: batches hold different numbers of real (non-padding) targets.
            with _autocast(run):
                total[0] += run.parallel.loss(batch.inputs, batch.targets, batch.segment_ids).double()
            total[1] += batch.num_tokens
    run.parallel.reshard_after_eval()
    run.model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _read_eval_batches(run: Run) -> list:
    """Every eval batch of this rank, read before any collective, so that the ranks can agree on a read
    failure (a corrupt or unreachable eval shard) and save the training state before it ends the run."""
    failure: BaseException | None = None
    try:
        batches = list(run.eval_data.batches())
    except Exception as err:  # noqa: BLE001 - re-raised below, once the state is saved
        batches, failure = [], err
    failed = torch.tensor([float(failure is not None)], device=run.runtime.device)
    if dist.is_initialized():
        dist.all_reduce(failed)
    if failed.item():
        logger.error("evaluation at step %d failed to read --eval-data; saving the training state first", run.step)
        save_checkpoint(run)
        if failure is not None:
            raise failure
        raise ValueError(f"evaluation at step {run.step} failed on another rank (its log names the cause); "
                         "the training state is saved")
    return batches


def close(run: Run | None) -> None:
    """Finish background saves, close the logs and leave the process group."""
    if run is not None:
        run.checkpointer.wait()
        if run.metrics is not None:
            run.metrics.close()
        if run.sample_log is not None:
            run.sample_log.close()
    close_runtime()

