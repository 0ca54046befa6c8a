"""Prometheus metrics of the build, the loaders and the trainer: one table, one registry, one endpoint.

Every metric is defined once, in `METRICS` (name, type, help, labels); the registry, the HTTP
endpoint and the reference in docs/OBSERVABILITY.md (`python -m shardkit.metrics --markdown`) are
generated from that table, so code and docs cannot drift. Names follow Prometheus conventions:
`shardkit_` prefix, base units (seconds, bytes, ratios), `_total` on counters. Label values are
bounded and never hold sample ids, paths with credentials or URLs: `stream` is the last component
of a dataset URL with any user-info removed, `cause` an error class or S3 error code.

The modules that do the work call one function per event (`inc`, `add`, `cache_lookup`, ...);
this module imports nothing from the build, the loaders or the trainer.

DataLoader worker processes report through their parent by aggregation, not by prometheus_client's
multiprocess mode: a worker keeps its increments in a small dict keyed by (metric, labels) and the
DataLoader's collate step (which runs in the worker) attaches them to the next batch it sends; the
parent adds them to its registry when it receives the batch. Why: multiprocess mode needs
`PROMETHEUS_MULTIPROC_DIR` set before prometheus_client is first imported in every process, a
directory per run to clean up after crashes, and gives gauges per-pid semantics; aggregation works
the same with fork, spawn and persistent workers and needs no files. The price: a worker's counts
arrive with its next batch (a few steps late), and what a worker does after its last batch (a
prefetch it will never use) is not counted. Only additive values (counters, gauge increments) travel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardkit.process_info import loader_worker_info

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its Prometheus name, type ("counter", "gauge" or "histogram"), help and label names."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    section: str = ""


def _specs(section: str, *rows: tuple) -> tuple[MetricSpec, ...]:
    return tuple(MetricSpec(name, kind, help, tuple(labels), section) for name, kind, help, labels in rows)


METRICS: tuple[MetricSpec, ...] = (
    *_specs(
        "build",
        ("shardkit_build_documents_read_total", "counter", "Input documents (lines, rows, paragraphs) read.", ()),
        ("shardkit_build_documents_written_total", "counter", "Documents accepted and packed into samples.", ()),
        ("shardkit_build_documents_rejected_total", "counter",
         "Documents rejected, by reason (the report's categories, e.g. 'malformed JSON').", ("reason",)),
        ("shardkit_build_tokens_total", "counter", "Document tokens packed (BOS/EOS included).", ()),
        ("shardkit_build_input_bytes_total", "counter", "Input file bytes consumed (as stored, compressed).", ()),
        ("shardkit_build_output_bytes_total", "counter", "Shard bytes written (as stored, compressed).",
         ("shard_format",)),
        ("shardkit_build_shards_written_total", "counter", "Shards written.", ("shard_format",)),
        ("shardkit_build_worker_busy_seconds_total", "counter",
         "Seconds the tokenizer workers spent parsing and tokenizing work units (all workers added).", ()),
    ),
    *_specs(
        "storage",
        ("shardkit_storage_requests_total", "counter",
         "Storage calls attempted, each retry counted, by operation (read = GET, stat, list, write, delete).",
         ("operation",)),
        ("shardkit_storage_retries_total", "counter",
         "Storage calls retried after a transient error, by operation and cause (S3 error code, "
         "http_STATUS or exception class).", ("operation", "cause")),
    ),
    *_specs(
        "loader",
        ("shardkit_loader_downloaded_bytes_total", "counter", "Shard bytes downloaded by the node cache.",
         ("stream", "shard_format")),
        ("shardkit_loader_download_seconds_total", "counter", "Seconds spent downloading shards.",
         ("stream", "shard_format")),
        ("shardkit_loader_decode_seconds_total", "counter", "Seconds spent decoding downloaded shards.",
         ("stream", "shard_format")),
        ("shardkit_loader_wait_seconds_total", "counter",
         "Seconds the consumer waited inside the data loader's next() for a batch.", ()),
        ("shardkit_loader_batches_total", "counter",
         "Batches the data loader handed to the consumer (published every 64 batches or every second).", ()),
        ("shardkit_loader_prefetch_queue_depth", "gauge",
         "Shard prefetches submitted and not yet finished (this process and its DataLoader workers).", ()),
        ("shardkit_loader_quarantined_shards_total", "counter",
         "Shards quarantined while loading: corrupt after their re-read (on_corrupt='skip'), or named by a "
         "quarantine_list given at a resume.", ("stream",)),
        ("shardkit_loader_quarantined_samples_total", "counter",
         "Samples left out of an epoch because their shard was quarantined.", ("stream",)),
        ("shardkit_loader_skipped_units_total", "counter",
         "Raw-text work units skipped as unreadable (on_corrupt='skip'), by input file.", ("stream",)),
        ("shardkit_loader_documents_rejected_total", "counter",
         "Raw-text documents the loader rejected, by reason (the build report's categories), counted by the rank "
         "that tokenized them.", ("reason",)),
        ("shardkit_cache_hits_total", "counter", "Shard opens served from the node-local cache.", ("stream",)),
        ("shardkit_cache_misses_total", "counter", "Shard opens that had to fetch the shard first.", ("stream",)),
        ("shardkit_cache_evictions_total", "counter", "Decoded shards evicted to stay under cache_limit.", ()),
        ("shardkit_cache_held_bytes", "gauge",
         "Decoded shard bytes held open by the readers of this process and its DataLoader workers.", ()),
        ("shardkit_cache_bytes", "gauge", "Decoded shard bytes in the cache directories this process uses.", ()),
    ),
    *_specs(
        "service",
        ("shardkit_service_reassignments_total", "counter",
         "Streams of a data-service consumer moved to another worker (a worker killed, hung past the deadline or "
         "gone), each resumed from the consumer's last state.", ()),
        ("shardkit_service_queue_depth", "gauge",
         "Messages a data-service consumer read ahead and has not handed to the training loop: whole batches, or "
         "parts of steps where several workers read its steps in parts (per stream at most 4 queued and one "
         "waiting for room).", ()),
        ("shardkit_service_wait_seconds_total", "counter",
         "Seconds a data-service consumer waited for the service's next batch or part (the workers and the "
         "network; the loader's wait adds the consumer's own assembly of a step).", ()),
        ("shardkit_service_worker_rows_total", "counter",
         "Rows each data-service worker sent, as its heartbeats report them, counted by the dispatcher (rate(): "
         "rows/s per worker).", ("worker",)),
    ),
    *_specs(
        "trainer",
        ("shardkit_train_step", "gauge", "Optimizer steps completed.", ("rank",)),
        ("shardkit_train_loss", "gauge", "Training loss of the last step (mean over ranks).", ("rank",)),
        ("shardkit_train_tokens_total", "counter", "Tokens trained on, all ranks together.", ("rank",)),
        ("shardkit_train_tokens_per_second", "gauge", "Throughput of the last step, all ranks together.", ("rank",)),
        ("shardkit_train_mfu_ratio", "gauge", "Model FLOPs utilisation of the last step (GPUs with a known peak).",
         ("rank",)),
        ("shardkit_train_data_wait_ratio", "gauge",
         "Fraction of the last step spent waiting for data (mean over ranks).", ("rank",)),
        ("shardkit_train_data_wait_seconds_total", "counter",
         "Seconds of steps spent waiting for data (data-wait fraction times step time).", ("rank",)),
        ("shardkit_train_step_seconds", "histogram", "Wall time of an optimizer step.", ("rank",)),
        ("shardkit_train_checkpoint_seconds_total", "counter", "Seconds spent saving (the blocking part of an async save) or loading checkpoints.",
         ("rank", "operation")),
        ("shardkit_train_checkpoints_total", "counter", "Checkpoints saved or loaded.", ("rank", "operation")),
        ("shardkit_train_peak_memory_bytes", "gauge",
         "Peak memory: allocated GPU memory, or the process's peak resident set on CPU.", ("rank",)),
        ("shardkit_train_starvation_warnings_total", "counter", "Starvation warnings logged.", ("rank",)),
        ("shardkit_train_loss_scale", "gauge",
         "fp16 loss scale the last step's backward pass used (halved by an overflow, doubled after "
         "--loss-scale-growth-interval clean steps).", ("rank",)),
        ("shardkit_train_overflow_steps_total", "counter",
         "fp16 steps whose gradients overflowed: update skipped, batches consumed (since this process started; "
         "metrics.jsonl's overflow_steps counts the whole run).", ("rank",)),
    ),
)
SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}
STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Key under which a DataLoader worker attaches its increments to a batch it sends to the parent.
WORKER_KEY = "__shardkit_metrics__"

_lock = threading.Lock()
_registry = None
_metrics: dict[str, Any] = {}
_servers: dict[int, Any] = {}
# Increments not yet in a registry: a worker's, until they travel with its next batch; any other process's,
# until something asks for the registry (an endpoint, `value`): importing prometheus_client costs 50-130 ms,
# which a first batch of a fresh process would otherwise pay for its first storage call.
_pending: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
_cache_roots: set[str] = set()


# -- the registry ------------------------------------------------------------------------------
def registry():
    """The `CollectorRegistry` holding every metric of `METRICS` (created on first use)."""
    global _registry
    if _registry is not None:
        return _registry
    with _lock:
        if _registry is None:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

            reg = CollectorRegistry(auto_describe=True)
            for spec in METRICS:
                if spec.kind == "counter":
                    _metrics[spec.name] = Counter(spec.name, spec.help, spec.labels, registry=reg)
                elif spec.kind == "gauge":
                    _metrics[spec.name] = Gauge(spec.name, spec.help, spec.labels, registry=reg)
                else:
                    _metrics[spec.name] = Histogram(spec.name, spec.help, spec.labels, registry=reg,
                                                    buckets=STEP_SECONDS_BUCKETS)
            _metrics["shardkit_cache_bytes"].set_function(_cache_disk_bytes)
            if not _in_loader_worker():  # a worker's increments belong to its parent
                for (name, labels), amount in _pending.items():
                    _add(_metrics[name].labels(**dict(labels)) if labels else _metrics[name], amount)
                _pending.clear()
            _registry = reg
    return _registry


# A DataLoader forks its workers whatever the parent's other threads are doing; one of them may be inside
# `_lock` or inside a prometheus_client lock at that instant, and the child's copy of that lock would stay
# held forever (its holder does not exist there): the worker's first `inc` would hang. So no thread holds
# `_lock` across a fork, and a forked child starts with a lock, a registry and endpoints of its own (a
# worker only keeps `_pending`; any other child is a new process with counts of its own).
def _before_fork() -> None:
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()


def _after_fork_in_child() -> None:
    global _lock, _registry, _metrics, _servers
    _lock = threading.Lock()
    _registry, _metrics, _servers = None, {}, {}
    _pending.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _child(name: str, labels: dict[str, Any]):
    registry()
    metric = _metrics[name]
    return metric.labels(**{k: str(v) for k, v in labels.items()}) if SPECS[name].labels else metric


# Loopback only unless asked: the metrics name datasets, hosts and run progress, and an endpoint on every
# interface would show them to anyone who can reach the machine (docs/OBSERVABILITY.md: exposing them).
DEFAULT_ADDRESS = "127.0.0.1"


def start_metrics_server(port: int, *, addr: str = DEFAULT_ADDRESS) -> int:
    """Serve every shardkit metric of this process at http://ADDR:PORT/metrics; returns the port.

    Calling it again with the same port is a no-op, so a library and its user can both ask for it.

    Raises:
        ValueError: the port is outside 1-65535.
        OSError: the port is taken (the message names it).
    """
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"metrics port must be in 1-65535, got {port!r}")
    from prometheus_client import start_http_server

    with _lock:
        if port in _servers:
            return port
    reg = registry()
    try:
        server, thread = start_http_server(port, addr=addr, registry=reg)
    except OSError as err:
        raise OSError(err.errno, f"cannot serve metrics on {addr}:{port}: {err.strerror or err}; "
                                 "choose another metrics port") from err
    with _lock:
        _servers[port] = (server, thread)
    logger.info("serving Prometheus metrics on http://%s:%d/metrics", addr, port)
    return port


def serving_metrics(port: int) -> bool:
    """Whether this process serves its metrics on `port` (`start_metrics_server`)."""
    with _lock:
        return port in _servers


def stop_metrics_server(port: int) -> None:
    """Stop serving on `port` and release it (nothing if this process does not serve there).

    A process that exits with its endpoint still up can answer a scrape it accepted while the interpreter
    shuts down with a status line and no body, which Prometheus records as an empty scrape; once stopped,
    a scrape is refused, which Prometheus records as the target being down."""
    with _lock:
        served = _servers.pop(port, None)
    if served is not None:
        server, thread = served
        server.shutdown()  # returns once the accepting loop has ended
        server.server_close()
        thread.join()


def value(name: str, **labels: Any) -> float:
    """Current value of a counter or gauge in this process, summed over label sets matching `labels`."""
    registry()
    total = 0.0
    for family in _metrics[name].collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items()):
                total += sample.value
    return total


# -- recording (one call per event) ------------------------------------------------------------
def _in_loader_worker() -> bool:
    return loader_worker_info() is not None


def inc(name: str, amount: float = 1.0, **labels: Any) -> None:
    """Add `amount` to a counter, or to a gauge (negative amounts allowed for gauges only).

    Raises:
        ValueError: a negative amount for a counter (here, at the caller, not later when the pending counts
            are published: a counter only goes up, and Prometheus reads a fall as a restart).
    """
    if amount < 0 and SPECS[name].kind == "counter":
        raise ValueError(f"counter {name} cannot go down (amount {amount})")
    if _registry is None or _in_loader_worker():
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        with _lock:
            if _registry is None or _in_loader_worker():  # again under the lock: `registry()` may have just run
                _pending[key] = _pending.get(key, 0.0) + amount
                return
    _add(_child(name, labels), amount)


def _add(child: Any, amount: float) -> None:
    if amount < 0:
        child.dec(-amount)
    else:
        child.inc(amount)


def attach_worker_counters(batch: Any) -> Any:
    """In a DataLoader worker: hand the increments made since the last batch to the parent with `batch`."""
    if not _pending or not _in_loader_worker():
        return batch
    target = batch[0] if isinstance(batch, list) and batch else batch
    if isinstance(target, dict):
        with _lock:
            target[WORKER_KEY] = list(_pending.items())
            _pending.clear()
    return batch


def merge_worker_counters(increments: list | None) -> None:
    """In the parent: add the increments a worker attached to a batch (see `attach_worker_counters`)."""
    for (name, labels), amount in increments or ():
        if name in SPECS:
            inc(name, amount, **dict(labels))


@functools.lru_cache(maxsize=256)
def stream_label(url: str) -> str:
    """A dataset's label: the last component of its URL, without user-info, query or fragment."""
    tail = url.split("?", 1)[0].split("#", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^\w.-]", "_", tail.rsplit("@", 1)[-1])[:64] or "dataset"


def retry_cause(err: BaseException) -> str:
    """A bounded label for why a storage call failed: an S3 error code, http_STATUS, or the error class."""
    current: BaseException | None = err
    for _ in range(8):
        if current is None:
            break
        response = getattr(current, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return re.sub(r"\W", "_", str(response["Error"]["Code"]))[:40]
        status = getattr(current, "status", None) or getattr(current, "status_code", None)
        if isinstance(status, int):
            return f"http_{status}"
        current = current.__cause__ or current.__context__
    return type(err).__name__[:40]


def storage_attempt(operation: str) -> None:
    inc("shardkit_storage_requests_total", operation=operation)


def storage_retry(operation: str, err: BaseException) -> None:
    inc("shardkit_storage_retries_total", operation=operation, cause=retry_cause(err))


def cache_lookup(url: str, *, hit: bool) -> None:
    inc("shardkit_cache_hits_total" if hit else "shardkit_cache_misses_total", stream=stream_label(url))


def shard_downloaded(url: str, shard_format: str, nbytes: int, seconds: float) -> None:
    labels = {"stream": stream_label(url), "shard_format": shard_format}
    inc("shardkit_loader_downloaded_bytes_total", nbytes, **labels)
    inc("shardkit_loader_download_seconds_total", seconds, **labels)


def shard_decoded(url: str, shard_format: str, seconds: float) -> None:
    inc("shardkit_loader_decode_seconds_total", seconds, stream=stream_label(url), shard_format=shard_format)


def loader_batches(count: int, waited: float) -> None:
    """`count` batches handed to the consumer after `waited` seconds of waiting in all (the loader
    counts locally and publishes in groups: two counter increments per batch cost a seventh of a warm epoch)."""
    inc("shardkit_loader_wait_seconds_total", waited)
    inc("shardkit_loader_batches_total", count)


def shard_quarantined(url: str, samples: int) -> None:
    inc("shardkit_loader_quarantined_shards_total", stream=stream_label(url))
    inc("shardkit_loader_quarantined_samples_total", samples, stream=stream_label(url))


def prefetch_submitted() -> None:
    inc("shardkit_loader_prefetch_queue_depth", 1)


def prefetch_done(_future: Any = None) -> None:
    """A future's done callback: runs when the prefetch finished, failed or was cancelled."""
    inc("shardkit_loader_prefetch_queue_depth", -1)


def watch_cache_dir(root: str) -> None:
    """Count the decoded shards under `root` in `shardkit_cache_bytes` (walked at scrape time)."""
    _cache_roots.add(root)


def _cache_disk_bytes() -> float:
    total = 0
    for root in list(_cache_roots):
        for directory, _, names in os.walk(root):
            for name in names:
                if name.endswith(".skd") and not name.startswith("."):
                    with contextlib.suppress(OSError):
                        total += os.stat(os.path.join(directory, name)).st_size
    return float(total)


def timed_call(item: Any, fn, *args: Any) -> tuple[Any, float]:
    """`(fn(item, *args), seconds)`: lets a build worker report its busy time with its result."""
    started = time.perf_counter()
    result = fn(item, *args)
    return result, time.perf_counter() - started


def build_unit_done(*, documents_in: int, written: int, tokens: int, busy_seconds: float) -> None:
    inc("shardkit_build_documents_read_total", documents_in)
    inc("shardkit_build_documents_written_total", written)
    inc("shardkit_build_tokens_total", tokens)
    inc("shardkit_build_worker_busy_seconds_total", busy_seconds)


def shard_written(shard_format: str, nbytes: int) -> None:
    inc("shardkit_build_shards_written_total", shard_format=shard_format)
    inc("shardkit_build_output_bytes_total", nbytes, shard_format=shard_format)


# -- the trainer ---------------------------------------------------------------------------------
@dataclass
class StarvationAlarm:
    """Fires once when the data-wait fraction of the last `window` steps together (seconds waited over
    seconds stepped) exceeds `threshold`.

    The first step of a run is left out: it always waits for the first shards.
    """

    window: int
    threshold: float
    fired: bool = False

    def __post_init__(self) -> None:
        self.steps: deque[tuple[float, float]] = deque(maxlen=self.window)  # (seconds waited, step seconds)
        self.seen = 0

    def update(self, waited: float, seconds: float) -> bool:
        self.seen += 1
        if self.seen == 1 or self.fired:
            return False
        self.steps.append((waited, seconds))
        if len(self.steps) == self.window and self.fraction > self.threshold:
            self.fired = True
        return self.fired

    @property
    def fraction(self) -> float:
        total = sum(seconds for _, seconds in self.steps)
        return sum(waited for waited, _ in self.steps) / total if total > 0 else 0.0


LOADER_COUNTERS = ("shardkit_loader_download_seconds_total", "shardkit_loader_decode_seconds_total",
                   "shardkit_loader_wait_seconds_total", "shardkit_storage_retries_total")


def likely_cause(deltas: dict[str, float], *, num_workers: int) -> str:
    """Why the loader falls behind, from its own counters over the alarm's window, and what to change."""
    download, decode = deltas["shardkit_loader_download_seconds_total"], deltas["shardkit_loader_decode_seconds_total"]
    waited, retries = deltas["shardkit_loader_wait_seconds_total"], int(deltas["shardkit_storage_retries_total"])
    busy = download + decode
    if busy >= 0.25 * waited and download >= decode:
        return (f"downloads are behind: {download:.1f}s downloading shards ({retries} storage retries) against "
                f"{waited:.1f}s waited; raise --num-workers (now {num_workers}: each worker fetches its own "
                "shards), or read from a closer or faster store; a persistent --cache-dir serves later epochs")
    if busy >= 0.25 * waited:
        return (f"decoding is the bottleneck: {decode:.1f}s decoding shards against {waited:.1f}s waited; raise "
                f"--num-workers (now {num_workers}) so that decoding runs in parallel")
    return (f"too few loader workers: shards arrive on time ({download:.1f}s downloading, {decode:.1f}s decoding) "
            f"but batches are assembled slower than steps run; raise --num-workers (now {num_workers})")


class TrainerMetrics:
    """The trainer's metrics of one rank and its starvation alarm.

    Args:
        rank: this process's global rank (the `rank` label).
        port: serve metrics on this port (0: record only).
        address: the address the endpoint listens on (default loopback only).
        window, threshold: the starvation alarm (see `StarvationAlarm`); a threshold >= 1 disables it.
        warn: whether this rank logs the warning (rank 0: one warning per run).
        num_workers: the loader's worker count, named in the warning.
    """

    def __init__(self, *, rank: int, port: int = 0, window: int = 50, threshold: float = 0.5, warn: bool = True,
                 num_workers: int = 0, address: str = DEFAULT_ADDRESS):
        self.rank, self.num_workers, self.warn = str(rank), num_workers, warn
        # The endpoint is this object's to stop only if it started it (a user may serve the port already).
        self._started_port = port if port and not serving_metrics(port) else 0
        if port:
            start_metrics_server(port, addr=address)
        self.alarm = StarvationAlarm(window, threshold) if threshold < 1 else None
        self._history: deque[dict[str, float]] = deque(maxlen=window + 1)

    def step(self, record: dict[str, Any], *, tokens: int) -> None:
        """Record one step (`shardkit.train.metrics.step_metrics` output) and check for starvation."""
        rank = self.rank
        _child("shardkit_train_step", {"rank": rank}).set(record["step"])
        _child("shardkit_train_loss", {"rank": rank}).set(record["loss"])
        inc("shardkit_train_tokens_total", tokens, rank=rank)
        _child("shardkit_train_tokens_per_second", {"rank": rank}).set(record["tokens_per_s"])
        if record.get("mfu") is not None:
            _child("shardkit_train_mfu_ratio", {"rank": rank}).set(record["mfu"])
        _child("shardkit_train_data_wait_ratio", {"rank": rank}).set(record["data_wait_fraction"])
        waited = record["data_wait_fraction"] * record["step_time_s"]
        inc("shardkit_train_data_wait_seconds_total", waited, rank=rank)
        _child("shardkit_train_step_seconds", {"rank": rank}).observe(record["step_time_s"])
        _child("shardkit_train_peak_memory_bytes", {"rank": rank}).set(record["peak_memory_gib"] * 2**30)
        if "loss_scale" in record:  # fp16 runs
            _child("shardkit_train_loss_scale", {"rank": rank}).set(record["loss_scale"])
            inc("shardkit_train_overflow_steps_total", float(record["overflow"]), rank=rank)
        self._history.append({name: value(name) for name in LOADER_COUNTERS})
        alarm = self.alarm
        if alarm is not None and alarm.update(waited, record["step_time_s"]):
            self.alarm = None  # one warning per run
            if self.warn:
                deltas = {k: self._history[-1][k] - self._history[0][k] for k in LOADER_COUNTERS}
                inc("shardkit_train_starvation_warnings_total", rank=rank)
                logger.warning("data starvation: the last %d steps spent %.0f%% of their time waiting for data "
                               "(over --starvation-threshold %.2f). Likely cause: %s", alarm.window,
                               100 * alarm.fraction, alarm.threshold, likely_cause(deltas, num_workers=self.num_workers))

    def close(self) -> None:
        """Stop the endpoint this object started (the trainer calls it before it exits)."""
        if self._started_port:
            stop_metrics_server(self._started_port)
            self._started_port = 0

    @contextlib.contextmanager
    def checkpoint(self, operation: str) -> Iterator[None]:
        """Time a checkpoint save or load."""
        started = time.perf_counter()
        yield
        inc("shardkit_train_checkpoint_seconds_total", time.perf_counter() - started, rank=self.rank,
            operation=operation)
        inc("shardkit_train_checkpoints_total", rank=self.rank, operation=operation)


# -- the reference in the docs -------------------------------------------------------------------
SECTION_TITLES = {"build": "Build (`shardkit build --metrics-port P`)",
                  "storage": "Storage (every process that reads or writes datasets)",
                  "loader": "Loader and node cache (`start_metrics_server(port)`, or the trainer's endpoint)",
                  "trainer": "Trainer (`--metrics-port P`: rank r serves on P + local rank)",
                  "service": "Data service consumer (`StreamingDataset(service=...)`, in the trainer's endpoint)"}


def markdown_reference() -> str:
    """The metric reference of docs/OBSERVABILITY.md, generated from `METRICS`."""
    lines = []
    for section, title in SECTION_TITLES.items():
        lines += [f"### {title}", "", "| metric | type | labels | meaning |", "|---|---|---|---|"]
        for spec in METRICS:
            if spec.section == section:
                labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
                lines.append(f"| `{spec.name}` | {spec.kind} | {labels} | {spec.help} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from shardkit.options import command_parser, option

    @dataclass(frozen=True, kw_only=True)
    class _ReferenceOptions:
        markdown: bool = option(False, "print the reference tables")

    parser = command_parser(prog="python -m shardkit.metrics", options=[_ReferenceOptions], bool_values=False,
                            description="Print the metric reference (Markdown) generated from the code.")
    args = parser.parse_args(argv)
    if not getattr(args, "markdown", False):
        parser.print_help()
        return 2
    print(markdown_reference(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
