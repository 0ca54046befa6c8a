"""`StreamingDataset`: a torch IterableDataset that yields whole batches of this rank's share, from any source.

This module is the face. What the dataset reads is its `Source` (`shardkit.loaders.source`): built shards
(`sources.built.source.BuiltSource`), raw text tokenized on the fly (`sources.raw.source.RawTextSource`) or a weighted
mixture of streams of either kind (`sources.mixture.MixtureSource`); the data loader talks to the source only. Every decision about which sample
goes where is a pure function elsewhere. The iterator produces *whole batches* so that, with DataLoader
workers, one batch crosses the process boundary as a handful of arrays instead of `batch_size` pickled samples.

The dataset is usually driven by `StreamingDataLoader`, which resolves the topology in the main process, tells
the source where to start and counts what the training loop received. Iterated on its own, it needs
`batch_size` (`Source.standalone`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

from .config import LoaderConfig, loader_config
from .order.mixing import Stream
from .sources.choice import built_source, raw_text_source
from .sources.service.source import served_source
from .sources.raw.corpus import RawTextSettings
from .sources.built.streams import Sources, streams_of
from .sources.built.token_batches import PROGRESS_KEY
from .source import Provenance
from .delivery.topology import Topology, check_topology_args

# Re-exported: their callers import them from here (the loader, the trainer, integrations, benchmarks).
from .order.rank_steps import IterationPlan  # noqa: E402  (re-export)
from .delivery.tensors import batch_to_tensors, bundled, strip_progress  # noqa: E402  (re-export)

__all__ = ["PROGRESS_KEY", "IterationPlan", "StreamingDataset", "batch_to_tensors", "bundled", "strip_progress"]

# How raw text becomes samples (`RawTextSettings`, besides the tokenizer): keywords of raw text only.
TEXT_FIELDS = frozenset(f.name for f in dataclasses.fields(RawTextSettings)) - {"tokenizer"}


class StreamingDataset(IterableDataset):
    """Streams built shards, raw text or a mixture of both to every rank, batch by batch.

    Args:
        source: a dataset URL (any fsspec URL holding `shardkit.json`), a `Stream`, or a list of `Stream`; with
            `tokenizer=`, raw text: files, directories, globs or URLs of JSONL (.gz/.zst), Parquet or .txt inputs
            (or `Stream`s, raw ones marked `raw_text=True`, mixed with built datasets).
        config: order, batching and cache options (`LoaderConfig`; default: its defaults).
        tokenizer: a tokenizer spec (`shardkit build --tokenizer`): read raw text, tokenized and packed on the fly.
        cache_dir: node-local cache directory shared by the node's processes (default `$SHARDKIT_CACHE_DIR` or a
            per-user temp directory); for built datasets and built streams.
        rank, world_size, local_rank, local_world_size: explicit topology (else resolved lazily).
        storage_options: fsspec options (e.g. S3 endpoint); never logged.
        process_group: data-parallel process group to take rank and world size from.
        device_mesh, mesh_dim: or a DeviceMesh and its data-parallel dimension.
        batch_size: samples per rank per step when iterated without `StreamingDataLoader`.
        service: read from a `shardkit serve` data service at this address (grpc://HOST:PORT) instead: its workers
            read the data and send each rank the batches this class would give it (`source` may then be None, or
            the data meant, which the service's must match).
        service_token: the service's shared token (default `$SHARDKIT_SERVICE_TOKEN`).
        service_timeout: seconds to wait for the service, and for a worker's next batch before the stream moves
            to another worker.
        **options: `LoaderConfig` fields (`shuffle=False`, `cache_limit=...`) applied over `config`; with
            `tokenizer=`, also how text becomes samples (`seq_len`, `pack`, `text_field`, `txt_mode`,
            `unit_bytes`, `lanes`, `eos_id`, `bos_id`, `max_doc_chars`, `bestfit_buffer`, `bestfit_open`:
            `shardkit.loaders.sources.raw.corpus.RawTextSettings`).

    Raises:
        TypeError: `source` is not a URL or streams, or an option is not a `LoaderConfig` field.
        ValueError: a bad option value, or one without meaning for the source (naming it and why), or manifests
            that cannot be mixed.
    """

    def __init__(self, source: str | Stream | Sequence[Any] | None, config: LoaderConfig | None = None, *,
                 tokenizer: str | None = None, cache_dir: str | None = None, rank: int | None = None,
                 world_size: int | None = None, local_rank: int | None = None, local_world_size: int | None = None,
                 storage_options: dict[str, Any] | None = None, process_group: Any = None, device_mesh: Any = None,
                 mesh_dim: Any = None, batch_size: int | None = None, service: str | None = None,
                 service_token: str | None = None, service_timeout: float = 60.0, **options: Any):
        super().__init__()
        text = {name: options.pop(name) for name in TEXT_FIELDS if name in options}
        # With service=, the service decides these (its workers read the data).
        decided_by_service = [*text, *options] + (["config"] if config is not None else []) + \
            (["tokenizer"] if tokenizer is not None else [])
        self.config = config = loader_config(config, options, caller="StreamingDataset")
        topology_args = dict(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)
        check_topology_args(**topology_args)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        group_args = dict(process_group=process_group, device_mesh=device_mesh, mesh_dim=mesh_dim)
        if service is not None:
            if decided_by_service:
                raise ValueError(f"{', '.join(sorted(decided_by_service))}: with service= the service decides the data "
                             "and how it is read (give them to shardkit serve)")
            self.source = served_source(service, token=service_token, timeout=service_timeout, expected=source,
                                        topology_args=topology_args, group_args=group_args)
        elif source is None:
            raise TypeError("source must be a dataset URL (str), a Stream, or a non-empty list of Stream (raw text "
                            "inputs with tokenizer=), or give service=; got None")
        elif tokenizer is None:
            if text:
                raise ValueError(f"{', '.join(sorted(text))}: how raw text becomes samples, which needs tokenizer= "
                                 "(a built dataset's manifest already says how its samples were made: drop them)")
            self.streams = streams_of(source)
            sources = Sources(self.streams, config, cache_dir=cache_dir, storage_options=storage_options)
            self.source: Any = built_source(config, self.streams, sources, topology_args=topology_args,
                                            group_args=group_args)
            # What users and integrations read of built data (the source's engine holds the same values).
            self.sources, self.manifests, self.caches, self.table = sources, sources.manifests, sources.caches, \
                sources.table
            self.num_samples, self.stored_token_dtype = self.source.engine.num_samples, \
                self.source.engine.stored_token_dtype
        else:
            if "seq_len" not in text:
                raise TypeError("StreamingDataset(..., tokenizer=...) reads raw text and needs seq_len= (the tokens "
                                "a model reads per sample)")
            self.source = raw_text_source(source, RawTextSettings(tokenizer=tokenizer, **text), config,
                                          topology_args=topology_args, group_args=group_args,
                                          storage_options=storage_options, cache_dir=cache_dir)
        self.sample_length = self.source.sample_length
        self.batch_size = batch_size
        self._standalone = self.source.standalone(batch_size)

    # -- what users ask of the data ------------------------------------------------------------
    def resolve_topology(self) -> Topology:
        """Rank, world and node layout, resolved now (see `shardkit.loaders.delivery.topology`)."""
        return self.source.topology()

    def identity(self) -> str:
        """Identity of the data and of how it becomes samples (stream weights too), not of its location."""
        return self.source.identity()

    def stream_identities(self) -> list[str]:
        """Per stream, in sample-id order, the identity of its data (not its weight)."""
        return self.source.stream_identities()

    def fingerprint(self) -> str:
        """Deprecated spelling of `identity()` (the release before renovation 2 named it so); warns, then answers."""
        warnings.warn("StreamingDataset.fingerprint() is now StreamingDataset.identity(); fingerprint() will be "
                      "removed in a later release", DeprecationWarning, stacklevel=2)
        return self.identity()

    def provenance(self, sample_ids: Sequence[int], *, state: dict[str, Any] | None = None) -> Provenance:
        """Where each sample id comes from: its place (shard or lane), document segments and tokens
        (`Source.provenance`; `state`: a loader state saved before those samples, where raw text may start)."""
        return self.source.provenance(sample_ids, state=state)

    @property
    def epoch(self) -> int:
        """The epoch of the next standalone iteration."""
        return self._standalone.epoch

    # -- standalone state (torch DataLoader, torchdata StatefulDataLoader) ---------------------
    def state_dict(self) -> dict[str, Any]:
        """Where a standalone iteration stands (torch `DataLoader`, torchdata `StatefulDataLoader`): a loader
        state (`shardkit.loaders.state.loader_state`) with this process's batches of the current epoch. Inside a DataLoader
        worker it is that worker's state (StatefulDataLoader saves one per worker).

        Raises:
            ValueError: the dataset has no `batch_size` (it is driven by a `StreamingDataLoader`: save that), or
                the source keeps no standalone state (raw text: the loader keeps its lanes' cursors).
        """
        return self._standalone.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Start the next standalone iteration where `state` stands: this dataset's own `state_dict()` (also
        one DataLoader worker's) or a `StreamingDataLoader.state_dict()`; with `allow_mixture_change`, continue
        from the saved position with this dataset's streams and weights when they differ from the saved ones.

        Raises:
            ValueError: the state is malformed, belongs to another order, or is a worker's state loaded
                into another number of workers.
        """
        self._standalone.load_state_dict(state, allow_mixture_change=allow_mixture_change)

    def set_epoch(self, epoch: int) -> None:
        """Epoch of the next standalone iteration (a `StreamingDataLoader` manages epochs itself).

        The epoch the dataset already stands in keeps its position: a state just loaded (frameworks such as
        accelerate call `set_epoch(current epoch)` on resume, after the load) or the rest of an iteration that
        was broken off. Another epoch starts from its beginning.

        Raises:
            ValueError: `epoch` is not an integer >= 0, or the source has no epochs (raw text).
        """
        self._standalone.set_epoch(epoch)

    def __len__(self) -> int:
        return self._standalone.length()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | dict[str, Any]]:
        return self.source.batches(self._standalone)
