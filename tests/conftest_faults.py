"""Fixtures for the reliability tests: a fault-injecting proxy in front of the moto S3 server, and
a recorder of the figures (runs, faults, samples checked/lost/duplicated/corrupt) that
docs/RELIABILITY.md reports. Loaded from tests/conftest.py through `pytest_plugins`."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import uuid
from pathlib import Path

import pytest

from fault_proxy import FAULT_KINDS, FaultProxy

FIGURES_PATH = Path(os.environ.get("SHARDKIT_RELIABILITY_JSON",
                                   Path(__file__).resolve().parents[1] / "bench_out" / "reliability.json"))


@pytest.fixture(scope="session")
def fault_proxy(s3_endpoint):
    """A `FaultProxy` in front of the session's moto server, injecting nothing until configured."""
    proxy = FaultProxy(s3_endpoint, rate=0.0, slow_seconds=0.05)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(params=["obstore", "fsspec"])
def storage_client(request, monkeypatch):
    """The client Storage uses, each in turn: obstore (taken when installed) and fsspec (the fallback). A module
    runs all its tests on both with `pytestmark = pytest.mark.usefixtures("storage_client")`."""
    if request.param == "obstore":
        pytest.importorskip("obstore")
    monkeypatch.setenv("SHARDKIT_STORAGE_CLIENT", request.param)
    return request.param


@pytest.fixture
def faulty_bucket(s3_endpoint, fault_proxy):
    """A fresh bucket reached through the proxy: returns (url, storage_options, proxy).

    The bucket is created directly on moto; the proxy starts with no faults (call `configure`).
    """
    s3fs = pytest.importorskip("s3fs")
    bucket = f"fault-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).mkdir(bucket)
    fault_proxy.configure(rate=0.0, seed=0, kinds=FAULT_KINDS)  # no plan leaks from an earlier test
    options = {"endpoint_url": fault_proxy.url, "client_kwargs": {"region_name": "us-east-1"},
               "skip_instance_cache": True}
    try:
        yield f"s3://{bucket}/data", options, fault_proxy
    finally:
        fault_proxy.configure(rate=0.0)


class FigureRecorder:
    """Collects per-scenario figures and merges them into FIGURES_PATH at the end of the session."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.figures: dict[str, dict] = {}

    def add(self, scenario: str, **figures: int | float | str) -> None:
        """Accumulate numeric figures of `scenario` (sums), keep the last value of strings."""
        with self._lock:
            entry = self.figures.setdefault(scenario, {})
            for key, value in figures.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    entry[key] = entry.get(key, 0) + value
                else:
                    entry[key] = value

    def save(self) -> None:
        if not self.figures:
            return
        FIGURES_PATH.parent.mkdir(parents=True, exist_ok=True)
        # Each pytest-xdist worker saves its own scenarios into the one file: merge under a lock.
        with open(FIGURES_PATH.with_name(FIGURES_PATH.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                existing = json.loads(FIGURES_PATH.read_text())
            except (OSError, ValueError):
                existing = {}
            existing.update(self.figures)
            FIGURES_PATH.write_text(json.dumps(existing, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def figures():
    """`figures.add(scenario, runs=1, faults=..., samples_checked=..., lost=0, duplicated=0, corrupt=0)`."""
    recorder = FigureRecorder()
    yield recorder
    recorder.save()
