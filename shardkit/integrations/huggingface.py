"""transformers `Trainer` (and the accelerate under it) reading a `StreamingDataset`.

The Trainer's own ways of taking an IterableDataset lose data on several ranks: `accelerator.prepare` either
lets rank 0 read and broadcast its share (dispatch_batches) or keeps every world_size-th batch of each rank's
share (IterableDatasetShard), and on resume `skip_first_batches` re-reads the consumed batches through a plain
DataLoader. `ShardkitTrainer` hands the Trainer a loader it does not prepare: every rank reads its own share
once (whatever `dispatch_batches` is), the loader state goes into the Trainer's `checkpoint-N` directories,
and a resume starts from that state instead of re-reading.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers.trainer as trainer_module
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from shardkit.integrations.batches import fixed_length_tokens
from shardkit.integrations.loader_state import LOADER_STATE_FILE, load_loader_state, save_loader_state
from shardkit.loaders.dataloader import StreamingDataLoader
from shardkit.loaders.dataset import StreamingDataset
from shardkit.loaders.state.envelope import position as saved_position

logger = logging.getLogger(__name__)


def causal_lm_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A shardkit batch as a transformers causal-LM batch: `input_ids` and `labels` (the model shifts them)."""
    tokens = fixed_length_tokens(batch)
    return {"input_ids": tokens, "labels": tokens}


class TrainerBatches:
    """What the Trainer iterates: the loader's batches as `input_ids`/`labels`. Not a DataLoader, so
    accelerate never wraps it, and without `set_epoch`: the loader moves through epochs itself.
    `sample_ids(ids)` is called with each batch's `sample_id` as the Trainer takes the batch."""

    def __init__(self, loader: StreamingDataLoader, sample_ids: Callable[[torch.Tensor], None]):
        self.loader = loader
        self.sample_ids = sample_ids

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            self.sample_ids(batch["sample_id"])
            yield causal_lm_batch(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def position(self) -> tuple[int, int]:
        """(epoch, batches of it handed out), an epoch's end counted as the next epoch's start."""
        epoch, samples, global_batch = saved_position(self.loader.state_dict())
        steps = samples // global_batch
        if self.loader.source.endless:
            return 0, steps  # no epoch end (raw text's lanes go on): the Trainer counts one endless epoch
        if steps >= len(self.loader):
            return epoch + 1, 0
        return epoch, steps


class ShardkitTrainer(Trainer):
    """A transformers `Trainer` over a `StreamingDataset`: same arguments, `train_dataset` a `StreamingDataset`.

    Each rank reads `per_device_train_batch_size` samples of its own share per micro-batch
    (`per_device_train_batch_size // world_size` with accelerate's `split_batches=True`). `data_collator` and
    `remove_unused_columns` do not apply: batches come whole, as `input_ids` and `labels`.

    Args:
        on_sample_ids: called as `on_sample_ids(step, ids)` with the optimizer step (from 1) that trains on each
            micro-batch and its `sample_id` (int64 [batch]) as the Trainer takes it (for lineage; also settable
            as an attribute).
        *args, **kwargs: the `Trainer`'s.

    Raises:
        TypeError: `train_dataset` is not a `StreamingDataset` (a `StreamingDataLoader` or a DataLoader around
            the dataset would be wrapped by accelerate, which drops or duplicates a rank-aware share).
        ValueError: the dataset's samples have no fixed length.
    """

    def __init__(self, *args: Any, train_dataset: StreamingDataset | None = None,
                 on_sample_ids: Callable[[int, torch.Tensor], None] | None = None, **kwargs: Any):
        if not isinstance(train_dataset, StreamingDataset):
            raise TypeError(f"ShardkitTrainer needs train_dataset=StreamingDataset(...), got "
                            f"{type(train_dataset).__name__}: pass the dataset, the trainer builds its loader")
        if train_dataset.sample_length is None:
            raise ValueError(f"{train_dataset.source.describe()}: samples of variable length; ShardkitTrainer needs "
                             "fixed-length samples (a dataset built with seq_len, or raw text with pack='concat' or "
                             "'bestfit')")
        super().__init__(*args, train_dataset=train_dataset, **kwargs)
        self.on_sample_ids = on_sample_ids
        self._batches: TrainerBatches | None = None

    def get_train_dataloader(self) -> TrainerBatches:
        if self._batches is None:
            args = self.args
            self._batches = TrainerBatches(StreamingDataLoader(
                self.train_dataset, batch_size=self._samples_per_rank(), num_workers=args.dataloader_num_workers,
                pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
                prefetch_factor=args.dataloader_prefetch_factor), self._sample_ids)
        return self._batches

    def _sample_ids(self, ids: torch.Tensor) -> None:
        if self.on_sample_ids is not None:
            # The Trainer takes a step's micro-batches before it trains them: global_step counts the steps done.
            self.on_sample_ids(self.state.global_step + 1, ids)

    def _samples_per_rank(self) -> int:
        batch, world = self._train_batch_size, self.accelerator.num_processes
        if not self.accelerator.split_batches:
            return batch
        if batch % world:
            raise ValueError(f"per_device_train_batch_size={batch} must be a multiple of the {world} processes "
                             "with accelerator_config split_batches=True (each rank reads an equal part)")
        return batch // world

    def train(self, *args: Any, **kwargs: Any):
        # The Trainer skips a resumed epoch's first batches with accelerate's `skip_first_batches`, which
        # re-reads them through a new DataLoader. The loader is already there (its state came with the
        # checkpoint), so for it that skip is checked, not done; any other loader keeps the Trainer's way.
        original = trainer_module.skip_first_batches

        def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
            if dataloader is not self._batches:
                return original(dataloader, num_batches)
            return dataloader

        with _module_attribute(trainer_module, "skip_first_batches", skip_first_batches):
            return super().train(*args, **kwargs)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: str | None, trial: Any) -> tuple[int, int]:
        epochs, steps = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                     resume_from_checkpoint, trial)
        if resume_from_checkpoint is None:
            return epochs, steps
        load_loader_state(self._batches.loader, resume_from_checkpoint, saved_by="ShardkitTrainer")
        path = os.path.join(resume_from_checkpoint, LOADER_STATE_FILE)
        if self.args.ignore_data_skip:
            return epochs, steps  # the loader continues where it stopped; the Trainer counts from the epoch start
        position = self._batches.position()
        if position != (epochs, steps):
            raise ValueError(f"{path}: the loader stands at epoch {position[0]}, batch {position[1]}, but the Trainer "
                             f"resumes at epoch {epochs}, batch {steps}: the data-parallel size or batch size changed "
                             "since the checkpoint. Pass TrainingArguments(ignore_data_skip=True) to continue from "
                             "the loader's position (the Trainer's epoch counter is then approximate)")
        return epochs, steps

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self._batches is None:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # Taken on every rank (a raw-text loader gathers the lanes' cursors); global, so written once.
        save_loader_state(self._batches.loader, folder, write=self.args.should_save)


@contextlib.contextmanager
def _module_attribute(module: Any, name: str, value: Any) -> Iterator[None]:
    if not hasattr(module, name):
        raise RuntimeError(f"{module.__name__}.{name} is gone: this transformers version resumes differently; "
                           "ShardkitTrainer supports the versions in shardkit's [integrations] extra")
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)
