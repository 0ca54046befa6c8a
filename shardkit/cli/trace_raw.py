"""`shardkit trace RUN_DIR --step N` for a run that trained on raw text (`--data GLOB --tokenizer SPEC`).

No shard holds such a run's samples: a logged id is a position of the raw dataset (or, in a mixture, an item of a
raw stream or a built stream's sample), and the loader made it by reading one lane's units in that lane epoch's
order and packing their documents. So the run's raw dataset is built again from its `config.json`, exactly as the
trainer built it (`shardkit.train.data.raw_text_dataset`), and each lane is read again up to the samples asked for:
the same documents, tokenized and packed again. The reading starts where the newest of the run's checkpoints
before the step left each lane (its loader state: a cursor per lane, and the unreadable units it cut), so a step
costs at most the text the loader read between that checkpoint and the step; without a checkpoint, each lane is
read from its start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.loaders.order.lanes import position_lanes
from shardkit.loaders.sources.raw.corpus import CURSOR_FIELDS, RejectionLog


@dataclass(frozen=True)
class RawRun:
    """A raw-text run's dataset as the trainer built it, its `--data`, and where its checkpoints are."""

    dataset: Any
    spec: str
    checkpoints: Path


def raw_run(run_dir: Path, data: str | None, options: dict[str, Any] | None,
            recorded: list[dict[str, Any]] | None = None) -> RawRun | None:
    """The raw-text run at `run_dir` (`data`: other inputs for it, e.g. after a move), or None for a run on built
    data. A mixture's streams are those `recorded` at the step's start (`samples/streams.jsonl`: a resume may have
    changed them), each of weight 1: weights do not decide which data a sample id is.

    Raises:
        ValueError: the run's configuration cannot be read.
    """
    from shardkit.loaders.order.mixing import Stream
    from shardkit.train.config import config_from_dict
    from shardkit.loaders.sources.built.streams import holds_manifest
    from shardkit.train.data import raw_source, raw_text_dataset, storage_options

    path = run_dir / "config.json"
    try:
        values = json.loads(path.read_text())
        raw = bool(values["data"]["tokenizer"])
    except FileNotFoundError:
        return None  # no configuration: the run's datasets come from --data (built data)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot read the run's configuration {path} ({err})") from err
    if not raw:
        return None
    config = config_from_dict(values)
    spec = data or config.data.data
    where = dict(storage_options=options or storage_options(config.data), rank=0, world_size=1)
    source = raw_source(spec, where["storage_options"], built_as_built=False)
    # A run from before each stream was recorded has one record for a whole mixture: its configuration decides.
    if data is None and recorded and not isinstance(source[0], str) and (len(recorded) > 1 or len(source) == 1):
        source = [Stream(s["url"], 1.0, raw_text=not holds_manifest(s["url"], where["storage_options"]))
                  for s in recorded]
        spec = " ".join(s["url"] for s in recorded)
    dataset = raw_text_dataset(source, config.data, seq_len=config.model.seq_len, shuffle=config.data.loader.shuffle,
                               **where)
    return RawRun(dataset, spec, Path(config.checkpoint.checkpoint_dir or run_dir / "checkpoints"))


def loader_state_before(run: RawRun, step: int, since: int = 0) -> tuple[int, dict[str, Any]] | None:
    """(its step, the loader state) of the newest complete checkpoint of `run` saved from step `since` (the start
    whose streams were in force at `step`) on and before `step`, loaded into a loader over the run's dataset as the
    trainer loaded it (a mixture changed at `since` changes there: seed keys, lanes and units renumbered): its lane
    cursors and cuts, numbered for this dataset. None when there is none (a damaged one is passed over)."""
    from shardkit.loaders.dataloader import StreamingDataLoader
    from shardkit.train.checkpoint import complete_checkpoints, read_rank_state

    for saved_step, path in complete_checkpoints(run.checkpoints):
        if not since <= saved_step < step:
            continue
        try:
            state = read_rank_state(path)["loader"]
            loader = StreamingDataLoader(run.dataset, batch_size=1)
            loader.load_state_dict(state, allow_mixture_change=True)
        except (ValueError, KeyError, TypeError):
            continue
        return saved_step, loader.local_state_dict()
    return None


@dataclass(frozen=True)
class RawPlace:
    """Where a sample id of a raw-text run comes from: raw text `url`'s lane `lane`, its sample `index`, or a
    mixture's built stream `url`, its sample `local`."""

    url: str
    lane: int = -1
    index: int = -1
    local: int = -1


class _Unlogged(RejectionLog):
    """Rejected documents are the run's own: reading them again does not log them again."""

    def log(self, url, where, reason) -> None:
        pass


class RawRunSamples:
    """The samples of a raw-text run by sample id, read again lane by lane (see the module docstring)."""

    def __init__(self, dataset: Any, spec: str):
        self.dataset, self.plan, self.spec = dataset, dataset.source, spec
        self.order = getattr(self.plan, "order", None)  # a mixture's `MixedOrder`
        self.lane_count = self.plan.num_lanes
        self.lanes_read = 0  # lane samples packed by `read`

    def place(self, sample_id: int) -> RawPlace:
        """Where `sample_id` comes from.

        Raises:
            ValueError: a negative id.
        """
        if sample_id < 0:
            raise ValueError(f"sample id {sample_id} is negative")
        if self.order is None:  # one raw dataset: the id is the position
            [lane], [index] = position_lanes(np.array([sample_id]), self.lane_count)
            return RawPlace(self.spec, lane=int(lane), index=int(index))
        [stream], [lane], [index] = self.order.places_of_ids(np.array([sample_id]))
        url = self.plan.streams[int(stream)].url
        return RawPlace(url, lane=int(lane), index=int(index)) if lane >= 0 else RawPlace(url, local=int(index))

    def read(self, places: list[RawPlace], state: dict[str, Any] | None = None) -> dict[tuple[int, int], Any]:
        """(lane, index) -> (sample, lane epoch, the lane's corpus) for every raw place, each lane read once: from
        its cursor in the loader `state` (a checkpoint's) where that stands before the samples, else its start.
        `lanes_read` counts the samples packed on the way."""
        from shardkit.loaders.sources.raw.feed import saved_cursors
        from shardkit.loaders.state.envelope import decode
        from shardkit.loaders.sources.raw.unreadable import UnitCuts

        cursors, cuts = {}, UnitCuts()
        if state is not None:
            raw = decode(state)["raw_text"]
            cursors, cuts = saved_cursors(raw), UnitCuts.from_rows(raw.get("unreadable", ()))
        wanted: dict[int, list[int]] = {}
        for place in places:
            if place.lane >= 0:
                wanted.setdefault(place.lane, []).append(place.index)
        out = {}
        for lane, indexes in sorted(wanted.items()):
            cursor = cursors.get(lane, (0,) * CURSOR_FIELDS)
            if cursor[0] > min(indexes):
                cursor = (0,) * CURSOR_FIELDS
            stream = self.plan.lane_stream(lane, _Unlogged(), cursor, cuts)
            for index in sorted(set(indexes)):
                sample, epoch = stream.take(index)
                out[(lane, index)] = (sample, epoch, stream.corpus)
            self.lanes_read += stream.cursor.samples - cursor[0]
        return out


def raw_segments(sample: Any, corpus: Any) -> list[dict[str, Any]]:
    """A raw sample's document segments as `shardkit.lineage.Segment` fields: tokens [start, end) of document
    `doc` (line, row or paragraph) of input file `source_name` (source -1: padding)."""
    if sample.doc_starts is None:
        return []
    ends = [*sample.doc_starts[1:].tolist(), len(sample.tokens)]
    segments = []
    for start, end, source, doc in zip(sample.doc_starts.tolist(), ends, sample.doc_source.tolist(),
                                       sample.doc_index.tolist()):
        name = corpus.files[source].url if source >= 0 else None
        segments.append({"start": int(start), "end": int(end), "source": int(source), "source_name": name,
                         "doc": int(doc)})
    return segments
