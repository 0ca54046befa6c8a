"""`LaneEngine`: the read side of data read by lanes, held by a raw-text source (`sources.raw.source.RawTextSource`)
and by a mixture with raw-text streams (`sources.mixture.MixtureSource`).

The engine is what the loader's feed (`sources.raw.feed.RawTextFeed`), the standalone iteration
(`sources.raw.source.RawStandalone`) and a data service's workers (`sources.service.parts`) talk to: the topology,
the ranks' agreement on the corpora, where the next iteration starts (`begin`, which travels to DataLoader workers
with the dataset), the batches of an iteration (a worker's parts, or whole numpy batches) and the documents
rejected on the way. Where the lanes are and how their rows fall into steps is its `plan`'s (`LanePlan`: the raw
source itself for one corpus, `sources.mixture_lanes.MixtureLanes` for a mixture), and so is the order's part of
the resume state; the engine hands those questions on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from torch.utils.data import get_worker_info

from ...config import LoaderConfig
from ...delivery.frameworks import check_framework, iterating_loader
from ...delivery.parent_watch import watch_parent
from ...delivery.topology import Topology, data_parallel_group, resolve_topology
from ...order.lanes import NO_DRY_LANES
from ...state.loader_state import LoaderState
from .agreement import check_ranks_see_one_corpus
from .batches import CURSORS_KEY, DRY_KEY, UNREADABLE_KEY, raw_batch
from .iteration import RawIteration, StepPart
from .unreadable import UnitCuts


class LanePlan(Protocol):
    """Where the lanes of a lane-read source are, how a step's rows fall on them, and the order's state fields.

    Attributes:
        num_lanes: lanes in all (a mixture's: over its raw streams).
        few_lanes_idle_readers: with fewer lanes than readers some readers read nothing (warned about).
        corpus: the (first) corpus: padding id and token dtype of the batches.
    """

    num_lanes: int
    few_lanes_idle_readers: bool
    corpus: Any

    def prepare(self, iteration: RawIteration) -> None:
        """Fix what an iteration starting at `iteration` needs before it travels to DataLoader workers."""

    def parts(self, iteration: RawIteration, *, worker: int, num_workers: int) -> Iterator[StepPart]:
        """Per step, the rows of this rank's slice that `worker` reads (one part per step, empty or not)."""

    def row_columns(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Per-row columns of a batch besides the samples' own."""

    def lane_counts(self, samples_consumed: int, dry: Mapping[int, int] = NO_DRY_LANES) -> np.ndarray:
        """Samples of each lane among the first `samples_consumed` positions."""

    def lane_unit_count(self, lane: int) -> int:
        """Units in lane `lane`."""

    def unit_url(self, unit: int) -> str:
        """The file of unit `unit`, as cuts number units."""

    def order_values(self) -> dict[str, Any]:
        """The state's order fields."""

    def identity_parts(self) -> dict[str, Any] | None:
        """The identity part by part (None: not split)."""

    def upgrade_legacy(self, saved: LoaderState) -> LoaderState:
        """A version 1 state with identities by today's recipe."""

    def raw_state(self) -> dict[str, Any]:
        """The state's `raw_text` fields besides the cursors."""

    def restore(self, raw_text: dict[str, Any], cursors: dict[int, tuple[int, ...]], cuts: UnitCuts, *,
                samples_consumed: int = 0, allow_mixture_change: bool = False
                ) -> tuple[dict[int, tuple[int, ...]], UnitCuts]:
        """Take the saved `raw_text` fields; the saved cursors and cuts as this plan numbers its lanes and units."""


class LaneEngine:
    """The reading of a lane-read source: topology, agreement, iterations, batches and rejections.

    Args:
        plan: the lanes (`LanePlan`).
        corpora: every corpus read (what the ranks agree on before the first batch).
        config: the loader options (on_corrupt, token_dtype, segment_ids).
        sample_length: tokens per sample (None: variable-length samples).
        topology_args, group_args: the explicit topology and the process group or mesh (`StreamingDataset`).
    """

    def __init__(self, plan: LanePlan, corpora: list[Any], config: LoaderConfig, *, sample_length: int | None,
                 topology_args: dict[str, int | None], group_args: dict[str, Any]):
        self.plan, self.corpora, self.corpus = plan, corpora, plan.corpus
        self.on_corrupt, self.token_dtype, self.segment_ids = config.on_corrupt, config.token_dtype, config.segment_ids
        self.sample_length = sample_length
        self.next_iteration: RawIteration | None = None
        self.claimed = False
        self.rejected: Counter = Counter()  # rejected documents by reason, of the units this process started
        self._corpus_agreed = False
        self._topology_args, self._group_args = topology_args, group_args

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_group_args"] = dict.fromkeys(self._group_args)  # process groups do not pickle
        return state

    def topology(self) -> Topology:
        topology = resolve_topology(**self._topology_args, **self._group_args)
        # As for built data: a framework among the callers that runs the dataset the wrong way is refused where
        # every path learns the world size (shardkit.loaders.delivery.frameworks).
        check_framework(topology.world_size, standalone=not self.claimed)
        return topology

    def agreement_group(self) -> Any:
        """The data-parallel process group (None: the default group)."""
        return data_parallel_group(**self._group_args)

    def check_corpus_agreed(self) -> None:
        """Before the first batch: the ranks read one corpus (`sources.raw.agreement`; one small collective).

        Raises:
            ValueError: some rank lists other files or sizes, naming it and the file.
        """
        if not self._corpus_agreed:
            check_ranks_see_one_corpus(self.corpora, world_size=self.topology().world_size,
                                       group=self.agreement_group())
            self._corpus_agreed = True

    def claim(self) -> None:
        self.claimed = True

    def begin(self, iteration: RawIteration) -> None:
        """Where the next iteration starts (read by the DataLoader workers the dataset is sent to)."""
        self.plan.prepare(iteration)
        self.next_iteration = iteration

    # -- what the feed asks of the plan ------------------------------------------------------------
    @property
    def num_lanes(self) -> int:
        return self.plan.num_lanes

    @property
    def few_lanes_idle_readers(self) -> bool:
        return self.plan.few_lanes_idle_readers

    def lane_counts(self, samples_consumed: int, dry: Mapping[int, int] = NO_DRY_LANES) -> np.ndarray:
        return self.plan.lane_counts(samples_consumed, dry)

    def lane_unit_count(self, lane: int) -> int:
        return self.plan.lane_unit_count(lane)

    def unit_url(self, unit: int) -> str:
        return self.plan.unit_url(unit)

    def order_values(self) -> dict[str, Any]:
        return self.plan.order_values()

    def identity_parts(self) -> dict[str, Any] | None:
        return self.plan.identity_parts()

    def upgrade_legacy(self, saved: LoaderState) -> LoaderState:
        return self.plan.upgrade_legacy(saved)

    def raw_state(self) -> dict[str, Any]:
        return self.plan.raw_state()

    def restore(self, raw_text: dict[str, Any], cursors: dict[int, tuple[int, ...]], cuts: UnitCuts, *,
                samples_consumed: int = 0, allow_mixture_change: bool = False
                ) -> tuple[dict[int, tuple[int, ...]], UnitCuts]:
        return self.plan.restore(raw_text, cursors, cuts, samples_consumed=samples_consumed,
                                 allow_mixture_change=allow_mixture_change)

    def parts(self, iteration: RawIteration, *, worker: int, num_workers: int) -> Iterator[StepPart]:
        return self.plan.parts(iteration, worker=worker, num_workers=num_workers)

    def row_columns(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        return self.plan.row_columns(sample_ids)

    # -- reading -------------------------------------------------------------------------------
    def batches(self, standalone: Any) -> Iterator[Any]:
        """What `iter(dataset)` yields (`Source.batches`)."""
        iteration = self.next_iteration
        info = get_worker_info()
        if info is not None:  # a DataLoader worker: its lanes' rows of every step (the loader assembles them)
            if iteration is None:
                raise ValueError("a raw-text StreamingDataset in DataLoader workers needs StreamingDataLoader")
            if iteration.worker_start is not None:  # persistent workers: where the loader stands now
                iteration = iteration.worker_start.read(iteration)
            watch_parent()  # a worker must not outlive its parent (shardkit.loaders.delivery.parent_watch)
            return self.plan.parts(iteration, worker=info.id, num_workers=info.num_workers)
        refuse_other_loaders(self.claimed)
        if iteration is None:  # iterated on its own: from the start, tensors out
            return standalone.batches()
        return self.step_batches(iteration)

    def step_batches(self, iteration: RawIteration) -> Iterator[dict[str, np.ndarray]]:
        """This rank's numpy batches, step after step from `iteration.start` (endless: lanes go on epoch after
        epoch), each with the cursors of the lanes it read under `CURSORS_KEY`."""
        return (self.assemble([part]) for part in self.plan.parts(iteration, worker=0, num_workers=1))

    def assemble(self, parts: list[StepPart]) -> dict[str, np.ndarray]:
        """One step's batch from its parts (the rows in the rank's order), with the lanes' cursors under
        `CURSORS_KEY`; the parts' rejections are counted in `rejected`."""
        if len(parts) == 1:  # one reader: its rows (increasing, as every part's) are the batch's, in order
            samples, positions, epochs = parts[0].samples, parts[0].positions, parts[0].epochs
        else:
            order = np.argsort(np.concatenate([p.rows for p in parts]), kind="stable")
            samples = [s for p in parts for s in p.samples]
            epochs = [e for p in parts for e in p.epochs]
            samples, positions = [samples[i] for i in order], np.concatenate([p.positions for p in parts])[order]
            epochs = [epochs[i] for i in order]
        corpus = self.corpus
        batch = raw_batch(samples, positions, epochs, pad_id=corpus.pad_id, token_dtype=corpus.token_dtype,
                          variable=self.sample_length is None, dense_segments=self.segment_ids)
        batch.update(self.plan.row_columns(batch["sample_id"]))
        batch[CURSORS_KEY] = np.concatenate([p.cursors for p in parts])
        batch[UNREADABLE_KEY] = [u for p in parts for u in p.unreadable]
        batch[DRY_KEY] = [d for p in parts for d in p.dry]
        for part in parts:
            self.rejected.update(part.rejected)
        return batch


def refuse_other_loaders(claimed: bool) -> None:
    """Refuse a torch `DataLoader` or torchdata `StatefulDataLoader` iterating raw text, before its first batch:
    the lanes' cursors are the loader's state, which they would never save (a resume would read every batch
    again), and a dataset a `StreamingDataLoader` drives would be read past that loader's state.

    Raises:
        ValueError: naming StreamingDataLoader.
    """
    loader = iterating_loader()
    if loader is None:
        return
    owner = " (the dataset of a StreamingDataLoader: iterate that loader itself)" if claimed else ""
    raise ValueError(f"a raw-text StreamingDataset iterated by {loader}{owner} keeps no resume state: its lanes' "
                     "cursors are the state of StreamingDataLoader(dataset, batch_size=N), which resumes exactly on "
                     "any number of ranks and workers; iterate that and save its state_dict() (docs/INTEGRATIONS.md)")
