"""Batch conversions shared by the framework adapters: the token dtype of yielded batches and causal-LM fields.

Shards keep tokens compact (uint16 for vocabularies under 65,536). Frameworks that move batches through
collectives (accelerate's dispatch broadcasts them; gloo has no uint16) or feed them straight to an
embedding need int32 or int64; the conversion happens here, once per batch, after any worker boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

TOKEN_DTYPES = {"uint16": torch.uint16, "int32": torch.int32, "int64": torch.int64}


def torch_token_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `token_dtype` option value.

    Raises:
        ValueError: not one of `TOKEN_DTYPES`, naming the option.
    """
    if name not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {sorted(TOKEN_DTYPES)}, got {name!r}")
    return TOKEN_DTYPES[name]


def with_token_dtype(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch with its `tokens` in `dtype` (other fields untouched; no copy when already `dtype`)."""
    return {**batch, "tokens": batch["tokens"].to(dtype)}


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


class TypedBatches:
    """A stateful loader whose batches come with `tokens` in another dtype; state and length pass through.

    Args:
        loader: a `StreamingDataLoader` (or any loader with `state_dict()`/`load_state_dict()`).
        token_dtype: "int64", "int32" or "uint16" (as stored for vocabularies under 65,536).
    """

    def __init__(self, loader: Any, token_dtype: str = "int64"):
        self.loader = loader
        self.dtype = torch_token_dtype(token_dtype)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            yield with_token_dtype(batch, self.dtype)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
