"""The trainer's side of the data: streaming loaders for training and evaluation, batch unpacking.

The loaders decide which sample each rank reads (a pure function of seed, epoch, world size and
position, see `shardkit.loaders`); the trainer only passes the rank layout, iterates epochs one
after another, and keeps the loader's state in its checkpoints.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.manifest import Manifest
from shardkit.options import parse_storage_options
from shardkit.train.config import DataConfig, data_entries
from shardkit.train.loss import IGNORE_INDEX
from shardkit.train.parallel import Runtime
from shardkit.train.prefetch import DevicePrefetcher


@dataclass
class Batch:
    """One micro-batch on the device: inputs, next-token targets, segment ids (or None), sample ids."""

    inputs: torch.Tensor
    targets: torch.Tensor
    segment_ids: torch.Tensor | None
    sample_ids: list[int]

    @property
    def num_tokens(self) -> torch.Tensor:
        """Real target tokens (padding excluded), on the device: reading it would wait for the device."""
        return (self.targets != IGNORE_INDEX).sum()


def to_batch(batch: dict[str, torch.Tensor], device: torch.device) -> Batch:
    """Split a loader batch (`tokens` [B, seq_len + 1]) into inputs and shifted targets on `device`.

    Padding (segment id -1, written by `--pack bestfit` to fill a window) is never a target: those
    positions get `IGNORE_INDEX`, so the loss averages over real tokens only.
    """
    tokens = batch["tokens"].to(device, non_blocking=True).long()
    targets = tokens[:, 1:]
    segments = batch.get("segment_ids")
    if segments is None and "cu_seqlens" in batch:
        # The loader sends document boundaries as O(documents) cu_seqlens; the dense ids are built here,
        # on the device (the cumulative sum over every token was the loader's largest cost).
        from shardkit.loaders.sources.documents import dense_segment_ids

        segments = dense_segment_ids(batch["cu_seqlens"].to(device, non_blocking=True),
                                     batch["padding_segments"].to(device, non_blocking=True), *tokens.shape)
    if segments is not None:
        segments = segments.to(device, non_blocking=True)
        # Unconditional: testing padding.any() first would force a device->host sync every micro-step.
        targets = targets.masked_fill(segments[:, 1:] < 0, IGNORE_INDEX)
        segments = segments[:, :-1]
    return Batch(inputs=tokens[:, :-1], targets=targets, segment_ids=segments,
                 sample_ids=batch["sample_id"].tolist())


def storage_options(config: DataConfig) -> dict[str, Any] | None:
    return parse_storage_options(config.storage_options) or None


def _source(spec: str) -> Any:
    """A `--data` value as the loader's source: one URL, or a list of `Stream` for a mixture."""
    from shardkit.loaders.order.mixing import Stream

    entries = data_entries(spec)
    return entries[0][0] if len(entries) == 1 else [Stream(url, weight) for url, weight in entries]


def raw_source(spec: str, options: dict[str, Any] | None, *, built_as_built: bool) -> list[Any] | None:
    """A `--data` value with `--tokenizer` as the loader's source: the text inputs of one corpus, or a mixture
    (a list of `Stream`) when an entry has a weight or is a built dataset (holds shardkit.json). When every entry
    is a built dataset: None with `built_as_built` (the data is read as built data), else refused.

    Raises:
        ValueError: every entry is a built dataset and not `built_as_built`.
    """
    from shardkit.loaders.order.mixing import Stream
    from shardkit.loaders.sources.built.streams import holds_manifest

    entries = data_entries(spec)
    built = [holds_manifest(url, options) for url, _ in entries]
    if all(built):
        if built_as_built:
            return None
        from shardkit.manifest import MANIFEST_NAME

        raise ValueError(f"--data {spec}: {'every entry is a built dataset' if len(entries) > 1 else 'a built dataset'} "
                         f"(holds {MANIFEST_NAME}), and --tokenizer is for raw text: drop --tokenizer to train on "
                         "built data (its manifest names the tokenizer), or add raw text to mix with it")
    if not any(built) and all(weight == 1.0 for _, weight in entries):
        return [url for url, _ in entries]
    return [Stream(url, weight, raw_text=not is_built) for (url, weight), is_built in zip(entries, built)]


def _dataset(spec: str, config: DataConfig, runtime: Runtime, *, shuffle: bool, seq_len: int | None = None,
             built_as_built: bool = False, **overrides: Any):
    """The `StreamingDataset` of `spec`: raw text under `--tokenizer` (built datasets only with `built_as_built`
    are read as built data, else refused: `sources.raw.corpus`), else built data, with `overrides` of its loader options.
    """
    from shardkit.loaders.dataset import StreamingDataset

    # Data follows the mesh: rank and world size are the data-parallel coordinate and size, so the
    # tensor- and pipeline-parallel peers of one dp rank read the same batches.
    mesh = dict(device_mesh=runtime.mesh, mesh_dim="dp") if runtime.mesh is not None else {}
    local_world_size = runtime.dp_local_world_size
    where = dict(**mesh, local_rank=runtime.dp_rank % local_world_size, local_world_size=local_world_size,
                 storage_options=storage_options(config))
    if config.data_service is not None and not built_as_built:  # the training data, from the service
        entries = data_entries(spec)
        return StreamingDataset(entries[0][0] if len(entries) == 1 else None, service=config.data_service, **mesh,
                                local_rank=where["local_rank"], local_world_size=local_world_size)
    source = raw_source(spec, where["storage_options"], built_as_built=built_as_built) \
        if config.tokenizer is not None else None
    if source is not None:  # raw text, tokenized and packed by the loader
        return raw_text_dataset(source, config, seq_len=seq_len, shuffle=shuffle, **where)
    return StreamingDataset(_source(spec), config.loader, cache_dir=config.cache_dir, shuffle=shuffle, **where,
                            **overrides)


def raw_text_dataset(source: list[Any], config: DataConfig, *, seq_len: int | None, shuffle: bool, **where: Any):
    """The raw-text `StreamingDataset` the trainer reads from `source` (`sources.raw.corpus`'s: the inputs of one corpus, or
    a mixture's `Stream`s) under `--tokenizer`; `where`: its rank layout and storage options. `shardkit trace`
    rebuilds a run's raw text through it, so both read the same samples."""
    from shardkit.loaders.dataset import StreamingDataset

    mixture = {} if isinstance(source[0], str) else dict(cache_dir=config.cache_dir)
    return StreamingDataset(source, tokenizer=config.tokenizer, seq_len=seq_len, pack=config.pack,
                            text_field=config.text_field, lanes=config.lanes, seed=config.loader.seed,
                            shuffle=shuffle, on_corrupt=config.loader.on_corrupt,
                            skip_samples=config.loader.skip_samples,
                            quarantine_list=config.loader.quarantine_list, **mixture, **where)


def check_dataset(dataset: Any, *, seq_len: int | None, what: str) -> Any:
    """What the trainer reads of a `StreamingDataset`'s samples (seq_len, tokenizer, token_dtype; a built dataset's
    first manifest), after checking that every stream holds fixed-length samples the model can take. The source
    answers from what it opened (a built stream's manifest was fetched once, through the node cache)."""
    shapes = dataset.source.shapes()
    for where, shape in shapes:
        if shape.sample_length is None:
            raise ValueError(f"{what} {where} holds variable-length samples (packing={shape.packing!r}); "
                             "the trainer needs packed data: rebuild it with a --seq-len")
        if seq_len is not None and shape.seq_len != seq_len:
            raise ValueError(f"{what} {where} has seq_len {shape.seq_len} but --seq-len is {seq_len}")
        seq_len = shape.seq_len  # the streams of a mixture must agree with the first
    return shapes[0][1]


class Epochs:
    """Endless iteration over the training loader, epoch after epoch, with resumable state."""

    def __init__(self, loader, *, allow_mixture_change: bool):
        self.loader = loader
        self.allow_mixture_change = allow_mixture_change
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None

    def __next__(self) -> dict[str, torch.Tensor]:
        for _ in range(2):  # at most one epoch change per batch
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
        raise ValueError("the training loader yields no batch for this rank in a whole epoch: the dataset "
                         "is smaller than one global batch (lower --batch-size or use fewer ranks)")

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state, allow_mixture_change=self.allow_mixture_change)
        self._iterator = None


class TrainStream:
    """The training batches on the device (`Batch`), epoch after epoch, with resumable state.

    On CUDA the loader pins its batches and `DevicePrefetcher` copies the next one while a step runs."""

    def __init__(self, config: DataConfig, runtime: Runtime, *, seq_len: int | None = None):
        from shardkit.loaders.dataloader import StreamingDataLoader

        on_gpu = runtime.device.type == "cuda"
        self.config_data = config.data
        self.loader = StreamingDataLoader(_dataset(config.data, config, runtime, shuffle=config.loader.shuffle,
                                                   seq_len=seq_len),
                                          batch_size=config.batch_size, num_workers=config.num_workers,
                                          pin_memory=on_gpu)
        self._batches = DevicePrefetcher(Epochs(self.loader, allow_mixture_change=config.allow_mixture_change),
                                         functools.partial(to_batch, device=runtime.device), runtime.device)

    def __next__(self) -> Batch:
        return next(self._batches)

    def state_dict(self) -> dict[str, Any]:
        return self._batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._batches.load_state_dict(state)

    def streams(self) -> list[dict[str, Any]]:
        """The streams in force (URL, data identity, samples), in the order global sample ids count through them:
        what `shardkit trace` needs to name a logged id's shard, also after a mixture change."""
        return self.loader.source.stream_records()


class EvalData:
    """The held-out set: the same first `eval_batches` batches per rank at every evaluation."""

    def __init__(self, url: str, config: DataConfig, runtime: Runtime, *, seq_len: int | None = None):
        self.url, self.config = url, config
        # Opened once (manifests and caches); every evaluation reads it from its start with a loader of its own.
        # A held-out set built once beside raw training text is read as built data (check_same_tokens still
        # compares its tokenizer with the raw text's); with --tokenizer, any raw entry makes it raw text.
        # skip_samples and --quarantine-list name samples and shards of the training data, not of a built held-out set.
        self.dataset = _dataset(url, config, runtime, shuffle=False, seq_len=seq_len, built_as_built=True,
                                skip_samples=(), quarantine_list=None)

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        from shardkit.loaders.dataloader import StreamingDataLoader

        loader = StreamingDataLoader(self.dataset, batch_size=self.config.batch_size, num_workers=0)
        # Every rank must run the same number of forwards (FSDP's all-gathers are collective); the
        # loader gives every rank the same number of batches per epoch.
        # Raw text is endless (its lanes go on epoch after epoch): it always holds eval_batches.
        count = self.config.eval_batches if self.dataset.source.endless else min(self.config.eval_batches,
                                                                                   len(loader))
        if count == 0:
            raise ValueError(f"--eval-data {self.url} holds less than one global batch: lower --batch-size")
        for index, batch in enumerate(loader):
            if index >= count:
                break
            yield batch


def check_same_tokens(reference: Manifest, other: Manifest, *, what: str, against: str) -> None:
    """Refuse a dataset whose token ids mean something else than the reference's (checked before step 1:
    an eval set from another tokenizer would otherwise fail only at the first evaluation, or score garbage)."""
    mine, theirs = reference.tokenizer, other.tokenizer
    same_vocabulary = (mine.vocab_sha256 == theirs.vocab_sha256 if mine.vocab_sha256 and theirs.vocab_sha256
                       else (mine.kind, mine.name) == (theirs.kind, theirs.name))
    differences = [] if same_vocabulary else [f"tokenizer {theirs.kind}:{theirs.name} vs {mine.kind}:{mine.name}"]
    for label, want, got in (("vocab_size", mine.vocab_size, theirs.vocab_size),
                             ("token_dtype", reference.token_dtype, other.token_dtype),
                             ("seq_len", reference.seq_len, other.seq_len)):
        if want != got:
            differences.append(f"{label} {got} vs {want}")
    if differences:
        raise ValueError(f"{what} does not match {against}: " + ", ".join(differences)
                         + "; build both with the same tokenizer and --seq-len")
