"""`RawTextDataset`: train straight from raw text; what `StreamingDataset(inputs, tokenizer=..., seq_len=...)` is.

The corpus is read by lanes (`raw_lanes` for the order, `raw_source` for the reading): each rank builds the
rows of its slice of every global step from the lanes they fall in, tokenizing and packing only those lanes.
The dataset's `RawTextPlan` is what a `StreamingDataLoader` talks to (`raw_loader.RawTextDataLoader`): where the
next iteration starts (consumed positions and the lanes' cursors) and the state's order fields.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .raw_batches import CURSORS_KEY, UNREADABLE_KEY, raw_batch
from .raw_lanes import lane_sample_counts, position_lanes, rank_step_positions
from .raw_source import CURSOR_FIELDS, DEFAULT_UNIT_BYTES, LaneStream, RawCorpus, RawTextSettings, RejectionLog
from .raw_unreadable import UnitCuts, Unreadable, check_policy
from .tensors import batch_to_tensors
from .topology import Topology, check_topology_args, data_parallel_group, resolve_topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawIteration:
    """Where an iteration starts: consumed global positions, the lanes' cursors, the batch, the topology and the
    unreadable units' cuts in force."""

    start: int
    batch_size: int
    topology: Topology
    cursors: dict[int, tuple[int, ...]] = field(default_factory=dict)
    cuts: UnitCuts = field(default_factory=UnitCuts)


@dataclass
class StepPart:
    """The rows of one step that one DataLoader worker read: their row numbers in the rank's batch, global
    positions, samples and lane epochs; the cursors of its lanes after them; the documents it rejected and the
    units it found unreadable."""

    rows: np.ndarray
    positions: np.ndarray
    samples: list = field(default_factory=list)
    epochs: list = field(default_factory=list)
    cursors: np.ndarray | None = None
    rejected: Counter = field(default_factory=Counter)
    unreadable: list[Unreadable] = field(default_factory=list)


class RawTextPlan:
    """What the data loader asks of a raw-text dataset (the raw counterpart of `ReadPlan`)."""

    def __init__(self, corpus: RawCorpus, *, seed: int, shuffle: bool, token_dtype: str | None, segment_ids: bool,
                 topology_args: dict[str, int | None], group_args: dict[str, Any], on_corrupt: str = "raise"):
        self.corpus, self.seed, self.shuffle, self.on_corrupt = corpus, seed, shuffle, on_corrupt
        self.token_dtype, self.segment_ids = token_dtype, segment_ids
        self.next_iteration: RawIteration | None = None
        self.claimed = False
        self._topology_args, self._group_args = topology_args, group_args

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_group_args"] = dict.fromkeys(self._group_args)  # process groups do not pickle
        return state

    @property
    def num_lanes(self) -> int:
        return self.corpus.num_lanes

    def topology(self) -> Topology:
        return resolve_topology(**self._topology_args, **self._group_args)

    def agreement_group(self) -> Any:
        """The data-parallel process group (None: the default group)."""
        return data_parallel_group(**self._group_args)

    def order_values(self) -> dict[str, Any]:
        """The state's order fields: what the samples depend on."""
        return {"dataset": self.corpus.fingerprint, "seed": self.seed, "shuffle": self.shuffle,
                "num_partitions": self.num_lanes}

    def raw_state(self) -> dict[str, Any]:
        """The state's `raw_text` fields besides the cursors (a mixture's record of its streams; none here)."""
        return {}

    def restore(self, raw_text: dict[str, Any], cursors: dict[int, tuple[int, ...]], cuts: UnitCuts, *,
                samples_consumed: int = 0, allow_mixture_change: bool = False
                ) -> tuple[dict[int, tuple[int, ...]], UnitCuts]:
        """Take the state's `raw_text` fields besides the cursors and cuts, and return those as this dataset
        numbers its lanes and units (a mixture's plan may change its streams and weights at `samples_consumed`:
        `RawMixturePlan.restore`)."""
        return cursors, cuts

    # With fewer lanes than readers some ranks or workers read nothing (`raw_loader.warn_few_lanes` says why).
    few_lanes_idle_readers = True

    def lane_stream(self, lane: int, log: RejectionLog, cursor: tuple[int, ...], cuts: UnitCuts) -> LaneStream:
        """Lane `lane`'s stream of samples from `cursor` on, its units read as `cuts` say."""
        return LaneStream(self.corpus, lane, log, seed=self.seed, shuffle=self.shuffle, cursor=cursor, cuts=cuts,
                          skip_unreadable=self.on_corrupt == "skip")

    def lane_counts(self, samples_consumed: int) -> np.ndarray:
        """Samples of each lane among the first `samples_consumed` positions."""
        return lane_sample_counts(samples_consumed, self.num_lanes)

    def unit_url(self, unit: int) -> str:
        """The file of unit `unit` (as cuts number units)."""
        return self.corpus.unit_url(unit)

    def claim(self) -> None:
        self.claimed = True

    def begin(self, iteration: RawIteration) -> None:
        self.next_iteration = iteration


class LaneReaders:
    """The lanes one process reads in an iteration, each started at the iteration's cursor when first read, with
    the iteration's cuts."""

    def __init__(self, plan: RawTextPlan, iteration: RawIteration):
        self.plan, self.iteration = plan, iteration
        self.log, self.streams = RejectionLog(), {}

    def take(self, lane: int, index: int, part: StepPart) -> tuple[Any, int]:
        """(sample `index` of `lane`, its lane epoch); rejections and unreadable units reported in `part`'s."""
        stream = self.streams.get(lane)
        if stream is None:
            cursor = self.iteration.cursors.get(lane, (0,) * CURSOR_FIELDS)
            stream = self.streams[lane] = self.plan.lane_stream(lane, self.log, cursor, self.iteration.cuts)
        # each step's part counts the rejections of the segments it began, and the units it cut
        stream.rejected, stream.unreadable = part.rejected, part.unreadable
        return stream.take(index)

    def cursor_rows(self, lanes: np.ndarray) -> np.ndarray:
        """[lane, *cursor] of each of `lanes` (read already), by lane."""
        return np.array([[lane, *self.streams[lane].cursor.as_tuple()] for lane in sorted(set(lanes.tolist()))],
                        dtype=np.int64).reshape(-1, 1 + CURSOR_FIELDS)


class RawTextDataset(IterableDataset):
    """Streams raw text, tokenized and packed on the fly, to every rank (built through `StreamingDataset`).

    Args:
        inputs: files, directories, globs or fsspec URLs of JSONL (.gz/.zst), Parquet or .txt inputs.
        tokenizer, seq_len, pack, text_field, txt_mode, unit_bytes, lanes, eos_id, bos_id, max_doc_chars,
            bestfit_buffer, bestfit_open: see `RawTextSettings`.
        seed, shuffle: the lanes' unit orders (shuffled per lane epoch by default).
        on_corrupt: a unit that cannot be read: "raise" (stop, naming its file), or "skip" it on every rank alike
            (`shardkit.loaders.raw_unreadable`). `skip_samples` and `quarantine_list` are refused (see there why).
        token_dtype: dtype of the batches' tokens (default: the smallest that holds the vocabulary).
        segment_ids: add dense per-token `segment_ids` to each batch.
        rank, world_size, local_rank, local_world_size, process_group, device_mesh, mesh_dim: the topology.
        storage_options: fsspec options of remote inputs.
        batch_size: samples per rank per step when iterated without `StreamingDataLoader`.
    """

    raw_text = True  # `isinstance(dataset, StreamingDataset)` holds (`StreamingDataset.__subclasshook__`)

    def __init__(self, inputs: str | Sequence[str], *, tokenizer: str, seq_len: int, pack: str = "concat",
                 text_field: str = "text", txt_mode: str = "file", unit_bytes: int = DEFAULT_UNIT_BYTES,
                 lanes: int = 64,
                 eos_id: int | str | None = "auto", bos_id: int | str | None = None,
                 max_doc_chars: int = 10_000_000, bestfit_buffer: int = 2048, bestfit_open: int = 512,
                 seed: int = 0, shuffle: bool = True, token_dtype: str | None = None, segment_ids: bool = False,
                 rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                 local_world_size: int | None = None, process_group: Any = None, device_mesh: Any = None,
                 mesh_dim: Any = None, storage_options: dict[str, Any] | None = None, batch_size: int | None = None,
                 on_corrupt: str = "raise", skip_samples: Any = None, quarantine_list: str | None = None):
        super().__init__()
        check_policy(on_corrupt, skip_samples, quarantine_list)
        settings = RawTextSettings(tokenizer=tokenizer, seq_len=seq_len, pack=pack, text_field=text_field,
                                   txt_mode=txt_mode, unit_bytes=unit_bytes, lanes=lanes, eos_id=eos_id,
                                   bos_id=bos_id, max_doc_chars=max_doc_chars, bestfit_buffer=bestfit_buffer,
                                   bestfit_open=bestfit_open)
        topology_args = dict(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)
        check_topology_args(**topology_args)
        self.corpus = RawCorpus([inputs] if isinstance(inputs, str) else list(inputs), settings, storage_options)
        self.plan = RawTextPlan(self.corpus, seed=seed, shuffle=shuffle, token_dtype=token_dtype,
                                segment_ids=segment_ids, topology_args=topology_args,
                                group_args=dict(process_group=process_group, device_mesh=device_mesh,
                                                mesh_dim=mesh_dim), on_corrupt=on_corrupt)
        self.batch_size = batch_size
        self.sample_length = None if pack == "none" else seq_len + 1
        self.rejected: Counter = Counter()  # rejected documents by reason, of the units this process started

    def resolve_topology(self) -> Topology:
        return self.plan.topology()

    def state_dict(self) -> dict[str, Any]:
        """Refused: the resume state (the lanes' cursors) is the loader's. torchdata's `StatefulDataLoader` calls
        this; without it, it would resume by reading every consumed batch again.

        Raises:
            ValueError: always, naming `StreamingDataLoader`.
        """
        raise ValueError("a raw-text StreamingDataset keeps no resume state of its own: iterate "
                         "StreamingDataLoader(dataset, batch_size=N) and save its state_dict() (the lanes' cursors; "
                         "it resumes exactly, on any number of ranks and workers), not torchdata's StatefulDataLoader")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state_dict()  # the same refusal

    def fingerprint(self) -> str:
        """Identity of the inputs and of how they become samples."""
        return self.corpus.fingerprint

    def stream_identities(self) -> list[str]:
        """Per stream, in sample-id order, the identity of its data and of how it becomes samples (not its weight):
        what a run records so that `shardkit trace` can check it reads the same data again."""
        return [self.corpus.fingerprint]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan = self.plan
        iteration = plan.next_iteration
        info = get_worker_info()
        if info is not None:  # a DataLoader worker: its lanes' rows of every step (the loader assembles them)
            if iteration is None:
                raise ValueError("a raw-text StreamingDataset in DataLoader workers needs StreamingDataLoader")
            return self.parts(iteration, worker=info.id, num_workers=info.num_workers)
        if iteration is None:  # iterated on its own: from the start, tensors out
            if self.batch_size is None:
                raise ValueError("iterating a raw-text StreamingDataset on its own needs batch_size=; or use "
                                 "StreamingDataLoader")
            iteration = RawIteration(start=0, batch_size=self.batch_size, topology=plan.topology())
            if plan.on_corrupt == "skip" and iteration.topology.world_size > 1:
                raise ValueError("on_corrupt='skip' on several ranks needs StreamingDataLoader (the ranks agree on "
                                 "what to skip through it)")
            return (batch_to_tensors({k: v for k, v in b.items() if k not in (CURSORS_KEY, UNREADABLE_KEY)},
                                     plan.token_dtype)
                    for b in self.batches(iteration))
        return self.batches(iteration)

    def batches(self, iteration: RawIteration) -> Iterator[dict[str, np.ndarray]]:
        """This rank's numpy batches, step after step from `iteration.start` (endless: lanes go on epoch after
        epoch), each with the cursors of the lanes it read under `CURSORS_KEY`."""
        return (self.assemble([part]) for part in self.parts(iteration, worker=0, num_workers=1))

    def parts(self, iteration: RawIteration, *, worker: int, num_workers: int) -> Iterator[StepPart]:
        """Per step, the rows of this rank's slice whose lanes belong to `worker` (lane % num_workers): one part
        per step, empty or not, so the DataLoader's round robin over workers keeps the parts of a step together."""
        plan, topology = self.plan, iteration.topology
        readers = LaneReaders(plan, iteration)
        step = 0
        while True:
            positions = rank_step_positions(step, start=iteration.start, world_size=topology.world_size,
                                            batch_size=iteration.batch_size, rank=topology.rank,
                                            num_lanes=plan.num_lanes)
            lanes, indices = position_lanes(positions, plan.num_lanes)
            rows = np.flatnonzero(lanes % num_workers == worker)
            part = StepPart(rows=rows, positions=positions[rows])
            for lane, index in zip(lanes[rows].tolist(), indices[rows].tolist()):
                sample, epoch = readers.take(lane, index, part)
                part.samples.append(sample)
                part.epochs.append(epoch)
            part.cursors = readers.cursor_rows(lanes[rows])
            step += 1
            yield part

    def assemble(self, parts: list[StepPart]) -> dict[str, np.ndarray]:
        """One step's batch from its parts (the rows in the rank's order), with the lanes' cursors under
        `CURSORS_KEY`; the parts' rejections are counted in `rejected`."""
        rows = np.concatenate([p.rows for p in parts])
        order = np.argsort(rows, kind="stable")
        samples = [s for p in parts for s in p.samples]
        epochs = [e for p in parts for e in p.epochs]
        corpus = self.corpus
        batch = raw_batch([samples[i] for i in order], np.concatenate([p.positions for p in parts])[order],
                          [epochs[i] for i in order], pad_id=corpus.pad_id, token_dtype=corpus.token_dtype,
                          variable=self.sample_length is None, dense_segments=self.plan.segment_ids)
        batch[CURSORS_KEY] = np.concatenate([p.cursors for p in parts])
        batch[UNREADABLE_KEY] = [u for p in parts for u in p.unreadable]
        for part in parts:
            self.rejected.update(part.rejected)
        return batch
