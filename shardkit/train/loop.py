"""The training loop: build everything from a `TrainConfig`, train, evaluate, checkpoint, close.

Reads top to bottom like nanoGPT's train.py: `build` sets up the process group, model, optimizer,
data, checkpoints and metrics (resuming if asked); `train` runs the optimizer steps (each a
`train_step` from `shardkit.train.step`, then one `after_step` for the bookkeeping); `close` ends
the run. Everything that decides the result (init seed, sample order, RNG state) is explicit, so an
interrupted run resumed from its checkpoint repeats the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.manifest import Manifest
from shardkit.metrics import TrainerMetrics
from shardkit.train import rng
from shardkit.train.checkpoint import Checkpointer, find_resumable, read_marker
from shardkit.train.checkpoint_model import model_record, model_to_resume
from shardkit.train.config import ModelConfig, TrainConfig, describe_step, with_step_size
from shardkit.train.step_ranges import format_steps, parse_steps
from shardkit.train.run import Run
from shardkit.train.run_lease import RunLease
from shardkit.train.step import StepResult, skip_step, train_step
from shardkit.train.data import EvalData, TrainStream, check_dataset, check_same_tokens, to_batch
from shardkit.train.metrics import MetricsLogger, PendingSteps, SampleLog, peak_flops, peak_memory_gib
from shardkit.train.parallel.diloco import build_sync
from shardkit.train.model import Transformer, flops_per_token, tied_weights
from shardkit.train.optim import build_optimizer, build_scheduler, lr_factor
from shardkit.train.parallel import Runtime, close_runtime, init_runtime, parallelize
from shardkit.train.precision import PrecisionChoice, build_loss_scaler, choose_precision, device_has_native_bf16

logger = logging.getLogger(__name__)

# On a GPU the loop reads the device's numbers (losses, gradient norms) only at sync points, and that is
# also where the ranks agree on a stop (SIGTERM/SIGINT) and on a finished background checkpoint: at most
# this many steps apart, whatever --log-every is (docs/PARALLELISM.md, "Stopping").
MAX_STEPS_BETWEEN_SYNCS = 10


def default_run_dir(config: TrainConfig) -> Path:
    name = config.data.data.rstrip("/").rsplit("/", 1)[-1] or "data"
    return Path("runs") / f"{config.preset}-{name}"


def build(config: TrainConfig) -> Run:
    """Set up the process group, model, optimizer, data, metrics and checkpoints; resume if asked."""
    if not config.data.data:
        raise ValueError("--data is required: the URL of a shardkit dataset (a prefix holding shardkit.json)")
    check_metrics_ports(config.logging.metrics_port, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # The start-up milestones are logged (with the time) so that a restart's cost can be split by phase
    # (benchmarks/bench_goodput.py reads them): imports end here, the process group, data, model and
    # checkpoint follow.
    logger.info("setting up the run: process group, data, model, checkpoint")
    runtime = init_runtime(config.parallelism, device=config.training.device, batch_size=config.data.batch_size)
    data, eval_data, manifest = _open_data(config, runtime)
    run_dir = Path(config.logging.run_dir) if config.logging.run_dir else default_run_dir(config)
    checkpoint_dir = Path(config.checkpoint.checkpoint_dir or run_dir / "checkpoints")
    # Before a checkpoint is chosen: an older job still writing this run directory stops at its next sync point,
    # before it prunes the checkpoint this one resumes from (run_lease).
    lease = RunLease.take(run_dir) if runtime.is_main else None
    # The checkpoint to resume from is chosen before the model is built: it may say which model to build.
    resume_from = checkpoint_to_resume(config.checkpoint.resume, checkpoint_dir)
    model_config = _model_to_build(config, manifest, resume_from[0])
    precision = choose_precision(config.mixed_precision.precision, device_type=runtime.device.type,
                                 native_bf16=device_has_native_bf16(runtime.device))
    # config.json records the precision used; the checks run again on it ('auto' may have chosen fp16).
    config = dataclasses.replace(config, model=model_config, mixed_precision=dataclasses.replace(
        config.mixed_precision, precision=precision.name))
    config = with_step_size(config, seq_len=manifest.seq_len, dp_size=runtime.dp_size)
    # Before the model: a background writer process starts meanwhile (Checkpointer._start_writer).
    checkpointer = Checkpointer(checkpoint_dir, rank=runtime.rank, keep=config.checkpoint.keep,
                                async_save=config.checkpoint.async_save, async_writer=config.checkpoint.async_writer,
                                aliases=tied_weights(model_config))
    run, num_parameters = _build_run(config, runtime, precision, data=data, eval_data=eval_data, run_dir=run_dir,
                                     checkpointer=checkpointer, seq_len=manifest.seq_len)
    run.watch = _trainer_metrics(config, runtime)
    run.lease = lease
    resume(run, *resume_from)
    run.skip_steps = parse_steps(run.config.training.skip_steps)
    if runtime.is_main:
        _write_run_dir(run, num_parameters=num_parameters, seq_len=manifest.seq_len)
    _barrier()
    run.metrics = MetricsLogger(run_dir, is_main=runtime.is_main, total_steps=config.training.steps,
                                log_every=config.logging.log_every, tensorboard=config.logging.tensorboard,
                                resume_step=run.step)
    if run.resumed_step is not None:  # the record tests (and people) check: which checkpoint this run continued
        run.metrics.log({"step": run.step, "resumed_from": run.resumed_path}, echo=False)
    if config.logging.log_sample_ids:
        run.sample_log = SampleLog(run_dir, rank=runtime.rank)
    return run


def _open_data(config: TrainConfig, runtime: Runtime) -> tuple[TrainStream, EvalData | None, Manifest]:
    """The training stream, the evaluation data (None without --eval-data) and the training manifest, checked
    against each other and against --seq-len."""
    # The loaders fetch each manifest once (through the node cache); the checks read theirs.
    data = TrainStream(config.data, runtime, seq_len=config.model.seq_len)
    manifest = check_dataset(data.loader.dataset, seq_len=config.model.seq_len, what="--data")
    eval_data = (EvalData(config.data.eval_data, config.data, runtime, seq_len=config.model.seq_len)
                 if config.data.eval_data else None)
    if eval_data is not None:
        held_out = check_dataset(eval_data.dataset, seq_len=manifest.seq_len, what="--eval-data")
        check_same_tokens(manifest, held_out, what=f"--eval-data {config.data.eval_data}",
                          against=f"--data {config.data.data}")
    logger.info("training data ready: %s", data.loader.source.describe())
    return data, eval_data, manifest


def _model_to_build(config: TrainConfig, manifest: Manifest, checkpoint: Path | None) -> ModelConfig:
    """The model section completed from the dataset (vocabulary, seq_len) and, when resuming, matched with (or
    taken from) the checkpoint's."""
    vocab = manifest.tokenizer.vocab_size
    if config.model.vocab_size is not None and config.model.vocab_size < vocab:
        raise ValueError(f"--vocab-size {config.model.vocab_size} is smaller than the dataset's tokenizer "
                         f"vocabulary ({vocab}); leave it unset (the model pads it, see --make-vocab-size-divisible-by)")
    model_config = dataclasses.replace(config.model, vocab_size=config.model.vocab_size or vocab,
                                       seq_len=manifest.seq_len)
    if checkpoint is None:
        return model_config
    return model_to_resume(checkpoint, read_marker(checkpoint), model_config, dataset_vocab=vocab,
                           from_checkpoint=bool(config.checkpoint.model_from_checkpoint))


def _build_run(config: TrainConfig, runtime: Runtime, precision: PrecisionChoice, *, data: TrainStream, eval_data: EvalData | None,
               run_dir: Path, checkpointer: Checkpointer, seq_len: int) -> tuple[Run, int]:
    """The model (seeded, parallelized), its optimizer, schedule, checkpointer, sync and loss scaler in one `Run`
    (no metrics yet), and the model's parameter count."""
    model_config = config.model
    # Same seed on every rank: identical initial weights without a broadcast (FSDP shards them after).
    torch.manual_seed(config.training.seed)
    model = Transformer(model_config).to(runtime.device)
    num_parameters = model.num_parameters()
    parallel = parallelize(model, runtime, config.parallelism, param_dtype=precision.compute_dtype,
                           compile=config.compile.compile,
                           activation_checkpointing=config.compile.activation_checkpointing,
                           compile_mode=config.compile.compile_mode)
    wrapped = parallel.model
    optimizer = build_optimizer(wrapped, config.optimizer, fused=runtime.device.type == "cuda")
    scheduler = build_scheduler(optimizer, config.optimizer, config.training.steps)
    logger.info("model built and wrapped (%s)", runtime.dims.describe())
    # Dropout draws differ per rank; seeded so that a run is reproducible.
    torch.manual_seed(config.training.seed + 1 + runtime.rank)

    scaling = config.mixed_precision
    run = Run(config=config, runtime=runtime, run_dir=run_dir, model=wrapped, parallel=parallel, optimizer=optimizer,
              scheduler=scheduler, data=data, eval_data=eval_data,
              checkpointer=checkpointer, metrics=None, sample_log=None,  # type: ignore[arg-type]
              precision=precision, flops_per_token=flops_per_token(model_config, num_parameters),
              peak_flops=peak_flops(runtime.device, precision=precision),
              sync=build_sync(wrapped, optimizer, runtime.mode, config.diloco, rank=runtime.rank,
                              world_size=runtime.world_size),
              scaler=build_loss_scaler(precision, device=runtime.device,
                                       agree_over_ranks=runtime.ranks_hold_partial_gradients,
                                       init_scale=scaling.loss_scale,
                                       growth_interval=scaling.loss_scale_growth_interval,
                                       max_overflow_steps=scaling.max_overflow_steps),
              tokens_per_step=config.data.batch_size * seq_len * config.training.grad_accum * runtime.dp_size,
              pending=PendingSteps(runtime.device))
    return run, num_parameters


def _write_run_dir(run: Run, *, num_parameters: int, seq_len: int) -> None:
    """Rank 0: config.json, the sample log's start, and what the run is, in the log."""
    config, runtime, run_dir, precision = run.config, run.runtime, run.run_dir, run.precision
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")
    if config.logging.log_sample_ids:
        SampleLog.truncate_all(run_dir, run.step)
        SampleLog.record_streams(run_dir, run.step, run.data.streams())
    logger.info("%s model, %.2fM parameters, %s on %d rank(s), %s, run dir %s", config.model.style,
                num_parameters / 1e6, runtime.dims.describe(), runtime.world_size, precision.name, run_dir)
    logger.info("precision %s: %s", precision.name, precision.reason)
    logger.info("%s", describe_step(config, seq_len=seq_len, dp_size=runtime.dp_size))


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
    skip_steps = parse_steps(run.config.training.skip_steps) | parse_steps(loaded.meta.get("skip_steps", ""))
    run.config = dataclasses.replace(run.config, training=dataclasses.replace(run.config.training,
                                                                              skip_steps=format_steps(skip_steps)))
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
    logger.info("loader state restored at step %d", run.step)
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
                    run.precision.name, "the loss scale starts at --loss-scale" if run.scaler is not None
                    else "its loss scale is not used")


def _rescale_schedule(run: Run, saved_steps: int | None) -> None:
    """A run resumed with another `--steps` follows the schedule for the new total from its next step on
    (say, a WSD run extended while stable), and says what that does to the learning rate."""
    if saved_steps is None or saved_steps == run.config.training.steps:
        return
    # The optimizer came back holding the old schedule's rate for the next step: replace it now.
    old_lr = run.optimizer.param_groups[0]["lr"]
    factor = lr_factor(run.step, total_steps=run.config.training.steps, config=run.config.optimizer)
    for group, base in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
        group["lr"] = base * factor
    if run.runtime.is_main:
        print(f"--steps changed from {saved_steps} (checkpoint) to {run.config.training.steps}: the learning-rate schedule "
              f"is rescaled to {run.config.training.steps} steps; the next step's lr is {run.optimizer.param_groups[0]['lr']:.3e} "
              f"(the old schedule's: {old_lr:.3e})", flush=True)


def save_checkpoint(run: Run, *, loader_state: dict[str, Any] | None = None) -> None:
    """Save the training state at `run.step`, the loader's state `loader_state` (default: where it stands)."""
    if run.step in (run.resumed_step, run.saved_step):
        return  # nothing trained since the checkpoint this run resumed from or saved last: it is this state
    meta = {"world_size": run.runtime.world_size, "parallel": run.runtime.dims.describe(),
            "model": model_record(run.config.model), "preset": run.config.preset, "steps": run.config.training.steps,
            "skip_steps": run.config.training.skip_steps, "precision": run.precision.name,
            **({"loss_scaler": run.scaler.state_dict()} if run.scaler is not None else {}),
            **run.sync.meta()}
    started, started_cpu = time.perf_counter(), time.thread_time()
    rank_state = {"loader": run.data.state_dict() if loader_state is None else loader_state, "rng": rng.get_state()}
    with run.watch.checkpoint("save"):
        run.checkpointer.save(run.step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                              rank_state=rank_state, meta=meta, extra=run.sync.state_dict())
    run.saved_step = run.step
    # The whole of it, the loader's state included: what a save costs the loop (benchmarks/bench_goodput.py).
    # Its CPU time too: on a loaded host the wall time also counts the seconds the loop was not scheduled.
    logger.info("checkpoint step %d: the save held the loop %.4fs (%.4fs of CPU)", run.step,
                time.perf_counter() - started, time.thread_time() - started_cpu)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
    run.model.train()
    while run.step < run.config.training.steps:
        step = run.step + 1
        result = skip_step(run, step) if step in run.skip_steps else train_step(run, step)
        if result.interrupted:
            return stop_within_step(run, result)
        exit_code = after_step(run, result)
        if exit_code is not None:
            return exit_code
    return finish(run)


def stop_within_step(run: Run, result: StepResult) -> int:
    """A stop signal came during step `result.step`'s accumulation (`shardkit.train.step.stop_asked`): checkpoint
    the last completed step, with the loader where that step left it, and stop. Returns the exit code."""
    sync_point(run)  # the completed steps' records
    if run.step == 0:  # no step completed: there is nothing to save, a rerun starts over
        saved = "no step completed, nothing to save; a rerun starts over"
    else:
        save_checkpoint(run, loader_state=result.loader_state_before)
        saved = f"checkpoint of step {run.step} saved, resume with --resume auto"
    if run.runtime.is_main:
        print(f"stopped by a signal during step {result.step}'s gradient accumulation; {saved}", flush=True)
    return 128 + (run.stop_signal[0] if run.stop_signal else signal.SIGTERM)


def after_step(run: Run, result: StepResult) -> int | None:
    """The bookkeeping after a step: the step count, the outer synchronisation (DiLoCo), the sample log,
    the step's record; at sync points the records, evaluation, a stop, checkpoints. Returns an exit code
    when the run stops here."""
    config, step = run.config, result.step
    run.step = step
    run.sync.after_inner_step(step)
    if run.sample_log is not None:
        run.sample_log.log(step, result.sample_ids, skipped=result.loss is None)
    _add_record(run, result)
    every = config.checkpoint.checkpoint_every
    checkpoint_due = bool(every) and step % every == 0 and step < config.training.steps
    eval_due = run.eval_data is not None and bool(config.training.eval_every) and step % config.training.eval_every == 0
    # One process needs no agreement: it stops after the step the signal came in.
    alone_and_stopped = bool(run.stop_signal) and not run.runtime.distributed
    overflowing = run.scaler is not None and run.scaler.overflows_in_a_row >= run.scaler.max_overflow_steps
    if not (checkpoint_due or eval_due or alone_and_stopped or overflowing or is_sync_point(run)):
        return None
    stop = sync_point(run)
    if run.scaler is not None:
        run.scaler.check(step)
    if eval_due:
        run.metrics.log({"step": step, "eval_loss": evaluate(run)}, echo=True)
    if stop:
        save_checkpoint(run)
        if run.runtime.is_main:
            print(f"stopped by a signal after step {step}; checkpoint saved, resume with --resume auto", flush=True)
        return 128 + (run.stop_signal[0] if run.stop_signal else signal.SIGTERM)
    if checkpoint_due:
        save_checkpoint(run)
    return None


def finish(run: Run) -> int:
    """After the last step: the final checkpoint, then the final evaluation (nothing after training may
    lose the checkpoint). Returns the exit code."""
    config = run.config
    if config.checkpoint.save_final:
        save_checkpoint(run)
    if run.eval_data is not None and (not config.training.eval_every or run.step % config.training.eval_every):
        run.metrics.log({"step": run.step, "eval_loss": evaluate(run)}, echo=True)
    return 0


def _add_record(run: Run, result: StepResult) -> None:
    """The step's record joins the pending ones (written at the next sync point)."""
    if result.loss is None:
        run.pending.add_record({"step": result.step, "skipped": True, "samples": len(result.sample_ids),
                                "time": time.time()})
        return
    extra = run.sync.step_metrics(result.step, run.tokens_per_step) | {"time": time.time()}
    if run.scaler is not None:
        extra |= run.scaler.step_metrics()
    runtime = run.runtime
    run.pending.add({"step": result.step, "lr": result.lr, "step_time": result.seconds,
                     "data_wait": result.data_wait, "tokens": run.tokens_per_step,
                     "world_size": runtime.world_size, "flops_per_token": run.flops_per_token,
                     "peak": run.peak_flops, "memory_gib": peak_memory_gib(runtime.device), "comm": result.comm},
                    loss=result.loss, grad_norm=result.grad_norm, extra=extra)


def is_sync_point(run: Run) -> bool:
    """Whether the loop reads the device's numbers after this step: the first and last steps, and every
    min(--log-every, MAX_STEPS_BETWEEN_SYNCS) steps (also at checkpoints and evaluations, see `after_step`)."""
    step = run.step
    return step in (1, run.config.training.steps) or step % min(run.config.logging.log_every, MAX_STEPS_BETWEEN_SYNCS) == 0


def sync_point(run: Run) -> bool:
    """Read the pending steps' numbers (one all-reduce and one host conversion), write their records,
    complete a background checkpoint every rank has written; returns whether any rank got SIGTERM/SIGINT.
    Stops every rank (ValueError) when another job took over the run directory (`run_lease`)."""
    runtime = run.runtime
    taken_by = run.lease.taken_by() if run.lease is not None else None
    flags = [float(bool(run.stop_signal)), float(run.checkpointer.background_written()), float(taken_by is not None)]
    records, (stopped, written, lease_lost) = run.pending.resolve(flags, world_size=runtime.world_size,
                                                                  distributed=runtime.distributed)
    if lease_lost:  # every rank stops here, before a checkpoint is written, completed or pruned
        run.checkpointer.abandon()
        raise ValueError(run.lease.lost_message(taken_by) if taken_by is not None else
                         "another job took over the run directory (rank 0's log names it); this one stops")
    if run.checkpointer.saving_in_background and written == runtime.world_size:
        run.checkpointer.wait(join=False, agreed=True)
    for record in records:
        if record.get("skipped"):
            run.metrics.log(record, echo=False)
            continue
        run.metrics.log(record)
        run.watch.step(record, tokens=run.tokens_per_step)
    return stopped > 0


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
            with run.runtime.autocast(run.precision.compute_dtype):
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
    """Finish background saves, close the logs, stop the metrics endpoint and leave the process group."""
    if run is not None:
        run.checkpointer.wait()
        if run.watch is not None:
            run.watch.close()
        if run.metrics is not None:
            run.metrics.close()
        if run.sample_log is not None:
            run.sample_log.close()
    close_runtime()

