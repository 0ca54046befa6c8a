"""`ServiceSource`: the data of a `shardkit serve` service, the source of `StreamingDataset(service=URL)`.

The service's workers build, for each consumer rank, the loader that rank would build in process and stream
its batches; what the source knows of the data (identity, records, shapes) the dispatcher tells it once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...delivery.topology import Topology, data_parallel_group, resolve_topology
from ...source import Feed, Source, Standalone
from .client import ServiceClient
from .parts import StepAssembly

PREFETCH = 4  # batches (or parts of steps) read ahead per stream (with gRPC's flow control, what bounds its memory)
PARTS = 8  # at most this many workers read one consumer's steps in parts (where the data's steps split)


@dataclass(frozen=True)
class ServedShape:
    """What the trainer reads of the served samples (a built stream's `Manifest` answers the same)."""

    seq_len: int | None
    sample_length: int | None
    packing: str
    tokenizer: Any
    token_dtype: str


def served_shape(fields: dict[str, Any]) -> ServedShape:
    from shardkit.manifest import TokenizerInfo

    tokenizer = fields.get("tokenizer")
    if isinstance(tokenizer, dict):
        try:
            tokenizer = TokenizerInfo(**tokenizer)
        except TypeError:
            pass  # a tokenizer spec of raw text: kept as the service sent it
    return ServedShape(seq_len=fields.get("seq_len"), sample_length=fields.get("sample_length"),
                       packing=fields.get("packing", ""), tokenizer=tokenizer, token_dtype=fields.get("token_dtype", ""))


class ServiceSource(Source):
    """The data a service at `url` serves.

    Args:
        url: the dispatcher (grpc://HOST:PORT).
        token: the service's shared token (default `$SHARDKIT_SERVICE_TOKEN`).
        timeout: seconds to wait for the service to answer, and for a worker's next batch before the stream is
            moved to another worker.
        prefetch: batches read ahead per stream (the memory bound per consumer: `prefetch` steps whatever the
            number of streams, whose parts add up to whole steps).
        parts: at most this many workers read the consumer's steps, each a part of every step, where the data's
            steps split (raw text and mixtures with raw-text streams, by lane: `parts`); 1: one worker at a time.
        expected: the data the caller means (`StreamingDataset`'s `source`), compared with what the service
            serves; None: whatever it serves.
        topology_args, group_args: the explicit topology and the process group or mesh (`StreamingDataset`).
    """

    def __init__(self, url: str, *, token: str | None, timeout: float, prefetch: int, expected: Any,
                 topology_args: dict[str, int | None], group_args: dict[str, Any], parts: int = PARTS):
        self.client = ServiceClient(url, token=token, timeout=timeout)
        self.prefetch, self.parts = prefetch, parts
        self.topology_args, self.group_args = topology_args, group_args
        self.description = self.client.action("describe", {})
        served = self.description.get("data")
        if expected is not None and isinstance(expected, str) and served is not None and expected != served:
            raise ValueError(f"the data service {url} serves {served}, not {expected} (pass the data it serves, or "
                             "none)")
        self.endless = bool(self.description["endless"])
        assembly = self.description.get("assembly")
        self.assembly = None if assembly is None else StepAssembly(**assembly)
        self.sample_length = self.description["sample_length"]
        self.token_dtype = None

    def identity(self) -> str:
        return self.description["identity"]

    def stream_identities(self) -> list[str]:
        return list(self.description["stream_identities"])

    def stream_records(self) -> list[dict[str, Any]]:
        return [dict(record) for record in self.description["stream_records"]]

    def shapes(self) -> list[tuple[str, Any]]:
        return [(where, served_shape(fields)) for where, fields in self.description["shapes"]]

    def describe(self) -> str:
        return f"{self.description['describe']} served by {self.client.url}"

    def topology(self) -> Topology:
        return resolve_topology(**self.topology_args, **self.group_args)

    def topology_group(self) -> Any:
        """The data-parallel process group (None: the default group): what raw-text states are gathered over."""
        return data_parallel_group(**self.group_args)

    def claim(self) -> None:
        pass

    def batches(self, standalone: Standalone) -> Iterator[Any]:
        return standalone.batches()

    def feed(self, loader: Any, batch_size: int | None) -> Feed:
        from .feed import ServiceFeed

        return ServiceFeed(self, loader, batch_size)

    def standalone(self, batch_size: int | None) -> Standalone:
        return ServiceStandalone()


class ServiceStandalone(Standalone):
    """A service dataset is read through `StreamingDataLoader` only (it keeps the stream's state)."""

    def _refuse(self) -> Any:
        raise TypeError("a StreamingDataset(service=...) is read through StreamingDataLoader(dataset, batch_size=...)"
                        ", which keeps its position")

    def batches(self) -> Iterator[dict[str, Any]]:
        self._refuse()
        yield {}

    def length(self) -> int:
        return self._refuse()

    def state_dict(self) -> dict[str, Any]:
        return self._refuse()

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        self._refuse()

    def set_epoch(self, epoch: int) -> None:
        self._refuse()

    @property
    def epoch(self) -> int:
        return 0


def served_source(url: str, *, token: str | None, timeout: float, expected: Any,
                  topology_args: dict[str, int | None], group_args: dict[str, Any]) -> ServiceSource:
    """The `ServiceSource` of `StreamingDataset(source, service=url, ...)`.

    Raises:
        ValueError: a bad address or timeout.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"service_timeout must be a positive number of seconds, got {timeout!r}")
    return ServiceSource(url, token=token, timeout=float(timeout), prefetch=PREFETCH, expected=expected,
                         topology_args=topology_args, group_args=group_args)
