"""The checkpoint section (`--checkpoint-every`, `--keep`, `--resume`, ...), read by `shardkit.train.checkpoint`
(saves and the choice of the checkpoint to resume from) through the training loop."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option
from shardkit.train.config.checks import check

ASYNC_WRITERS = ("process", "thread")  # what writes a background save (`shardkit.train.checkpoint.Checkpointer`)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """torch.distributed.checkpoint saves of the whole training state."""

    checkpoint_dir: str | None = option(None, "where checkpoints go; default RUN_DIR/checkpoints")
    checkpoint_every: int = option(0, "save every N steps (0: only at the end and on SIGTERM/SIGINT)")
    keep: int = option(3, "keep the newest K complete checkpoints, delete older ones")
    async_save: bool = option(False, "save in the background (dcp.async_save); training continues meanwhile")
    async_writer: str = option("process", "with --async-save: 'process' (DCP's writer process, off the trainer's GIL; "
                               "one process without a process group writes in a thread) or 'thread'",
                               choices=ASYNC_WRITERS)
    resume: str = option("auto", "'auto' (newest complete checkpoint if any), 'none', or a checkpoint directory")
    model_from_checkpoint: bool | None = option(
        None, "on resume, build the model the checkpoint records (as nanoGPT does) and ignore this run's model "
        "options; false: build it from the model options and refuse to resume when an architecture field differs "
        "from the checkpoint's; default: true when neither a model option nor --preset is given, else false")
    save_final: bool = option(True, "save a checkpoint after the last step")

    def __post_init__(self) -> None:
        check(self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        check(self.keep >= 1, f"--keep must be >= 1, got {self.keep}")
        check(self.async_writer in ASYNC_WRITERS,
              f"--async-writer must be one of {ASYNC_WRITERS}, got {self.async_writer!r}")
        check(bool(self.resume), "--resume must be 'auto', 'none' or a checkpoint directory")

