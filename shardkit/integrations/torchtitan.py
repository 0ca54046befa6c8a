"""torchtitan: `ShardkitDataLoader`, a `BaseDataLoader` over a shardkit dataset.

torchtitan builds its loader from a nested `Config` (`config.dataloader.build(dp_world_size=, dp_rank=,
local_batch_size=, seq_len=, tokenizer=, ...)`), iterates `({"input": LongTensor}, labels)` pairs and saves the
loader through its `CheckpointManager` (DCP) as a `Stateful`. torchtitan's own loader keeps one state per
data-parallel rank and refuses another data-parallel size; shardkit's state is global (the same on every
rank: epoch and positions consumed), so it is saved once under one key and resumes on any size. With
`raw_tokenizer` set in its config, `dataset_path` names raw text that the loader tokenizes and packs itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from shardkit.integrations.batches import causal_lm_fields
from shardkit.loaders.dataloader import StreamingDataLoader
from shardkit.loaders.dataset import StreamingDataset

STATE_KEY = "shardkit_loader"  # a JSON string: DCP stores it as a replicated object, loaded by every rank


class ShardkitDataLoader(BaseDataLoader):
    """Streams a shardkit dataset to torchtitan's trainer, `seq_len` input tokens and their next tokens per sample.

    Args:
        config: `ShardkitDataLoader.Config` (`dataset_path`: the dataset URL; raw text inputs with `raw_tokenizer`).
        dp_world_size, dp_rank: the data-parallel size and rank torchtitan passes.
        local_batch_size: samples per rank per micro-batch.
        seq_len: the model's sequence length: the dataset's samples must hold `seq_len + 1` tokens.
        on_sample_ids: called with the `sample_id` (int64 [batch]) of each batch as it is handed out (for
            lineage; also settable as the attribute `on_sample_ids` of a loader torchtitan built).
        **unused: the other build arguments torchtitan passes (`tokenizer`: torchtitan's tokenizer object;
            shards are already tokenized, and raw text uses the shardkit spec in the config's
            `raw_tokenizer`;
            `snapshot_every_n_steps`: the state is a few values, taken at any step).

    Raises:
        ValueError: no dataset_path, samples of another length than seq_len + 1, or raw text without seq_len
            or packed with pack="none" (samples of every length).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        cache_dir: str | None = None
        """Node-local shard cache (default: $SHARDKIT_CACHE_DIR or a per-user temp directory)."""

        num_workers: int = 0
        """DataLoader worker processes reading batches."""

        seed: int = 0
        """Shuffle seed (part of the order: a resume needs the same)."""

        shuffle: bool = True
        """Shuffle samples each epoch."""

        infinite: bool = True
        """Go on into the next epoch (torchtitan's trainer iterates once and stops at training.steps)."""

        raw_tokenizer: str | None = None
        """A shardkit tokenizer spec (`byte`, `tiktoken:NAME`, a tokenizer.json or .model path): `dataset_path`
        then names raw text (JSONL / .gz / .zst, Parquet, .txt; a glob, a directory or an fsspec URL), tokenized
        and packed into samples of training.seq_len + 1 tokens by the loader, without a build."""

        pack: str = "concat"
        """Raw text: how documents become samples, "concat" or "bestfit" (torchtitan's models take fixed-length
        samples, so not "none")."""

        text_field: str = "text"
        """Raw text: the JSONL field or Parquet column holding each document's text."""

        def __post_init__(self) -> None:
            if self.num_workers < 0:
                raise ValueError(f"dataloader.num_workers must be >= 0, got {self.num_workers}")

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, local_batch_size: int,
                 seq_len: int | None = None, on_sample_ids: Callable[[torch.Tensor], None] | None = None,
                 **unused: Any):
        url = config.dataset_path or config.dataset
        if not url:
            raise ValueError("dataloader.dataset_path must be the URL of a shardkit dataset (holding shardkit.json)")
        where = dict(rank=dp_rank, world_size=dp_world_size, shuffle=config.shuffle, seed=config.seed)
        if config.raw_tokenizer is not None:
            if seq_len is None:
                raise ValueError("dataloader.raw_tokenizer (raw text) needs the seq_len torchtitan passes from "
                                 "training.seq_len")
            if config.pack == "none":
                raise ValueError('dataloader.pack="none" gives samples of every length; torchtitan needs '
                                 'fixed-length ones: use "concat" or "bestfit"')
            self.dataset = StreamingDataset(url, tokenizer=config.raw_tokenizer, seq_len=seq_len, pack=config.pack,
                                            text_field=config.text_field, **where)
        else:
            self.dataset = StreamingDataset(url, cache_dir=config.cache_dir, **where)
        length = self.dataset.sample_length
        if length is None or (seq_len is not None and length != seq_len + 1):
            raise ValueError(f"{url}: samples of {length} tokens (variable if None) do not make seq_len={seq_len} "
                             f"inputs plus their next-token labels; build the dataset with seq_len={seq_len} or set "
                             f"training.seq_len={None if length is None else length - 1}")
        self.loader = StreamingDataLoader(self.dataset, batch_size=local_batch_size, num_workers=config.num_workers)
        self.infinite = config.infinite
        self.on_sample_ids = on_sample_ids

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            for batch in self.loader:  # one epoch (or its rest); the loader moves on to the next itself
                inputs, labels = causal_lm_fields(batch)
                if self.on_sample_ids is not None:
                    self.on_sample_ids(batch["sample_id"])
                yield {"input": inputs}, labels
            if not self.infinite:
                return

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # torchtitan loads an empty state into a fresh run
        if STATE_KEY not in state_dict:
            raise ValueError(f"the checkpoint's dataloader state has no {STATE_KEY!r} (keys: {sorted(state_dict)}): "
                             "it was saved by another loader; exclude 'dataloader' from loading to start afresh")
        self.loader.load_state_dict(json.loads(state_dict[STATE_KEY]))
