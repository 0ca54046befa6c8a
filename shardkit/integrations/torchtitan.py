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

from shardkit.errors import ManifestError
from shardkit.integrations.batches import causal_lm_fields
from shardkit.loaders.dataloader import StreamingDataLoader
from shardkit.loaders.dataset import StreamingDataset

STATE_KEY = "shardkit_loader"  # a JSON string: DCP stores it as a replicated object, loaded by every rank
BATCHES_KEY = "shardkit_batches"  # batches handed out over the run (the number `on_sample_ids` gets), as text
# What `dataset_path` may name, for messages.
DATASET_PATH_KINDS = ("the URL or path of a built shardkit dataset (the folder holding shardkit.json), or raw text "
                      "inputs (JSONL / .gz / .zst, Parquet or .txt files, a glob, a directory or an fsspec URL) "
                      "with dataloader.raw_tokenizer set to a shardkit tokenizer spec")
# Raw-text fields of the Config and their defaults: set without raw_tokenizer they would be ignored.
RAW_FIELDS = {"pack": "concat", "text_field": "text", "unit_bytes": None, "lanes": None}


class ShardkitDataLoader(BaseDataLoader):
    """Streams a shardkit dataset to torchtitan's trainer, `seq_len` input tokens and their next tokens per sample.

    Args:
        config: `ShardkitDataLoader.Config` (`dataset_path`: the dataset URL; raw text inputs with `raw_tokenizer`).
        dp_world_size, dp_rank: the data-parallel size and rank torchtitan passes.
        local_batch_size: samples per rank per micro-batch.
        seq_len: the model's sequence length: the dataset's samples must hold `seq_len + 1` tokens.
        on_sample_ids: called as `on_sample_ids(batch_number, ids)` with each batch's number (1 for the run's
            first batch, counted on across resumes: the training step without gradient accumulation) and its
            `sample_id` (int64 [batch]) as it is handed out (for lineage; also settable as the attribute
            `on_sample_ids` of a loader torchtitan built).
        **unused: the other build arguments torchtitan passes (`tokenizer`: torchtitan's tokenizer object;
            shards are already tokenized, and raw text uses the shardkit spec in the config's
            `raw_tokenizer`;
            `snapshot_every_n_steps`: the state is a few values, taken at any step).

    Raises:
        ValueError: no dataset_path or one that is neither kind of input, samples of another length than
            seq_len + 1, raw text without seq_len, packed with pack="none" (samples of every length) or with a
            cache_dir (raw text is read from its inputs), raw-text fields without raw_tokenizer.
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

        unit_bytes: int | None = None
        """Raw text: approximate bytes per work unit, the piece of a file tokenized at once (default: the Python
        API's, `StreamingDataset(..., unit_bytes=)`)."""

        lanes: int | None = None
        """Raw text: independent streams the units are dealt into (at most the number of units; default: the
        Python API's). Every data-parallel rank and worker reads whole lanes: use at least dp ranks x workers."""

        def __post_init__(self) -> None:
            if self.num_workers < 0:
                raise ValueError(f"dataloader.num_workers must be >= 0, got {self.num_workers}")

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, local_batch_size: int,
                 seq_len: int | None = None, on_sample_ids: Callable[[int, torch.Tensor], None] | None = None,
                 **unused: Any):
        url = config.dataset_path or config.dataset
        if not url:
            raise ValueError(f"dataloader.dataset_path is not set: name {DATASET_PATH_KINDS}")
        where = dict(rank=dp_rank, world_size=dp_world_size, shuffle=config.shuffle, seed=config.seed)
        if config.raw_tokenizer is not None:
            self.dataset = _raw_text(url, config, seq_len, where)
        else:
            misplaced = [f"dataloader.{name}" for name, default in RAW_FIELDS.items()
                         if getattr(config, name) != default]
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: how raw text becomes samples, which needs "
                                 "dataloader.raw_tokenizer (a built dataset's samples are made already: drop them)")
            try:
                self.dataset = StreamingDataset(url, cache_dir=config.cache_dir, **where)
            except ManifestError as err:
                raise ValueError(f"dataloader.dataset_path={url!r} is no built shardkit dataset ({err}); name "
                                 f"{DATASET_PATH_KINDS}") from err
        length = self.dataset.sample_length
        if length is None or (seq_len is not None and length != seq_len + 1):
            raise ValueError(f"{url}: samples of {length} tokens (variable if None) do not make seq_len={seq_len} "
                             f"inputs plus their next-token labels; build the dataset with seq_len={seq_len} or set "
                             f"training.seq_len={None if length is None else length - 1}")
        self.loader = StreamingDataLoader(self.dataset, batch_size=local_batch_size, num_workers=config.num_workers)
        self.infinite = config.infinite
        self.on_sample_ids = on_sample_ids
        self.batches_handed_out = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            for batch in self.loader:  # one epoch (or its rest); the loader moves on to the next itself
                inputs, labels = causal_lm_fields(batch)
                self.batches_handed_out += 1
                if self.on_sample_ids is not None:
                    self.on_sample_ids(self.batches_handed_out, batch["sample_id"])
                yield {"input": inputs}, labels
            if not self.infinite:
                return

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: json.dumps(self.loader.state_dict()), BATCHES_KEY: str(self.batches_handed_out)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # torchtitan loads an empty state into a fresh run
        if STATE_KEY not in state_dict:
            raise ValueError(f"the checkpoint's dataloader state has no {STATE_KEY!r} (keys: {sorted(state_dict)}): "
                             "it was saved by another loader; exclude 'dataloader' from loading to start afresh")
        self.loader.load_state_dict(json.loads(state_dict[STATE_KEY]))
        self.batches_handed_out = int(state_dict.get(BATCHES_KEY, 0))  # a checkpoint from before it: from 0


def _raw_text(url: str, config: ShardkitDataLoader.Config, seq_len: int | None, where: dict[str, Any]
              ) -> StreamingDataset:
    """The raw-text dataset a Config with `raw_tokenizer` names.

    Raises:
        ValueError: no seq_len, pack="none" or a cache_dir (naming the config field).
    """
    if seq_len is None:
        raise ValueError("dataloader.raw_tokenizer (raw text) needs the seq_len torchtitan passes from "
                         "training.seq_len")
    if config.pack == "none":
        raise ValueError('dataloader.pack="none" gives samples of every length; torchtitan needs fixed-length ones: '
                         'use "concat" or "bestfit"')
    if config.cache_dir is not None:
        raise ValueError(f"dataloader.cache_dir={config.cache_dir!r}: raw text (dataloader.raw_tokenizer) is read "
                         "from its inputs, not through shardkit's node cache; leave dataloader.cache_dir unset")
    sizes = {name: getattr(config, name) for name in ("unit_bytes", "lanes") if getattr(config, name) is not None}
    return StreamingDataset(url, tokenizer=config.raw_tokenizer, seq_len=seq_len, pack=config.pack,
                            text_field=config.text_field, **sizes, **where)
