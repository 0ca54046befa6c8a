"""What travels between a `shardkit serve` service and its consumers: requests as JSON, batches as Arrow.

A consumer asks a worker for one rank's batches from a loader state (`StreamRequest`, the Flight ticket); the
worker answers with one Arrow record batch per loader batch. Each array of the batch is one column holding a
single list (its values, flattened: the columns of one message differ in length), and the message's metadata
(JSON) gives the arrays' shapes and the loader state after the batch. No pickle crosses the wire: a malformed
message is refused with a `ValueError` that names what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PROTOCOL = 1
MAX_REQUEST_BYTES = 64 * 2**20  # a raw-text state with many lanes is a few hundred KiB; anything past this is not ours
REFUSED = "refused: "  # prefix of a server error that retrying elsewhere cannot cure (the consumer raises it)


@dataclass(frozen=True, kw_only=True)
class StreamRequest:
    """A consumer's request: the batches of `rank` of `world_size` (its node layout too: the order may depend on
    it), `batch_size` samples per rank per step, from `state` (None: from the start).

    Attributes:
        identity: the data the consumer reads (`Source.identity()`); a worker serving other data refuses.
        part, parts: with `parts` > 1, only part `part` of every step (a step read in parts by several workers:
            `parts.served_parts`); 1: whole batches.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    batch_size: int
    identity: str
    state: dict[str, Any] | None = None
    allow_mixture_change: bool = False
    part: int = 0
    parts: int = 1

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size", "batch_size", "part", "parts"):
            value, least = getattr(self, name), 0 if name in ("rank", "local_rank", "part") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"stream request: {name} must be an integer >= {least}, got {value!r}")
        if self.rank >= self.world_size or self.local_rank >= self.local_world_size or self.part >= self.parts:
            raise ValueError(f"stream request: rank {self.rank} of {self.world_size} (local {self.local_rank} of "
                             f"{self.local_world_size}, part {self.part} of {self.parts}) is outside its world")
        if not isinstance(self.identity, str) or not self.identity:
            raise ValueError("stream request: identity must be the data's identity (a non-empty string)")
        if not isinstance(self.allow_mixture_change, bool):
            raise ValueError("stream request: allow_mixture_change must be true or false")
        if self.state is not None and not isinstance(self.state, dict):
            raise ValueError(f"stream request: state must be a loader state (a JSON object) or null, got "
                             f"{type(self.state).__name__}")

    def to_bytes(self) -> bytes:
        return json.dumps({"protocol": PROTOCOL, **asdict(self)}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StreamRequest:
        """Raises: ValueError: not a request of this protocol (naming what is wrong)."""
        fields = decode_object(data, what="stream request")
        if fields.pop("protocol", None) != PROTOCOL:
            raise ValueError(f"stream request: protocol must be {PROTOCOL} (a consumer of another shardkit version?)")
        try:
            return cls(**fields)
        except TypeError as err:
            known = sorted(cls.__dataclass_fields__)
            raise ValueError(f"stream request: its fields must be {known}, got {sorted(fields)}") from err


def decode_object(data: bytes, *, what: str) -> dict[str, Any]:
    """A JSON object from a message body.

    Raises:
        ValueError: too large, not UTF-8 JSON, or not an object.
    """
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"{what}: {len(data)} bytes is over the limit of {MAX_REQUEST_BYTES}")
    try:
        fields = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{what}: not a JSON object ({err})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{what}: not a JSON object (got {type(fields).__name__})")
    return fields


def batch_schema(batch: dict[str, np.ndarray]) -> Any:
    """The stream's Arrow schema: one list column per array of the batch (its dtype)."""
    import pyarrow as pa

    return pa.schema([(name, pa.large_list(pa.from_numpy_dtype(array.dtype))) for name, array in batch.items()])


def encode_batch(batch: dict[str, np.ndarray], schema: Any, *, state: dict[str, Any], last: bool) -> tuple[Any, bytes]:
    """(record batch, metadata) of one loader batch and the loader state after it; `batch` empty: a message
    that only carries the state (the end of an epoch)."""
    import pyarrow as pa

    columns, shapes = [], {}
    for field in schema:
        array = np.ascontiguousarray(batch[field.name]) if batch else np.empty(0, field.type.value_type.to_pandas_dtype())
        shapes[field.name] = list(array.shape)
        values = pa.array(array.reshape(-1), type=field.type.value_type)
        offsets = pa.array([0, len(values)] if batch else [0], type=pa.int64())
        columns.append(pa.LargeListArray.from_arrays(offsets, values))
    record = pa.RecordBatch.from_arrays(columns, schema=schema) if columns else \
        pa.RecordBatch.from_pylist([], schema=schema)
    return record, json.dumps({"shapes": shapes, "state": state, "last": last, "rows": 1 if batch else 0}).encode()


def decode_batch(record: Any, metadata: bytes | None) -> tuple[dict[str, np.ndarray], dict[str, Any], bool]:
    """(arrays, state after them, last of the iteration) of one message; the arrays are empty for a message
    that only carries the state.

    Raises:
        ValueError: the message does not hold what `encode_batch` writes.
    """
    if metadata is None:
        raise ValueError("service message without metadata (not a shardkit service?)")
    meta = decode_object(metadata.to_pybytes() if hasattr(metadata, "to_pybytes") else metadata,
                         what="service message")
    shapes, state = meta.get("shapes"), meta.get("state")
    if not isinstance(shapes, dict) or not isinstance(state, dict) or not isinstance(meta.get("last"), bool):
        raise ValueError("service message: its metadata must hold shapes, state and last")
    arrays: dict[str, np.ndarray] = {}
    if meta.get("rows"):
        for name in record.schema.names:
            column = record.column(name)
            # A copy: the message's buffers are read-only and freed with it, the training loop owns its tensors.
            values = np.array(column.values.to_numpy(zero_copy_only=False))
            try:
                arrays[name] = values.reshape(shapes[name])
            except (KeyError, ValueError, TypeError):
                raise ValueError(f"service message: array {name!r} does not have its shape {shapes.get(name)}") \
                    from None
    return arrays, state, meta["last"]
