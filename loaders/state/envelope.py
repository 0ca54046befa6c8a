"""The loader state as users save it: one versioned envelope for every source (version 2).

```
{"kind": "shardkit.StreamingDataLoader", "version": 2,
 "source": "built" | "raw" | "mixture",          # the kind of source that wrote it
 "identity": "...",                               # Source.identity(): what the state is bound to
 "topology": {"world_size": 2, "global_batch_size": 16},       # when saved (a resume may differ)
 "position": {"epoch": 0, "samples": 4096},      # global positions of the epoch's order consumed
 "order": {...},                                  # what the order depends on, for this kind of source only
 "streams": {IDENTITY: {"index": 0, "kind": "built" | "raw", ...each stream's own state...}},
 "mixture": {...},                                # mixtures only: weights, counts, anchor, changes
 ...}                                             # built only, where they apply: window_segments
                                                  # (token budgets), quarantine; a DataLoader worker's: worker
```

The position counts samples, not steps: a resume on another world size or batch size continues the same global
order from the same position (elastic), so steps are what a position divides into, not what it is. A raw-text
stream's state is its lanes' cursors, unreadable-unit cuts and dry lanes, numbered within the stream; a built
stream's order is the whole dataset's (one shuffled order over every built stream), so its entry holds only what
names it.

Inside the loader the stages still read one flat record (`loader_state.LoaderState`): `encode` and `decode` convert,
and `decode` also reads version 1 (the flat record itself, written before this envelope) and checks every field's
type and range, naming the field (a damaged or hand-edited state is refused before anything is adopted).
"""

from __future__ import annotations

from typing import Any

STATE_KIND = "shardkit.StreamingDataLoader"
VERSION = 2
FLAT_VERSION = 1  # the flat record, as version 1 states were written
# Counts and positions above this are damage, not data (2**62 positions is far beyond any corpus).
LIMIT = 1 << 62
_BUILT_ORDER = ("num_samples", "seed", "shuffle", "num_partitions", "block_size", "shuffle_window", "partial_batches",
                "epoch_size", "max_tokens", "token_window", "skip_samples")
# What a raw source's flat record holds in the built order fields (they mean nothing for lanes).
_RAW_FLAT = {"num_samples": 0, "block_size": None, "shuffle_window": 0, "partial_batches": "drop", "epoch_size": None,
             "max_tokens": None, "window_segments": [], "skip_samples": [], "quarantine": []}
# A cursor row: [lane, samples, lane epoch, unit, segment, within, ...]: the lane's reader may append fields (a
# restart point inside the segment), and rows without them stay loadable. A cut row: [unit, epoch, segment, samples].
_CURSOR_LENGTH, _CUT_LENGTH = 6, 4
_DRY_LENGTH = 2  # a dry lane row: [lane, samples it holds in all]


def encode(flat: dict[str, Any]) -> dict[str, Any]:
    """The envelope of a flat record (`LoaderState.to_flat()`, with a worker's extra fields)."""
    raw = flat.get("raw_text")
    kind = "built" if raw is None else ("mixture" if "streams" in raw else "raw")
    state: dict[str, Any] = {
        "kind": STATE_KIND, "version": VERSION, "source": kind, "identity": flat["dataset"],
        "topology": {"world_size": flat["world_size"], "global_batch_size": flat["global_batch_size"]},
        "position": {"epoch": flat["epoch"], "samples": flat["samples_consumed"]}}
    if kind == "built":
        state["order"] = {name: flat[name] for name in _BUILT_ORDER}
        mixture = flat.get("mixture")
        state["streams"] = _built_streams(flat["dataset"], mixture)
        if mixture is not None:
            state["mixture"] = mixture
        if flat["max_tokens"] is not None:
            state["window_segments"] = flat["window_segments"]
        if flat["quarantine"]:
            state["quarantine"] = flat["quarantine"]
    else:
        state["order"] = {"seed": flat["seed"], "shuffle": flat["shuffle"], "lanes": flat["num_partitions"]}
        if flat.get("identity_parts") is not None:
            state["identity_parts"] = flat["identity_parts"]
        if kind == "raw":
            state["streams"] = {flat["dataset"]: {"index": 0, "kind": "raw", "lanes": flat["num_partitions"],
                                                  "cursors": raw["cursors"], "unreadable": raw["unreadable"]}}
            if raw.get("dry_lanes"):  # lanes left out of the order (`sources.raw.dry_lanes`)
                state["streams"][flat["dataset"]]["dry_lanes"] = raw["dry_lanes"]
        else:
            state["streams"], state["mixture"] = _mixture_streams(raw), raw["mixture"]
            if raw["mixture"] is None or raw.get("global_batch") != raw["mixture"].get("global_batch"):
                state["lanes_global_batch"] = raw.get("global_batch")
    if "worker_steps" in flat:
        state["worker"] = {"index": flat["worker"], "of": flat["num_workers"], "steps": flat["worker_steps"]}
    return state


def decode(state: Any) -> dict[str, Any]:
    """The flat record of a saved state of either version.

    Raises:
        ValueError: not a loader state, another version, or a field of the wrong type or out of range (named).
    """
    if not isinstance(state, dict):
        raise ValueError(f"loader state must be a dict, got {type(state).__name__}")
    if state.get("kind") != STATE_KIND:
        raise ValueError(f"not a StreamingDataLoader state (kind={state.get('kind')!r})")
    version = state.get("version")
    if version == FLAT_VERSION:
        return {**_checked_flat(state), "legacy_identities": True}
    if version != VERSION:
        raise ValueError(f"loader state version {version!r} is not supported (this shardkit reads versions "
                         f"{FLAT_VERSION} and {VERSION})")
    kind = _field(state, "source", str)
    if kind not in ("built", "raw", "mixture"):
        raise ValueError(f"loader state: source must be 'built', 'raw' or 'mixture', got {kind!r}")
    topology, position = _field(state, "topology", dict), _field(state, "position", dict)
    order, streams = _field(state, "order", dict), _field(state, "streams", dict)
    flat: dict[str, Any] = {
        "version": FLAT_VERSION, "kind": STATE_KIND, "dataset": _field(state, "identity", str),
        "world_size": _count(topology, "world_size", "topology.", low=1),
        "global_batch_size": _count(topology, "global_batch_size", "topology.", low=1),
        "epoch": _count(position, "epoch", "position."), "samples_consumed": _count(position, "samples", "position.")}
    entries = sorted(streams.items(), key=lambda item: _count(item[1], "index", f"streams[{item[0][:16]}].")
                     if isinstance(item[1], dict) else -1)
    if kind == "built":
        flat.update({name: order.get(name) for name in _BUILT_ORDER})
        flat["window_segments"], flat["quarantine"] = state.get("window_segments", []), state.get("quarantine", [])
        if "mixture" in state:
            flat["mixture"] = state["mixture"]
    else:
        flat.update(_RAW_FLAT, seed=order.get("seed"), shuffle=order.get("shuffle"),
                    num_partitions=_count(order, "lanes", "order."))
        if "identity_parts" in state:
            flat["identity_parts"] = _field(state, "identity_parts", dict)
        if kind == "raw":
            if len(entries) != 1:
                raise ValueError(f"loader state: a raw-text state holds one stream, got {len(entries)}")
            name, entry = entries[0]
            flat["raw_text"] = {"cursors": _rows(entry, "cursors", name, _CURSOR_LENGTH),
                                "unreadable": _rows(entry, "unreadable", name, _CUT_LENGTH)}
            if "dry_lanes" in entry:
                flat["raw_text"]["dry_lanes"] = _rows(entry, "dry_lanes", name, _DRY_LENGTH)
        else:
            flat["raw_text"] = _flat_mixture(entries, state)
    if "worker" in state:
        worker = _field(state, "worker", dict)
        flat.update(worker=_count(worker, "index", "worker."), num_workers=_count(worker, "of", "worker.", low=1),
                    worker_steps=_count(worker, "steps", "worker."))
    return flat


def position(state: dict[str, Any]) -> tuple[int, int, int]:
    """(epoch, samples consumed, global batch size when saved) of a saved state of either version."""
    flat = decode(state)
    return flat["epoch"], flat["samples_consumed"], flat["global_batch_size"]


# -- streams ---------------------------------------------------------------------------------------
def _unique(key: str, taken: dict[str, Any], index: int) -> str:
    """A stream's key: its identity, or identity#index where the same data is mixed twice."""
    return key if key not in taken else f"{key}#{index}"


def _built_streams(dataset: str, mixture: dict[str, Any] | None) -> dict[str, Any]:
    if mixture is None:
        return {dataset: {"index": 0, "kind": "built"}}
    streams: dict[str, Any] = {}
    for i, stream in enumerate(mixture.get("streams") or ()):
        streams[_unique(str(stream.get("identity")), streams, i)] = {"index": i, "kind": "built",
                                                                      "url": stream.get("url")}
    return streams


def _mixture_streams(raw: dict[str, Any]) -> dict[str, Any]:
    """Each stream of a raw+built mixture with its own lanes' cursors and cuts (renumbered from the mixture's
    global lane and unit numbers: a stream's lanes and units follow the raw streams before it)."""
    record = raw.get("mixture") or {}
    identities = [s.get("identity") for s in record.get("streams") or ()]
    streams: dict[str, Any] = {}
    lane = unit = 0
    cursors, cuts = raw["cursors"], raw["unreadable"]
    for i, (url, weight, is_raw, lanes, *units) in enumerate(raw["streams"]):
        key = _unique(str(identities[i] if i < len(identities) else url), streams, i)
        entry: dict[str, Any] = {"index": i, "kind": "raw" if is_raw else "built", "url": url, "weight": weight}
        if is_raw:
            entry["lanes"] = lanes
            if units:
                entry["units"] = units[0]
            entry["cursors"] = [[row[0] - lane, *row[1:]] for row in cursors if lane <= row[0] < lane + lanes]
            entry["unreadable"] = ([[row[0] - unit, *row[1:]] for row in cuts if unit <= row[0] < unit + units[0]]
                                   if units else [])
            lane += lanes
            unit += units[0] if units else 0
        streams[key] = entry
    return streams


def _flat_mixture(entries: list[tuple[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    rows, cursors, cuts = [], [], []
    lane = unit = 0
    for name, entry in entries:
        where = f"streams[{name[:16]}]."
        is_raw = _field(entry, "kind", str, where) == "raw"
        row = [entry.get("url"), entry.get("weight"), is_raw, _count(entry, "lanes", where) if is_raw else 0]
        if is_raw:
            units = entry.get("units")
            cursors += [[r[0] + lane, *r[1:]] for r in _rows(entry, "cursors", name, _CURSOR_LENGTH)]
            if units is not None:
                units = _count(entry, "units", where)
                cuts += [[r[0] + unit, *r[1:]] for r in _rows(entry, "unreadable", name, _CUT_LENGTH)]
                unit += units
            lane += row[3]
        else:
            units = 0
        rows.append(row if units is None else [*row, units])
    mixture = state.get("mixture")
    global_batch = state["lanes_global_batch"] if "lanes_global_batch" in state else (mixture or {}).get("global_batch")
    return {"cursors": sorted(cursors), "unreadable": cuts, "streams": rows, "global_batch": global_batch,
            "mixture": mixture}


# -- checks ----------------------------------------------------------------------------------------
def _field(data: Any, name: str, kind: type, where: str = "") -> Any:
    value = data.get(name) if isinstance(data, dict) else None
    if not isinstance(value, kind):
        raise ValueError(f"loader state: {where}{name} must be a {kind.__name__}, got {value!r}"[:300])
    return value


def _count(data: Any, name: str, where: str = "", *, low: int = 0) -> int:
    """An integer field in [low, LIMIT)."""
    value = data.get(name) if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < LIMIT:
        raise ValueError(f"loader state: {where}{name} must be an integer in [{low}, 2**62), got {value!r}"[:300])
    return value


def _rows(entry: Any, name: str, stream: str, length: int) -> list[list[int]]:
    """A stream's rows of `length` integers in [0, LIMIT)."""
    rows = entry.get(name, []) if isinstance(entry, dict) else None
    where = f"streams[{stream[:16]}].{name}"
    if not isinstance(rows, list):
        raise ValueError(f"loader state: {where} must be a list, got {rows!r}"[:300])
    return [_int_row(row, f"{where}[{i}]", length) for i, row in enumerate(rows)]


def _int_row(row: Any, where: str, length: int) -> list[int]:
    exact = length != _CURSOR_LENGTH  # cursor rows: at least `length` (see _CURSOR_LENGTH)
    if (not isinstance(row, (list, tuple)) or (len(row) != length if exact else not length <= len(row) <= 2 * length)
            or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < LIMIT for v in row)):
        raise ValueError(f"loader state: {where} must be {length}{'' if exact else ' or more'} integers in [0, 2**62), "
                         f"got {row!r}"[:300])
    return list(row)


def _checked_flat(state: dict[str, Any]) -> dict[str, Any]:
    """A version 1 state, its counts and raw rows checked as version 2's are."""
    for name, low in (("epoch", 0), ("samples_consumed", 0), ("world_size", 1), ("global_batch_size", 1)):
        if name in state:
            _count(state, name, low=low)
    raw = state.get("raw_text")
    if isinstance(raw, dict):
        for name, length in (("cursors", _CURSOR_LENGTH), ("unreadable", _CUT_LENGTH)):
            rows = raw.get(name, [])
            if not isinstance(rows, list):
                raise ValueError(f"loader state: raw_text.{name} must be a list, got {rows!r}"[:300])
            for i, row in enumerate(rows):
                _int_row(row, f"raw_text.{name}[{i}]", length)
    return state
