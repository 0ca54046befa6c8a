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
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.metrics import TrainerMetrics
from shardkit.train import faults, rng
from shardkit.train.checkpoint import Checkpointer, find_latest, read_marker
from shardkit.train.config import TrainConfig
from shardkit.train.data import EvalData, TrainStream, check_dataset, to_batch
from shardkit.train.metrics import MetricsLogger, SampleLog, peak_flops, peak_memory_gib, step_metrics
from shardkit.train.model import Transformer, flops_per_token
from shardkit.train.optim import build_optimizer, build_scheduler
from shardkit.train.parallel import (Runtime, close_runtime, gradient_sync, init_runtime, reshard_after_eval,
                                     wrap_model)

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a training run holds while it runs."""

    config: TrainConfig
    runtime: Runtime
    run_dir: Path
    model: torch.nn.Module  # wrapped for the parallel mode
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: TrainStream
    eval_data: EvalData | None
    checkpointer: Checkpointer
    metrics: MetricsLogger
    sample_log: SampleLog | None
    bf16: bool
    flops_per_token: float
    peak_flops: float | None
    step: int = 0
    resumed_step: int | None = None
    stop_signal: list[int] = field(default_factory=list)
    watch: TrainerMetrics | None = None  # Prometheus metrics and the starvation alarm


def default_run_dir(config: TrainConfig) -> Path:
    name = config.data.data.rstrip("/").rsplit("/", 1)[-1] or "data"
    return Path("runs") / f"{config.preset}-{name}"


def build(config: TrainConfig) -> Run:
    """Set up the process group, model, optimizer, data, metrics and checkpoints; resume if asked."""
    if not config.data.data:
        raise ValueError("--data is required: the URL of a shardkit dataset (a prefix holding shardkit.json)")
    runtime = init_runtime(config.parallelism, device=config.device)
    manifest = check_dataset(config.data.data, config.data, seq_len=config.model.seq_len, what="--data")
    if config.data.eval_data:
        check_dataset(config.data.eval_data, config.data, seq_len=manifest.seq_len, what="--eval_data")
    vocab = manifest.tokenizer.vocab_size
    if config.model.vocab_size is not None and config.model.vocab_size < vocab:
        raise ValueError(f"--vocab_size {config.model.vocab_size} is smaller than the dataset's tokenizer "
                         f"vocabulary ({vocab}); leave it unset or raise it (e.g. padded to a multiple of 64)")
    model_config = dataclasses.replace(config.model, vocab_size=config.model.vocab_size or vocab,
                                       seq_len=manifest.seq_len)
    config = dataclasses.replace(config, model=model_config)
    run_dir = Path(config.logging.run_dir) if config.logging.run_dir else default_run_dir(config)
    bf16 = config.precision == "bf16" or (config.precision == "auto" and runtime.device.type == "cuda")

    # Same seed on every rank: identical initial weights without a broadcast (FSDP shards them after).
    torch.manual_seed(config.seed)
    model = Transformer(model_config).to(runtime.device)
    model.activation_checkpointing = config.activation_checkpointing
    num_parameters = model.num_parameters()
    if config.compile:
        for block in model.blocks:
            block.compile()
    wrapped = wrap_model(model, runtime, config.parallelism, bf16=bf16)
    optimizer = build_optimizer(wrapped, config.optimizer, fused=runtime.device.type == "cuda")
    scheduler = build_scheduler(optimizer, config.optimizer, config.steps)
    # Dropout draws differ per rank; seeded so that a run is reproducible.
    torch.manual_seed(config.seed + 1 + runtime.rank)

    checkpoint_dir = Path(config.checkpoint.checkpoint_dir or run_dir / "checkpoints")
    checkpointer = Checkpointer(checkpoint_dir, rank=runtime.rank, keep=config.checkpoint.keep,
                                async_save=config.checkpoint.async_save)
    run = Run(config=config, runtime=runtime, run_dir=run_dir, model=wrapped, optimizer=optimizer,
              scheduler=scheduler, data=TrainStream(config.data, runtime),
              eval_data=EvalData(config.data.eval_data, config.data, runtime) if config.data.eval_data else None,
              checkpointer=checkpointer, metrics=None, sample_log=None, bf16=bf16,  # type: ignore[arg-type]
              flops_per_token=flops_per_token(model_config, num_parameters),
              peak_flops=peak_flops(runtime.device, bf16=bf16))
    run.watch = _trainer_metrics(config, runtime)
    resume(run)
    if runtime.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")
        if config.logging.log_sample_ids:
            SampleLog.truncate_all(run_dir, run.step)
        logger.info("%s model, %.2fM parameters, %s on %d rank(s), %s, run dir %s", model_config.style,
                    num_parameters / 1e6, runtime.mode, runtime.world_size, "bf16" if bf16 else "fp32", run_dir)
    _barrier()
    run.metrics = MetricsLogger(run_dir, is_main=runtime.is_main, total_steps=config.steps,
                                log_every=config.logging.log_every, tensorboard=config.logging.tensorboard,
                                resume_step=run.step)
    if config.logging.log_sample_ids:
        run.sample_log = SampleLog(run_dir, rank=runtime.rank)
    return run


def _trainer_metrics(config: TrainConfig, runtime: Runtime) -> TrainerMetrics:
    log = config.logging
    return TrainerMetrics(rank=runtime.rank, port=log.metrics_port and log.metrics_port + runtime.local_rank,
                          window=log.starvation_window, threshold=log.starvation_threshold, warn=runtime.is_main,
                          num_workers=config.data.num_workers)


def resume(run: Run) -> None:
    """Load the checkpoint `--resume` names ('auto': the newest complete one, if any)."""
    choice = run.config.checkpoint.resume
    if choice == "none":
        return
    path = find_latest(run.checkpointer.directory) if choice == "auto" else Path(choice)
    if path is None:
        return
    saved_model = read_marker(path).get("model", {})
    current = dataclasses.asdict(run.config.model)
    changed = sorted(k for k in ("style", "vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model",
                                 "d_ff", "tie_embeddings") if saved_model.get(k, current[k]) != current[k])
    if changed:
        raise ValueError(f"checkpoint {path} was saved for another model: "
                         + ", ".join(f"--{k} {saved_model[k]} (now {current[k]})" for k in changed)
                         + "; use the same model options or another --checkpoint_dir")
    with run.watch.checkpoint("load"):
        loaded = run.checkpointer.load(path, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                                       world_size=run.runtime.world_size)
    run.step = run.resumed_step = loaded.step
    # The loader state is global (a position in a topology-independent order), so rank 0's state
    # also serves a resumed run with another world size; the loader refuses what it cannot continue.
    run.data.load_state_dict(loaded.rank_state["loader"])
    if loaded.same_topology:
        rng.set_state(loaded.rank_state["rng"])
    elif run.runtime.is_main:
        logger.warning("checkpoint %s was saved by %s ranks, now %d: resharded; RNG streams restart from the seed",
                       path, loaded.meta.get("world_size"), run.runtime.world_size)
    if run.runtime.is_main:
        print(f"resumed from {path} at step {run.step}", flush=True)


def save_checkpoint(run: Run) -> None:
    if run.step == run.resumed_step:
        return  # nothing trained since the checkpoint this run resumed from: it is this state already
    meta = {"world_size": run.runtime.world_size, "parallel": run.runtime.mode,
            "model": dataclasses.asdict(run.config.model), "preset": run.config.preset}
    rank_state = {"loader": run.data.state_dict(), "rng": rng.get_state()}
    with run.watch.checkpoint("save"):
        run.checkpointer.save(run.step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                              rank_state=rank_state, meta=meta)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _autocast(run: Run):
    # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and single-process runs use autocast.
    enabled = run.bf16 and run.runtime.mode not in ("fsdp", "hsdp")
    return torch.autocast(run.runtime.device.type, dtype=torch.bfloat16, enabled=enabled)


def _loss(run: Run, batch, *, reduction: str = "mean") -> torch.Tensor:
    with _autocast(run):
        logits = run.model(batch.inputs, batch.segment_ids)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction=reduction)


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
    tokens_per_step = config.data.batch_size * config.model.seq_len * config.grad_accum * runtime.world_size
    every = config.checkpoint.checkpoint_every
    while run.step < config.steps:
        faults.inject_now("step", run.step + 1, runtime.rank)
        started, data_wait = time.perf_counter(), 0.0
        loss_sum = torch.zeros((), device=runtime.device)
        sample_ids: list[int] = []
        for micro in range(config.grad_accum):
            waited = time.perf_counter()
            batch = to_batch(next(run.data), runtime.device)
            data_wait += time.perf_counter() - waited
            sample_ids += batch.sample_ids
            # Sync gradients only on the last micro-step: earlier ones just accumulate locally.
            with gradient_sync(run.model, runtime.mode, enabled=micro == config.grad_accum - 1):
                loss = _loss(run, batch)
                (loss / config.grad_accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.optimizer.grad_clip or math.inf)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        lr = run.optimizer.param_groups[0]["lr"]
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.step += 1
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
                              peak=run.peak_flops, memory_gib=peak_memory_gib(runtime.device))
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
    if run.eval_data is not None and (not config.eval_every or run.step % config.eval_every):
        run.metrics.log({"step": run.step, "eval_loss": evaluate(run)}, echo=True)
    if config.checkpoint.save_final:
        save_checkpoint(run)
    return 0


def evaluate(run: Run) -> float:
    """Mean loss over the held-out batches, averaged over ranks. Runs under no_grad: a DDP forward
    with grad enabled would expect a backward before the next one."""
    run.model.eval()
    total = torch.zeros(2, device=run.runtime.device, dtype=torch.float64)
    with torch.no_grad():
        for raw in run.eval_data.batches():
            batch = to_batch(raw, run.runtime.device)
            # Summed, not averaged: batches hold different numbers of real (non-padding) targets.
            total[0] += _loss(run, batch, reduction="sum").double()
            total[1] += batch.num_tokens
    reshard_after_eval(run.model, run.runtime.mode)
    run.model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def close(run: Run | None) -> None:
    """Finish background saves, close the logs and leave the process group."""
    if run is not None:
        run.checkpointer.wait()
        if run.metrics is not None:
            run.metrics.close()
        if run.sample_log is not None:
            run.sample_log.close()
    close_runtime()

