"""accelerate without the transformers Trainer: a `StreamingDataLoader` checkpointed by `save_state`/`load_state`.

`accelerator.prepare()` must not take the loader: it rebuilds a DataLoader of its own around the dataset, which
either lets rank 0 read and broadcast (`dispatch_batches`) or keeps every N-th batch of each rank's share
(`IterableDatasetShard`), and drops the loader's state; shardkit refuses to be iterated that way
(`loaders/delivery/resharding.py`, `EpochEngine.claimed`). The loader is already rank-aware: iterate it as
it is and let `checkpoint_loader` put its state into accelerate's checkpoints, as JSON (accelerate's
`register_for_checkpointing` would pickle it).
"""

from __future__ import annotations

from typing import Any

from shardkit.integrations.loader_state import load_loader_state, save_loader_state
from shardkit.loaders.dataloader import StreamingDataLoader
from shardkit.loaders.delivery.frameworks import check_processes


def checkpoint_loader(accelerator: Any, loader: StreamingDataLoader) -> None:
    """Save `loader`'s state in every `accelerator.save_state()` folder and restore it in `load_state()`.

    Args:
        accelerator: the `accelerate.Accelerator` of the run.
        loader: the run's `StreamingDataLoader`, not passed to `accelerator.prepare`.

    Raises:
        TypeError: `loader` is not a `StreamingDataLoader` (a prepared loader is accelerate's own).
        ValueError: accelerate runs this process on its own while the loader splits the data over several ranks
            (torchrun on a machine without GPUs, without accelerate's CPU setting).
    """
    if not isinstance(loader, StreamingDataLoader):
        raise TypeError(f"checkpoint_loader needs the StreamingDataLoader itself, got {type(loader).__name__}: do "
                        "not pass it to accelerator.prepare() (docs/INTEGRATIONS.md)")
    check_processes("accelerate", accelerator.num_processes, loader.dataset.resolve_topology().world_size)

    def save(models: list, weights: list, output_dir: str) -> None:
        # The state is global (identical on every rank): one process per shared directory writes it.
        config = accelerator.project_configuration
        save_loader_state(loader, output_dir, write=accelerator.is_main_process or (
            config.save_on_each_node and accelerator.is_local_main_process))

    def load(models: list, input_dir: str) -> None:
        load_loader_state(loader, input_dir, saved_by="a run with checkpoint_loader")

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
