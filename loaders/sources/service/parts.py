"""A step read in parts by several service workers, and put together again by the consumer.

Raw text (and a mixture with raw-text streams) reads a rank's step from its lanes: a lane is a stream of its own,
so the rows of a step split by lane (built rows of a mixture by shard) as the in-process loader splits them over
its DataLoader workers (`RawTextSource.parts`: part `w` of `n` holds the rows whose lane is `w` mod `n`). A
consumer fed by `n` service workers asks worker `w` for part `w` of every step; each worker tokenizes only its
lanes, and the consumer assembles each step from its `n` parts with the same function as in process
(`raw.batches.raw_batch`), in the rank's row order: the batch is the in-process one, whatever `n`.

The consumer keeps the state: a step advances the position by the global batch and sets the cursors of the lanes
its parts read (what `RawTextFeed` does with the parts of its DataLoader workers). When a part's stream breaks,
every part restarts from the state of the last batch handed out, on the workers the dispatcher names then.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.formats import Sample

from ...state.envelope import decode, encode
from ..raw.batches import raw_batch
from ..raw.corpus import cursor_rows
from ..raw.feed import saved_cursors

ROW_COLUMN = "row:"  # prefix of the per-row columns a source adds besides the samples' (a mixture's `stream`)


def step_assembly(source: Any) -> dict[str, Any] | None:
    """What a consumer needs to assemble a step from its parts (the service describes it once), or None for a
    source whose steps are not read in parts (built data: a rank's batch comes whole from one worker)."""
    source = getattr(source, "engine", None)  # what reads the source: a lane engine reads a step in parts
    if getattr(source, "parts", None) is None:
        return None
    return {"pad_id": int(source.corpus.pad_id), "token_dtype": str(np.dtype(source.corpus.token_dtype)),
            "output_dtype": source.token_dtype, "variable": source.sample_length is None,
            "dense_segments": bool(source.segment_ids)}


def served_parts(loader: Any, *, part: int, parts: int) -> Iterator[dict[str, np.ndarray]]:
    """Part `part` of `parts` of every step of `loader`'s rank, from where the loader stands (endless), as the
    arrays of one message each."""
    source = loader.dataset.source.engine  # a lane engine (`step_assembly`)
    iteration = loader.feed.iteration_here(source.topology())
    source.begin(iteration)
    steps = source.parts(iteration, worker=part, num_workers=parts)
    token_dtype = np.dtype(source.corpus.token_dtype)
    try:
        for step in steps:
            if step.unreadable or step.dry:  # the ranks' agreement on them runs in process, not yet in the service
                found = [f"{u.place} is unreadable: {u.reason}" for u in step.unreadable]
                found += [d.message for d in step.dry]
                raise ValueError(f"the data service cannot yet leave out what its readers found ({found[0]}): "
                                 "train on this corpus with the in-process loader")
            yield part_arrays(step, token_dtype, source.row_columns(step.positions))
    finally:
        steps.close()


def part_arrays(step: Any, token_dtype: np.dtype, row_columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One `StepPart` as flat arrays: its rows, their positions and lane epochs, the samples' tokens and document
    segments (concatenated, with a count per sample) and the cursors of its lanes after the step."""
    samples = step.samples

    def joined(values: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate([np.asarray(v, dtype=dtype) for v in values]) if values else np.empty(0, dtype)

    arrays = {"rows": np.asarray(step.rows, dtype=np.int64), "positions": np.asarray(step.positions, dtype=np.int64),
              "epochs": np.asarray(step.epochs, dtype=np.int64),
              "lengths": np.array([len(s.tokens) for s in samples], dtype=np.int64),
              "tokens": joined([s.tokens for s in samples], token_dtype),
              "doc_counts": np.array([len(s.doc_starts) for s in samples], dtype=np.int64),
              "doc_starts": joined([s.doc_starts for s in samples], np.int64),
              "doc_source": joined([s.doc_source for s in samples], np.int64),
              "cursors": np.asarray(step.cursors, dtype=np.int64)}
    arrays.update((ROW_COLUMN + name, np.asarray(column)) for name, column in row_columns.items())
    return arrays


@dataclass(frozen=True, kw_only=True)
class StepAssembly:
    """The consumer's side: a step's batch from its parts, and the state after it (`step_assembly`'s fields)."""

    pad_id: int
    token_dtype: str
    output_dtype: str | None
    variable: bool
    dense_segments: bool

    def batch(self, parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The step's numpy batch, rows in the rank's order (as `RawTextSource.assemble` makes it in process).

        Raises:
            ValueError: the parts do not make one step (a row missing or twice: not a shardkit service).
        """
        rows = np.concatenate([p["rows"] for p in parts])
        order = np.argsort(rows, kind="stable")
        if not np.array_equal(rows[order], np.arange(len(rows))):
            raise ValueError(f"service message: the parts of a step hold rows {sorted(rows.tolist())}, not each of "
                             f"0..{len(rows) - 1} once")
        samples = [sample for p in parts for sample in _samples(p)]
        batch = raw_batch([samples[i] for i in order], np.concatenate([p["positions"] for p in parts])[order],
                          np.concatenate([p["epochs"] for p in parts])[order].tolist(), pad_id=self.pad_id,
                          token_dtype=self.token_dtype, variable=self.variable, dense_segments=self.dense_segments)
        for name in (k for k in parts[0] if k.startswith(ROW_COLUMN)):
            batch[name[len(ROW_COLUMN):]] = np.concatenate([p[name] for p in parts])[order]
        if self.output_dtype is not None:
            batch["tokens"] = batch["tokens"].astype(self.output_dtype, copy=False)
        return batch

    @staticmethod
    def state_after(state: dict[str, Any], parts: list[dict[str, np.ndarray]], *, global_batch: int
                    ) -> dict[str, Any]:
        """The rank's loader state after the step of `parts`, from the state before it."""
        flat = decode(state)
        cursors = saved_cursors(flat["raw_text"])
        for part in parts:
            cursors.update((int(row[0]), tuple(int(v) for v in row[1:])) for row in part["cursors"])
        raw_text = {**flat["raw_text"], "cursors": cursor_rows(cursors)}
        return encode({**flat, "samples_consumed": flat["samples_consumed"] + global_batch, "raw_text": raw_text})


def _samples(part: dict[str, np.ndarray]) -> list[Sample]:
    """The part's samples, cut out of its concatenated arrays."""
    token_ends, doc_ends = np.cumsum(part["lengths"]), np.cumsum(part["doc_counts"])
    tokens = np.split(part["tokens"], token_ends[:-1]) if len(token_ends) else []
    starts = np.split(part["doc_starts"], doc_ends[:-1]) if len(doc_ends) else []
    sources = np.split(part["doc_source"], doc_ends[:-1]) if len(doc_ends) else []
    return [Sample(t, s, d) for t, s, d in zip(tokens, starts, sources)]
