"""Source datasets written by the formats' own libraries, and readers of them, for the convert tests.

Megatron datasets are written with megatron-core's `IndexedDatasetBuilder` and read with its
`IndexedDataset`; Hugging Face datasets with `datasets.Dataset.save_to_disk` / `to_parquet`.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest


def megatron():
    """megatron-core's indexed-dataset module (skips the test when it is not installed)."""
    module = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                 reason="megatron-core is needed (pip install 'shardkit[convert]')")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    return module


def random_documents(count: int, *, vocab: int = 256, seed: int = 0, longest: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, longest))).astype(np.int64) for _ in range(count)]


def write_megatron(prefix, documents, *, dtype=np.uint16, split_every: int = 0) -> None:
    """`documents` as a Megatron dataset written by megatron-core; every `split_every`-th document is
    stored as two sequences (a sentence-split document), the others as one."""
    import torch

    builder = megatron().IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for number, tokens in enumerate(documents):
        if split_every and number % split_every == 1 and len(tokens) > 1:
            builder.add_document(torch.from_numpy(tokens), [len(tokens) // 2, len(tokens) - len(tokens) // 2])
        else:
            builder.add_document(torch.from_numpy(tokens), [len(tokens)])
    builder.finalize(f"{prefix}.idx")


def read_megatron(prefix) -> list[np.ndarray]:
    """The documents of a Megatron dataset as megatron-core's reader gives them (sequences joined)."""
    dataset = megatron().IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [np.concatenate([dataset[i] for i in range(bounds[d], bounds[d + 1])]) if bounds[d + 1] > bounds[d]
            else np.zeros(0, dtype=np.int64) for d in range(len(bounds) - 1)]


def write_hf(directory, documents, *, column: str = "input_ids", batch_rows: int = 64):
    """`documents` as a `datasets` dataset saved with `save_to_disk` (Arrow stream files of `batch_rows` rows)."""
    datasets = pytest.importorskip("datasets", reason="datasets is needed (pip install 'shardkit[convert]')")
    dataset = datasets.Dataset.from_dict({column: [d.tolist() for d in documents],
                                          "id": list(range(len(documents)))})
    dataset = dataset.map(lambda row: row, writer_batch_size=batch_rows)  # written in batches of batch_rows
    dataset.save_to_disk(str(directory), max_shard_size="40KB")
    return dataset
