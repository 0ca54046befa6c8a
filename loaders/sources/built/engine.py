"""`EpochEngine`: the read side of built shards, epochs of a global order; held by a one-dataset `BuiltSource`
(`sources.built.source`) and by a mixture of built datasets (`sources.mixture.MixtureSource`).

The engine composes the read side's stages: the epoch's order (partitions, `skip_samples`, quarantine exclusions:
`order.effective`), the mixture record (`remix.Mixture`: the weighted plan of a mixture, or of a single dataset
whose mixture was changed to it), the batch mode chosen once from the config (`sources.built.batch_modes`), the
reader (`reading.BatchReader`), and where the next iteration starts (`next_iteration`, which travels to DataLoader
workers with the dataset). The loader's feed (`feed.BuiltFeed`) and the standalone iteration
(`standalone.BuiltStandalone`) talk to the engine, never to the source that holds it. As a stage of the resume
state it gives and checks the order's fields (`state()` / `restore(saved)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import get_worker_info

from .batch_modes import batch_mode
from .standalone import this_worker
from ...config import LoaderConfig
from ...order.effective import effective_order
from ...state.fingerprint import data_fingerprint
from ...delivery.frameworks import check_framework
from ...order.mixing import Stream
from ...order.epochs import Order
from ...order.quarantine import QuarantineSources, resolve_quarantine_list
from ...order.rank_steps import IterationPlan, rank_step_ids
from .reading import BatchReader
from ...order.remix import Mixture, MixtureStreams
from ...order.schedule import weight_spec
from ...order.skipping import resolve_skipped
from .provenance import built_provenance
from ...source import Provenance, Standalone
from .streams import Sources
from ...state.loader_state import MIXTURE_FIELDS, LoaderState
from ...delivery.tensors import batch_to_tensors, bundled, strip_progress
from ...delivery.topology import Topology, data_parallel_group, resolve_topology

_MEMO_ORDERS = 4  # an epoch's order with quarantine scans the epoch once: keep the last few


class EpochEngine:
    """The order, identity, mixture record, batch mode and reader of built streams (one dataset or a weighted
    mixture of several), and where the next iteration starts.

    Args:
        config: the loader options.
        streams: the streams read (one, or a mixture's).
        sources: their storage, manifests and caches, opened.
        topology_args: explicit rank, world_size, local_rank, local_world_size (None: resolved).
        group_args: process_group, device_mesh, mesh_dim (dropped when pickled to workers).
    """

    def __init__(self, config: LoaderConfig, streams: list[Stream], sources: Sources, *,
                 topology_args: dict[str, int | None], group_args: dict[str, Any]):
        self.config, self.streams, self.sources = config, streams, sources
        self.num_samples = sum(m.num_samples for m in sources.manifests)
        batch_format = sources.batch_format()
        self.sample_length, self.stored_token_dtype = batch_format["sample_length"], batch_format["token_dtype"]
        self.reader = BatchReader(table=sources.table, caches=sources.caches, shard_owner=sources.owners,
                                  manifests=sources.manifests, dense_segments=config.segment_ids,
                                  prefetch=config.prefetch, **batch_format)
        self.batching = batch_mode(config)
        self.mixture = Mixture(self._mixture_streams, mixed=len(streams) > 1)
        self.listed_quarantine = (resolve_quarantine_list(config.quarantine_list, sources.manifests,
                                                          [s.url for s in streams])
                                  if config.quarantine_list is not None else ())
        self.num_partitions: int | None = config.num_partitions  # resolved with the topology, kept on resume
        self.next_iteration: IterationPlan | None = None  # set by the loader (`begin`); read by the dataset
        self._iterations = 0  # iterations of `next_iteration` begun: persistent workers take later epochs
        # Set by the StreamingDataLoader that drives this dataset: another loader iterating it on its own (what
        # accelerator.prepare() builds around a prepared loader's dataset) would bypass the loader's batching and
        # state, so standalone iteration is refused then.
        self.claimed = False
        self._topology_args, self._group_args = topology_args, group_args
        self._skipped: np.ndarray | None = None  # skip_samples resolved to sample ids (on first use)
        self._orders: dict[tuple, Order] = {}
        self._identities: dict[str | int, str] = {}  # see identity(): computed once, O(shards) each

    def __getstate__(self) -> dict:
        # Process groups and meshes do not pickle; workers get the topology through the iteration plan.
        state = self.__dict__.copy()
        state["_group_args"] = dict.fromkeys(self._group_args)
        return state

    # -- topology and partitions ---------------------------------------------------------------
    def topology(self) -> Topology:
        """Rank, world and node layout, resolved now; also fixes the partitions of the order (`num_partitions`,
        else one per node of the first run, kept on resume so that an elastic resume continues the same order)."""
        topology = resolve_topology(**self._topology_args, **self._group_args)
        # A framework among the callers that runs the dataset the wrong way is refused here, where every path
        # (the loader, standalone iteration, a state) learns the world size (shardkit.loaders.delivery.frameworks).
        check_framework(topology.world_size, standalone=not self.claimed)
        if self.num_partitions is None:
            self.num_partitions = topology.num_nodes
        return topology

    def agreement_group(self) -> Any:
        """The data-parallel process group (None: the default group)."""
        return data_parallel_group(**self._group_args)

    # -- the order -----------------------------------------------------------------------------
    def order(self, epoch: int, num_partitions: int, quarantine: tuple[tuple[int, int, int], ...] = ()) -> Order:
        """The global order of `epoch` (pure function of manifests, seed, epoch and partitions), without the
        skipped samples and the positions of quarantined shards (`shardkit.loaders.order.quarantine`)."""
        key = (epoch, num_partitions, tuple(quarantine))
        if key in self._orders:
            return self._orders[key]
        record = self.mixture.record
        order = effective_order(self.sources.shard_sizes, self.config.order_config(num_partitions), epoch,
                                mixture=record.plan if record is not None else None,
                                skipped=self.skipped_ids() if self.config.skip_samples and record is None else None,
                                quarantine=quarantine)
        if quarantine:  # quarantine scans the epoch's order once: keep the last few
            if len(self._orders) >= _MEMO_ORDERS:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = order
        return order

    def skipped_ids(self) -> np.ndarray:
        """The sample ids `skip_samples` leaves out (resolved once, in the process that first asks: the
        loader's main process, before workers start, so documents are looked up only there)."""
        if self._skipped is None:
            self._skipped = resolve_skipped(self.config.skip_samples, self.sources.manifests[0],
                                            self.sources.caches[0])
        return self._skipped

    @property
    def positions_per_epoch(self) -> int:
        """Samples in one epoch's order (a mixture's epoch_size, else all samples not skipped)."""
        if len(self.streams) == 1:
            return self.num_samples - (len(self.skipped_ids()) if self.config.skip_samples else 0)
        return self.config.epoch_size or self.num_samples

    # -- identity ------------------------------------------------------------------------------
    def identity(self) -> str:
        """Identity of the data (shard names, sizes and hashes, stream weights), not of its location."""
        if "all" not in self._identities:
            weights = [weight_spec(s.weight) for s in self.streams] if len(self.streams) > 1 else []
            self._identities["all"] = data_fingerprint(self.sources.manifests, weights)
        return self._identities["all"]

    def stream_identities(self) -> list[str]:
        """Per stream, the identity it has as a dataset of its own (its shards, not its weight)."""
        manifests = self.sources.manifests
        if len(manifests) == 1:
            return [self.identity()]  # one stream: no weights, the same value
        for i, manifest in enumerate(manifests):
            if i not in self._identities:
                self._identities[i] = data_fingerprint([manifest], [])
        return [self._identities[i] for i in range(len(manifests))]

    def stream_records(self) -> list[dict[str, Any]]:
        return [{"url": stream.url, "fingerprint": identity, "num_samples": manifest.num_samples}
                for stream, identity, manifest in zip(self.streams, self.stream_identities(), self.sources.manifests)]

    def provenance(self, sample_ids: Sequence[int], *, state: dict[str, Any] | None = None) -> Provenance:
        return built_provenance(self.sources.storages, self.sources.manifests, sample_ids)

    def shapes(self) -> list[tuple[str, Any]]:
        return [(stream.url, manifest) for stream, manifest in zip(self.streams, self.sources.manifests)]

    def describe(self) -> str:
        return ", ".join(stream.url for stream in self.streams)

    def _mixture_streams(self) -> MixtureStreams:
        return MixtureStreams(urls=[s.url for s in self.streams], fingerprints=self.stream_identities(),
                              weights=[s.weight for s in self.streams], epoch_size=self.positions_per_epoch,
                              policy=self.config.partial_batches)

    # -- the order's part of the resume state --------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The order's fields of `LoaderState` (data identity, order options, partitions, mixture record)."""
        return {**self.config.order_values(), "num_partitions": self.num_partitions, "dataset": self.identity(),
                "num_samples": self.num_samples, **self.mixture.state()}

    def restore(self, saved: LoaderState, *, allow_mixture_change: bool = False) -> bool:
        """Check that `saved` continues this dataset's order and adopt its partitions and mixture record; with
        `allow_mixture_change`, continue from the saved position with this dataset's streams and weights.
        True when the mixture changed.

        Raises:
            ValueError: a raw-text state, the order differs (every difference named), or only the mixture does and
                `allow_mixture_change` is off, or the change cannot be made exactly.
        """
        if saved.raw_text is not None:
            raise ValueError("cannot resume: the saved loader state is raw text's (a raw-text dataset, or a mixture "
                             "with raw-text streams), this loader reads built datasets only")
        explicit = self.config.num_partitions
        values = {**self.config.order_values(), "dataset": self.identity(), "num_samples": self.num_samples,
                  "num_partitions": explicit if explicit is not None else saved.num_partitions}
        current = dataclasses.replace(saved, **values)
        differences, fixed = saved.differences(current), saved.differences(current, ignore=MIXTURE_FIELDS)
        if fixed or (differences and not allow_mixture_change):
            hint = ("" if fixed else "; to continue with the new mixture from the saved position, pass "
                    "allow_mixture_change=True (shardkit train: --allow-mixture-change)")
            raise ValueError("cannot resume: the saved loader state belongs to another order ("
                             + "; ".join(differences) + ")" + hint)
        self.mixture.restore(saved, changed=bool(differences))
        self.num_partitions = saved.num_partitions
        return bool(differences)

    # -- iterations --------------------------------------------------------------------------
    def batches(self, standalone: Standalone) -> Iterator[Any]:
        taken = self.take_iteration()
        if taken is None:
            return standalone.batches()
        iteration, offset = taken
        worker, num_workers = this_worker()
        epoch, first = iteration.epoch + offset, offset == 0
        batches = self.batching.batches(self.reader, self.order(epoch, iteration.num_partitions, iteration.quarantine),
                                        epoch=epoch, start=iteration.start if first else 0, iteration=iteration,
                                        worker=worker, num_workers=num_workers,
                                        segments=iteration.segments if first else (),
                                        limit=iteration.steps if first else None)
        if get_worker_info() is not None and iteration.bundle > 1:
            return bundled(batches, iteration.bundle)
        if iteration.numpy_batches:
            return batches
        return (batch_to_tensors(strip_progress(b), self.config.token_dtype) for b in batches)

    def claim(self) -> None:
        """Mark the engine as driven by a `StreamingDataLoader` (its standalone iteration is refused then)."""
        self.claimed = True

    def begin(self, iteration: IterationPlan) -> None:
        """Where the next iteration starts; later iterations (persistent workers) take later epochs."""
        self.next_iteration, self._iterations = iteration, 0

    def take_iteration(self) -> tuple[IterationPlan, int] | None:
        """(the iteration plan, epochs after its own) of an iteration starting now; None when no loader began
        one (the dataset iterates on its own)."""
        if self.next_iteration is None:
            return None
        offset, self._iterations = self._iterations, self._iterations + 1
        return self.next_iteration, offset

    # -- what the quarantine and the readers ask -----------------------------------------------
    def quarantine_sources(self) -> QuarantineSources:
        """The functions and values the loader's quarantine works with (it is never handed the plan)."""
        table = self.sources.table
        return QuarantineSources(order=self.order, rank_shards=self.rank_shards, shard_ends=table.ends,
                                 shard_sizes=table.sizes, describe=self.sources.describe_shard,
                                 verify=self.sources.verify_shard, agreement_group=self.agreement_group,
                                 listed=self.listed_quarantine, listed_path=self.config.quarantine_list,
                                 checking=self.config.on_corrupt == "skip")

    def rank_shards(self, order: Order, *, start: int, steps: int, plan: IterationPlan) -> list[int]:
        """Shards this rank reads in the first `steps` steps from `start` (in the order it needs them)."""
        shards: dict[int, None] = {}
        for ids in rank_step_ids(order, start=start, plan=plan, policy=self.config.partial_batches,
                                 chunk_samples=self.config.chunk_samples, limit=steps):
            shards.update(dict.fromkeys(self.reader.shards_in_order(ids)))
        return list(shards)
