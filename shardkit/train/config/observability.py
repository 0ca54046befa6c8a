"""The logging section (`--run-dir`, `--log-every`, `--metrics-port`, ...): what the run writes and serves,
read by `shardkit.train.metrics` (metrics.jsonl, TensorBoard, Prometheus, the starvation warning) and the
sample-id log of the training loop."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from shardkit.options import option
from shardkit.train.config.checks import check


def _is_address(text: str) -> bool:
    """An IP address or a host name (not looked up here: the server's bind names what fails)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", text) is not None


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What the run writes: stdout lines, RUN_DIR/metrics.jsonl, TensorBoard, sample-id logs."""

    run_dir: str | None = option(None, "output directory; default runs/PRESET-DATASETNAME")
    log_every: int = option(10, "print a metrics line every N steps (every step goes to metrics.jsonl)")
    tensorboard: bool = option(True, "also write TensorBoard events when tensorboard is installed")
    log_sample_ids: bool = option(False, "write the sample ids each rank consumes per step to RUN_DIR/samples/")
    metrics_port: int = option(0, "serve Prometheus metrics at http://HOST:PORT/metrics, each rank on PORT + its "
                               "local rank (0: off)")
    metrics_address: str = option("127.0.0.1", "address the metrics endpoints listen on: loopback by default; "
                                  "0.0.0.0 for every interface (see docs/OBSERVABILITY.md before exposing them)")
    starvation_window: int = option(50, "steps over which the data-wait fraction is averaged for the starvation "
                                    "warning")
    starvation_threshold: float = option(0.5, "warn once when the data-wait fraction over --starvation-window steps "
                                         "exceeds this (1 disables the warning)")

    def __post_init__(self) -> None:
        check(self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}")
        check(0 <= self.metrics_port < 65536, f"--metrics-port must be in 0-65535, got {self.metrics_port}")
        check(_is_address(self.metrics_address),
               f"--metrics-address must be an IP address or host name, got {self.metrics_address!r}")
        check(self.starvation_window >= 1, f"--starvation-window must be >= 1, got {self.starvation_window}")
        check(0 < self.starvation_threshold, f"--starvation-threshold must be > 0, got {self.starvation_threshold}")

