"""Batch conversions shared by the framework adapters: the causal-LM fields of a batch.

Shards keep tokens compact (uint16 for vocabularies under 65,536); models take int64 ids. Batches that go
through collectives of a framework's own come in the dtype the loader option `token_dtype` names
(`LoaderConfig`), converted where batches become tensors, not here.
"""

from __future__ import annotations

import torch


def fixed_length_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's tokens as int64 [batch, length] (what embeddings and losses take).

    Raises:
        ValueError: the batch is not [batch, length] tokens with length >= 2 (a variable-length dataset).
    """
    tokens = batch["tokens"]
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"causal-LM batches need fixed-length samples of >= 2 tokens ([batch, length]); got tokens "
                         f"of shape {tuple(tokens.shape)}: build the dataset with --seq-len")
    return tokens.to(torch.int64)


def causal_lm_fields(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets) of a fixed-length batch, int64: `tokens[:, :-1]` and `tokens[:, 1:]`."""
    tokens = fixed_length_tokens(batch)
    return tokens[:, :-1], tokens[:, 1:]
