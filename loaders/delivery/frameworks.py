"""Refuse the ways of running the dataset inside a training framework that train on the wrong data without a word.

The framework is not passed to the dataset; it is found among the calling frames (`calling_objects`, which
`resharding` also uses to find accelerate's wrappers), when the dataset resolves its topology: at `len()`, at the
start of an iteration and at `state_dict()`.

- A framework that runs this process on its own (Lightning's default `devices=1` on a CPU machine, the
  transformers `Trainer` under torchrun without `ACCELERATE_USE_CPU`), while the dataset splits the data by
  torchrun's `WORLD_SIZE`: each process would train its own model on a part of the data.
- Lightning around a torch `DataLoader`: it has no state for Lightning to save, so a resume trains the epoch
  again from its start.
"""

from __future__ import annotations

import sys
from typing import Any

# What a dataset without batch_size needs, iterated or saved on its own (it yields whole batches; a DataLoader's
# batch_size would batch batches), and the ways that need none.
NEEDS_BATCH_SIZE = ("needs batch_size=: it yields whole batches, so the batch size goes to the dataset, "
                    "StreamingDataset(url, batch_size=B) inside DataLoader(dataset, batch_size=None); or iterate a "
                    "StreamingDataLoader(dataset, batch_size=B) and save its state; with transformers' Trainer use "
                    "shardkit.integrations.huggingface.ShardkitTrainer (docs/INTEGRATIONS.md)")
# How to run each framework on as many processes as torchrun started.
DISTRIBUTED_FIX = {
    "Lightning": 'pass L.Trainer(devices=<processes per node>, strategy="ddp") (DDP, over gloo on CPUs)',
    "transformers' Trainer": "on machines without GPUs set ACCELERATE_USE_CPU=true under torchrun (or "
                             "TrainingArguments(use_cpu=True))",
    "accelerate": "on machines without GPUs use accelerate launch --cpu, or set ACCELERATE_USE_CPU=true under torchrun",
}


# Only frames of these packages are looked into. Reading a frame's `f_locals` (Python < 3.13) stores a snapshot
# of its locals on the frame, which keeps them alive after the function deletes them: a user's `del iterator`
# would no longer close the iterator (and store its shards). Framework frames are read, a user's never.
FRAMEWORK_MODULES = ("lightning.", "pytorch_lightning.", "transformers.", "accelerate.", "torch.utils.data.")


def calling_objects(max_depth: int = 120, modules: tuple[str, ...] = FRAMEWORK_MODULES) -> list[Any]:
    """The `self` of each calling frame whose code belongs to one of `modules`, innermost first."""
    owners = []
    frame = sys._getframe(1)
    try:
        for _ in range(max_depth):
            if frame is None:
                break
            if str(frame.f_globals.get("__name__", "")).startswith(modules):
                owner = frame.f_locals.get("self")
                if owner is not None:
                    owners.append(owner)
            frame = frame.f_back
    finally:
        del frame  # no reference to a caller's frame outlives the walk
    return owners


def _is_instance(owner: Any, module: str, name: str) -> bool:
    """Whether `owner` is an instance of `module.name` (checked by name: the framework may not be installed)."""
    return any(kind.__module__ == module and kind.__name__ == name for kind in type(owner).__mro__)


def _lightning_trainer(owner: Any) -> Any:
    """Lightning's Trainer, when `owner` is it or one of its loops or connectors; else None."""
    if not type(owner).__module__.startswith(("lightning.pytorch.", "pytorch_lightning.")):
        return None
    if type(owner).__name__ == "Trainer":
        return owner
    trainer = getattr(owner, "trainer", None)
    return trainer if trainer is not None and hasattr(trainer, "world_size") else None


def running_framework() -> tuple[str, int, bool] | None:
    """(framework, the processes it trains on, whether a plain torch DataLoader iterates the dataset) of the
    framework among the calling frames; None outside Lightning and the transformers Trainer."""
    plain_loader = False
    for owner in calling_objects():
        kind = type(owner)
        if kind.__module__ == "torch.utils.data.dataloader" and kind.__name__ in (
                "DataLoader", "_SingleProcessDataLoaderIter", "_MultiProcessingDataLoaderIter"):
            plain_loader = True
        trainer = _lightning_trainer(owner)
        if trainer is not None:
            return "Lightning", int(trainer.world_size), plain_loader
        if _is_instance(owner, "transformers.trainer", "Trainer"):
            return "transformers' Trainer", int(owner.args.world_size), plain_loader
    return None


# The iterators of torch's DataLoader and torchdata's StatefulDataLoader (with no workers: they iterate the dataset
# in this process).
_LOADER_ITERATOR_MODULES = {"torch.utils.data.dataloader": "torch's DataLoader",
                            "torchdata.stateful_dataloader.stateful_dataloader": "torchdata's StatefulDataLoader"}


def iterating_loader() -> str | None:
    """Which of torch's `DataLoader` and torchdata's `StatefulDataLoader` iterates the caller in this process (its
    iterator among the calling frames), or None."""
    for owner in calling_objects(modules=("torch.utils.data.", "torchdata.")):
        kind = type(owner)
        if kind.__module__ in _LOADER_ITERATOR_MODULES and kind.__name__.endswith("DataLoaderIter"):
            return _LOADER_ITERATOR_MODULES[kind.__module__]
    return None


def refuse_read_ahead_without_length() -> None:
    """Refuse Lightning around a torch or torchdata loader of a dataset without a length (asked for one, which
    Lightning does before it starts): Lightning then reads one batch ahead of its training step, and that loader's
    state, taken at a checkpoint, would count the batch not yet trained (a resume would skip it).

    Raises:
        ValueError: naming StreamingDataLoader.
    """
    found = running_framework()
    if found is not None and found[0] == "Lightning":
        raise ValueError("Lightning reads one batch ahead of a loader without a length (token-budget batches) and "
                         "a checkpoint would count that batch in this StreamingDataset's own state: a resume would "
                         "skip it. Return a StreamingDataLoader from train_dataloader(): its state counts the batches "
                         "the training step received (docs/INTEGRATIONS.md)")


def check_processes(framework: str, processes: int, world_size: int) -> None:
    """Raise when `framework` trains this process alone while the dataset splits the data over `world_size` ranks.

    Raises:
        ValueError: naming the framework's setting that runs it on every process.
    """
    if processes == 1 and world_size > 1:
        raise ValueError(f"{framework} trains this process on its own, but the dataset splits the data over "
                         f"{world_size} ranks (torchrun's WORLD_SIZE): each process would train its own model on "
                         f"1/{world_size} of the data. {DISTRIBUTED_FIX[framework]} (docs/INTEGRATIONS.md)")


def check_framework(world_size: int, *, standalone: bool) -> None:
    """Refuse the framework among the calling frames when it runs the dataset the wrong way (module docstring);
    `standalone`: the dataset is iterated without a StreamingDataLoader.

    Raises:
        ValueError: naming the right way.
    """
    found = running_framework()
    if found is None:
        return
    framework, processes, plain_loader = found
    check_processes(framework, processes, world_size)
    if framework == "Lightning" and standalone and plain_loader:
        raise ValueError("Lightning iterates this StreamingDataset through a torch DataLoader, which has no state "
                         "for Lightning's checkpoints: a resume would train the epoch again from its start. Return a "
                         "StreamingDataLoader from train_dataloader() (or torchdata's StatefulDataLoader) "
                         "(docs/INTEGRATIONS.md)")


# Lightning's fetchers (lightning/pytorch/loops/fetchers.py): `_PrefetchDataFetcher` holds the batches it read
# ahead of the training step in its list `batches` (shardkit.loaders.delivery.received says why that matters).
_FETCHER_MODULES = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")


def _holds_batches(owner: Any) -> bool:
    return type(owner).__module__ in _FETCHER_MODULES and isinstance(getattr(owner, "batches", None), list)


def holding_fetcher() -> Any:
    """The fetcher among the calling frames that holds batches back from the training step (Lightning's
    `_PrefetchDataFetcher`, starting an iteration), or None."""
    for owner in calling_objects(modules=("lightning.", "pytorch_lightning.")):
        if _holds_batches(owner):
            return owner
    return None


def refuse_untracked_fetcher(loader: Any) -> None:
    """Refuse a state asked under Lightning while its fetcher holds batches read from `loader` by an iteration
    that was not started under that fetcher (so the batches the training step received are unknown).

    Raises:
        ValueError: saying so.
    """
    for owner in calling_objects(modules=("lightning.", "pytorch_lightning.")):
        trainer = _lightning_trainer(owner)
        fetcher = getattr(getattr(trainer, "fit_loop", None), "_data_fetcher", None)
        if fetcher is None:
            continue
        loaders = getattr(getattr(fetcher, "_combined_loader", None), "flattened", ())
        if _holds_batches(fetcher) and fetcher.batches and any(item is loader for item in loaders):
            raise ValueError("Lightning's fetcher holds batches of this StreamingDataLoader that its training step "
                             "has not received, read by an iteration shardkit did not see start under it: the "
                             "state would count them and a resume would skip them. Return the StreamingDataLoader "
                             "itself from train_dataloader() (docs/INTEGRATIONS.md)")
        return
