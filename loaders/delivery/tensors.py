"""Batches as they leave the reader: numpy arrays become tensors, worker batches travel in bundles.

The reader (`shardkit.loaders.sources.built.reading`) yields dicts of numpy arrays. Inside a DataLoader worker they
stay numpy (pickled by value through the pipe, several per message: `bundled`); the process that hands
them to the training loop wraps them as tensors without copying (`batch_to_tensors`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..order.partition import bundle_sizes
from ..sources.built.token_batches import PROGRESS_KEY


def bundled(batches: Iterator[dict[str, np.ndarray]], size: int) -> Iterator[list[dict[str, np.ndarray]]]:
    """Group a worker's batches into lists as its steps come (`partition.bundle_sizes`: its first `size` steps as
    1, 1, 2, 4, ..., then `size` at a time)."""
    sizes = bundle_sizes(size)
    wanted = next(sizes)
    bundle: list[dict[str, np.ndarray]] = []
    for batch in batches:
        bundle.append(batch)
        if len(bundle) == wanted:
            yield bundle
            bundle, wanted = [], next(sizes)
    if bundle:
        yield bundle


def strip_progress(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch without the token-budget progress marks (only the data loader's step source reads them)."""
    batch.pop(PROGRESS_KEY, None)
    return batch


def batch_to_tensors(batch: dict[str, np.ndarray], token_dtype: str | None = None) -> dict[str, torch.Tensor]:
    """Wrap a batch's arrays as tensors without copying; `tokens` converted to `token_dtype` when it is set
    (`LoaderConfig.token_dtype`; converted here, after any worker boundary, so workers send compact tokens)."""
    if token_dtype is not None:
        batch["tokens"] = batch["tokens"].astype(token_dtype, copy=False)
    return {k: torch.from_numpy(v) for k, v in batch.items()}
