"""Pool-process task for the quarantine tests: one rank of a loader run, with the quarantine warnings
it logged and the samples it counted as quarantined (its Prometheus counter)."""

from __future__ import annotations

import logging


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def quarantine_run(**kwargs) -> dict:
    from shardkit import metrics
    from loader_procs import loader_run

    handler = _Collect()
    log = logging.getLogger("shardkit.loaders.order.quarantine")
    log.addHandler(handler)
    before = metrics.value("shardkit_loader_quarantined_samples_total")
    try:
        result = loader_run(**kwargs)
    finally:
        log.removeHandler(handler)
    result["warnings"] = handler.messages
    result["quarantined_samples"] = metrics.value("shardkit_loader_quarantined_samples_total") - before
    return result
