"""The loader's resume state: a small record of scalars, identical on every rank.

Users save it as the versioned envelope of `state.envelope` (`LoaderState.to_dict`), nested by stream; the
stages below read this flat record (`LoaderState.from_dict` decodes either version into it).

The state is *global*: it records the epoch and how many positions of that epoch's global order
the whole job has consumed (steps handed to the training loop x world_size x batch_size). Every
rank holds the same dict, so torch.distributed.checkpoint may deduplicate it, and a job restarted on
another world size, batch size or number of workers continues the same global order from that
position (elastic resume). The remaining fields pin what the order depends on; loading a state
into a loader whose order would differ raises `ValueError` naming every difference.

The state is composed of the read side's stages (`Stage`): the order and its data (`EpochEngine`), the
mixture (`remix.Mixture`), the step source (`steps`) and the quarantine each give their fields with
`state()` and take them back from a loaded state with `restore(saved)`. The reader and the batch mode
hold no position (the step source does), so they have no state of their own.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Protocol

from ..config import DEFAULT_TOKEN_WINDOW, LoaderConfig
from ..order.skipping import normalize_skip
from .envelope import FLAT_VERSION, STATE_KIND, decode, encode

# Fields that must match for the resumed order to be the same order: the data itself and every
# `LoaderConfig` field marked as an order field (num_partitions resolved to a number).
ORDER_FIELDS = ("dataset", "num_samples", *LoaderConfig.order_fields())
# The order fields a mixture change may alter (`load_state_dict(..., allow_mixture_change=True)`).
MIXTURE_FIELDS = ("dataset", "num_samples", "epoch_size")


class Stage(Protocol):
    """A read-side stage's part of the resume state (torchdata.nodes' `get_state` / `reset(state)`)."""

    def state(self) -> dict[str, Any]:
        """This stage's fields of `LoaderState`."""
        ...

    def restore(self, saved: LoaderState) -> None:
        """Continue from a loaded state (each stage reads its own fields)."""
        ...


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """Resume state of a `StreamingDataLoader`.

    Attributes:
        epoch: current epoch.
        samples_consumed: positions of this epoch's global order handed to the training loop
            (summed over all ranks).
        dataset: fingerprint of the data (shards and stream weights).
        num_samples: samples in the dataset (all streams).
        seed, shuffle, num_partitions, block_size, shuffle_window, partial_batches, epoch_size: the
            order's parameters.
        global_batch_size: world_size x batch_size when saved (informative: resuming with another
            global batch continues from `samples_consumed`).
        world_size: data-parallel ranks when saved (informative).
        max_tokens, token_window: token-budget batching parameters (None / unused otherwise).
        window_segments: token-budget mode only: [world_size, steps] consumed in the current window
            (starting at `samples_consumed`), one entry per world size that read from it.
        mixture: mixtures only: the mixture record (`shardkit.loaders.order.remix`): streams with their
            weights or schedules, the plan's anchor (the last change) and every change (step,
            position, old and new weights).
        skip_samples: the sample ids and (source, doc) documents left out of every epoch (positions
            count in the order without them).
        quarantine: (shard index, epoch, position) of each quarantined shard: its samples are left out
            of the order from that position of that epoch's unfiltered order on (`loaders.quarantine`).
        raw_text: raw-text streams only (`shardkit.loaders.sources.raw.feed`): {"cursors": [[lane, samples, lane
            epoch, unit, segment of the unit, samples of the segment], ...]}, one per lane read so far (`num_partitions` holds the
            lanes, `dataset` the corpus and tokenization's fingerprint), and "unreadable": [[unit, lane epoch,
            segment, samples], ...], where on_corrupt="skip" cut unreadable units (`loaders.raw_unreadable`).
        identity_parts: a single raw-text dataset's identity part by part (files, tokenizer, each setting), so
            that a refusal names what differs.
        legacy_identities: read from a version 1 state, whose raw-text identities followed the old recipe
            (absolute URLs, the tokenizer's spec): the source maps them to today's before comparing.
    """

    epoch: int
    samples_consumed: int
    dataset: str
    num_samples: int
    seed: int
    shuffle: bool
    num_partitions: int
    block_size: int | None
    shuffle_window: int
    partial_batches: str
    epoch_size: int | None
    global_batch_size: int
    world_size: int
    max_tokens: int | None = None
    token_window: int = DEFAULT_TOKEN_WINDOW
    window_segments: tuple[tuple[int, int], ...] = ()
    mixture: dict[str, Any] | None = None
    skip_samples: tuple = ()
    quarantine: tuple[tuple[int, int, int], ...] = ()
    raw_text: dict[str, Any] | None = None
    identity_parts: dict[str, Any] | None = None
    legacy_identities: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "window_segments", tuple((int(w), int(n)) for w, n in self.window_segments))
        object.__setattr__(self, "skip_samples", normalize_skip(self.skip_samples))
        try:
            quarantine = tuple((int(s), int(e), int(p)) for s, e, p in self.quarantine)
        except (TypeError, ValueError):
            raise ValueError(f"loader state: quarantine must be a list of [shard, epoch, position], got "
                             f"{self.quarantine!r}"[:300]) from None
        if any(min(entry) < 0 for entry in quarantine):
            raise ValueError(f"loader state: quarantine entries must be >= 0, got {quarantine!r}"[:300])
        object.__setattr__(self, "quarantine", quarantine)
        if self.epoch < 0 or self.samples_consumed < 0:
            raise ValueError(f"loader state: epoch ({self.epoch}) and samples_consumed ({self.samples_consumed}) "
                             "must be >= 0")

    def to_dict(self, **worker: int) -> dict[str, Any]:
        """The state as users save it (`envelope.encode`); `worker`: a DataLoader worker's own fields."""
        return encode({**self.to_flat(), **worker})

    def to_flat(self) -> dict[str, Any]:
        """The flat record the stages read (as version 1 states were written)."""
        state = {"version": FLAT_VERSION, "kind": STATE_KIND, **asdict(self)}
        state["window_segments"] = [list(s) for s in self.window_segments]
        if self.mixture is None:  # a single dataset's state stays as it was
            del state["mixture"]
        if self.raw_text is None:  # likewise a built dataset's
            del state["raw_text"]
        if self.identity_parts is None:
            del state["identity_parts"]
        del state["legacy_identities"]  # how a state was read, never written
        state["skip_samples"] = [list(e) if isinstance(e, tuple) else e for e in self.skip_samples]
        state["quarantine"] = [list(q) for q in self.quarantine]
        return state

    @classmethod
    def from_dict(cls, state: Any) -> LoaderState:
        """A saved state of either version (`envelope.decode`).

        Raises:
            ValueError: not a loader state, or a field missing, of the wrong type or out of range (named).
        """
        data = decode(state)
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise ValueError(f"loader state lacks {', '.join(missing)}")
        return cls(**{k: data[k] for k in names if k in data})

    def differences(self, other: LoaderState, *, ignore: tuple[str, ...] = ()) -> list[str]:
        """Order-relevant fields (but `ignore`) whose values differ, as 'field: saved X, now Y'."""
        return [f"{name}: saved {getattr(self, name)!r}, now {getattr(other, name)!r}"
                for name in ORDER_FIELDS if name not in ignore and getattr(self, name) != getattr(other, name)]


def check_worker_steps(saved_global_batch: int | None, global_batch: int) -> None:
    """Raise when loaded DataLoader-worker steps would resume at another global batch. A worker's state counts its
    own steps; which global positions they covered depends on every worker's count, which no worker has.

    Raises:
        ValueError: saying what to resume with.
    """
    if saved_global_batch not in (None, global_batch):
        raise ValueError(f"cannot resume: the state was saved by a DataLoader worker at a global batch of "
                         f"{saved_global_batch} samples; its steps do not convert to a global batch of {global_batch} "
                         "(batch_size x world_size): resume with the saved world size and batch size, or save with "
                         "num_workers=0 or use StreamingDataLoader, whose states are global")


_unrecorded = set(ORDER_FIELDS) - {f.name for f in fields(LoaderState)}
if _unrecorded:  # an order field added to LoaderConfig must be recorded here too, or resumes go unchecked
    raise TypeError(f"LoaderState lacks the order fields {sorted(_unrecorded)} of LoaderConfig")
