"""Shared fixtures: a real S3-compatible endpoint (moto's server mode) on loopback, and ../shared paths."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import socket
import uuid
from pathlib import Path

import pytest

# One OpenMP thread per test process and per process it starts (inherited), as torchrun gives its ranks: the
# suite runs a test per core (pytest-xdist), and a second thread per process only contends, spinning.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["conftest_faults",  # the fault-injecting S3 proxy and the reliability figures
                  "conftest_cpu",  # SHARDKIT_TEST_CPU=FILE: CPU-seconds a test, its processes included
                  "conftest_warm"]  # trainers forked from a warm-start server (SHARDKIT_TEST_COLD=1: not)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDKIT_SHARED", REPO.parent / "shared"))
S3_TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one test process per core, at most 4: many tests start several
    processes of their own (ranks, DataLoader workers, servers), so more would only contend."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_collection_modifyitems(config, items) -> None:
    """Slow (multi-process) tests first, those of an `xdist_group` (below: a module of minutes, one unit of work)
    before the others, the larger groups first, otherwise in collection order: xdist hands tests out in this
    order, so the minute-long ones start while every worker is busy instead of ending the run alone on one worker.

    This needs pyproject's `--dist loadgroup --no-loadscope-reorder`: every test is a unit of its own, handed to
    the worker that has at most two left (xdist's plain `load` first deals each worker a block of consecutive
    tests, a quarter of the suite, so the slow tests, all at the front, went to one or two workers while the
    others sat idle: a 40-minute run at 108% CPU of 200%), except the tests of an `xdist_group`, one unit that
    one worker runs: a module whose tests share the torchrun runs of a module fixture (test_loop's references)
    marks itself so, since each worker makes a module fixture of its own (test_diloco_runs' shared runs, 33
    CPU-seconds, were made twice in a full run). `--no-loadscope-reorder` keeps this order (xdist's default
    puts the largest groups first)."""
    groups = collections.Counter(mark.args[0] for item in items for mark in item.iter_markers("xdist_group"))

    def order(item) -> tuple:
        group = item.get_closest_marker("xdist_group")
        return item.get_closest_marker("slow") is None, -groups[group.args[0]] if group else 0

    items.sort(key=order)


def in_fresh_process(fn, *args):
    """`fn(*args)` in a spawned interpreter; returns its (picklable) result.

    For a test whose library leaves threads behind in the process: Ray's core worker and gRPC keep threads
    after `ray.shutdown()`, and a later test in the same pytest-xdist worker that forks (DataLoader workers)
    would copy them mid-operation. (Once, in a full run, a forked DataLoader worker died of SIGSEGV; the
    cause was not reproduced, and Ray is what in this suite leaves such threads in the test process.)
    """
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def shared_path(relative: str) -> Path:
    """A file under ../shared, or skip the test with a message saying what is missing."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} is absent: this test needs the shared corpora/tokenizers folder beside the repository "
                    "(set SHARDKIT_SHARED to point elsewhere)")
    return path


_PORTS = random.Random()  # its own generator: a test that seeds `random` must not make two workers draw alike


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports that are free on loopback now, below the kernel's ephemeral range.

    Not port 0's pick: the kernel hands ephemeral ports to every outgoing connection (gloo's, S3 clients'),
    so one that was free when asked can be some connection's local port by the time a server binds it; and
    P + 1 (a second local rank, a second trial) was never checked at all. Below the range only another
    test's draw can collide, one chance in thousands.
    """
    low = _ephemeral_range()[0]
    while True:
        base = _PORTS.randrange(10_000, low - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def outside_address() -> str | None:
    """This machine's address on its outward interface (no packet is sent), or None when it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: a route is looked up, nothing is sent
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if address.startswith("127.") else address


def accepts(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port."""
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem that fills up: `make(size)` mounts a tmpfs of `size` (e.g. "600k") and returns its
    path. Needs root (mount); skipped elsewhere."""
    import subprocess

    mounted = []

    def make(size: str):
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server started for this test session on 127.0.0.1 and a free port."""
    server_module = pytest.importorskip("moto.server", reason="moto[server] is needed for the S3 tests (pip install -e '.[dev]')")
    for key, value in S3_TEST_CREDENTIALS.items():
        os.environ.setdefault(key, value)
    port = free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict:
    """storage_options for s3fs against the loopback endpoint (credentials come from the environment)."""
    return {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket: returns (url prefix "s3://bucket/data", storage_options)."""
    pytest.importorskip("s3fs")
    import boto3

    options = s3_options(s3_endpoint)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    # boto3, not s3fs.mkdir: s3fs sends LocationConstraint=us-east-1, which S3 (and moto) reject.
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/data", options


@pytest.fixture(scope="session")
def process_pool():
    """Eight long-lived spawned processes for multi-process loader tests (see tests/procpool.py)."""
    from procpool import ProcessPool

    pool = ProcessPool(8)
    try:
        yield pool
    finally:
        pool.close()
