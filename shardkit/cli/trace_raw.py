"""`shardkit trace RUN_DIR --step N` for a run that trained on raw text (`--data GLOB --tokenizer SPEC`).

No shard holds such a run's samples: a logged id is a position of the raw dataset (or, in a mixture, an item of a
raw stream or a built stream's sample), and the loader made it by reading one lane's units in that lane epoch's
order and packing their documents. So the run's raw dataset is built again from its `config.json`, exactly as the
trainer built it (`shardkit.train.data.raw_text_dataset`), and each lane is read again up to the samples asked for:
the same documents, tokenized and packed again. That costs what the loader spent on the lane up to there (a late
step of a long run re-reads that much of each lane it names); nothing per sample is stored to make it cheaper.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.loaders.raw_lanes import position_lanes
from shardkit.loaders.raw_source import CURSOR_FIELDS, RejectionLog


def raw_run_dataset(run_dir: Path, data: str | None, options: dict[str, Any] | None) -> tuple[Any, str] | None:
    """(the raw-text dataset run `run_dir` trained on, its --data) (`data`: other inputs for it, e.g. after a move),
    or None for a run on built data.

    Raises:
        ValueError: the run's configuration cannot be read.
    """
    from shardkit.train.config import config_from_dict
    from shardkit.train.data import raw_text_dataset, storage_options

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
    dataset = raw_text_dataset(spec, config.data, seq_len=config.model.seq_len, shuffle=config.data.loader.shuffle,
                               storage_options=options or storage_options(config.data), rank=0, world_size=1)
    return (dataset, spec) if dataset is not None else None


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
        from shardkit.loaders.raw_unreadable import UnitCuts

        self.dataset, self.plan, self.spec = dataset, dataset.plan, spec
        self.order = getattr(self.plan, "order", None)  # a mixture's `MixedOrder`
        self._cuts = UnitCuts()
        self.lane_count = self.plan.num_lanes

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
        url = self.dataset.streams[int(stream)].url
        return RawPlace(url, lane=int(lane), index=int(index)) if lane >= 0 else RawPlace(url, local=int(index))

    def read(self, places: list[RawPlace]) -> dict[tuple[int, int], tuple[Any, int, Any]]:
        """(lane, index) -> (sample, lane epoch, the lane's corpus) for every raw place, each lane read once from
        its start."""
        wanted: dict[int, list[int]] = {}
        for place in places:
            if place.lane >= 0:
                wanted.setdefault(place.lane, []).append(place.index)
        out = {}
        for lane, indexes in sorted(wanted.items()):
            stream = self.plan.lane_stream(lane, _Unlogged(), (0,) * CURSOR_FIELDS, self._cuts)
            for index in sorted(set(indexes)):
                sample, epoch = stream.take(index)
                out[(lane, index)] = (sample, epoch, stream.corpus)
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
