"""The trainer's metrics: a 2-rank torchrun scraped over HTTP (and by a real Prometheus server), and
the starvation warning on a deliberately slow store versus a normal run."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import free_port
from metrics_scrape import Scraper, check_counters_increase, total
from shardkit.train.config import config_from_dict
from shardkit.train.loop import build, close, train
from train_runs import check_ok, torchrun, write_byte_dataset

pytest.importorskip("prometheus_client")


def start_prometheus(directory: Path, targets: list[str]) -> tuple[subprocess.Popen, int]:
    """A real Prometheus on a free loopback port scraping `targets` every 200 ms (temp config and storage)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the Prometheus server is not installed (Debian: apt-get install prometheus); "
                    "the scrape-config test needs it")
    port = free_port()
    config = directory / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        # A training process answers a scrape from a thread that competes with the step for the GIL:
        # 150 ms timed out on rank 0 in a run; the interval stays short enough for a run of seconds.
        "global": {"scrape_interval": "300ms", "scrape_timeout": "290ms"},
        "scrape_configs": [{"job_name": "shardkit-train", "static_configs": [{"targets": targets}]}]}))
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=0.5).read()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=0.5) as response:
                active = json.loads(response.read())["data"]["activeTargets"]
            # Ready is not scraping yet: wait until every target's scrape loop has run once (down, as
            # nothing listens yet), so a run of a few seconds is scraped from its start.
            if len(active) == len(targets) and all(not t["lastScrape"].startswith("0001") for t in active):
                return process, port
            time.sleep(0.1)
        except OSError:
            if process.poll() is not None:
                raise AssertionError(f"prometheus exited: {process.stderr.read()[-2000:]}")
            time.sleep(0.1)
    process.terminate()
    raise AssertionError("prometheus did not become ready and scrape its targets in 10 s")


def prometheus_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.mark.slow
def test_two_rank_training_endpoints_match_metrics_jsonl_and_reach_prometheus(tmp_path):
    data = str(tmp_path / "data")
    write_byte_dataset(data, num_samples=480)
    port = free_port(2)  # P and P + 1 (local rank 1)
    prometheus_dir = Path(tempfile.mkdtemp(dir=tmp_path))
    targets = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    with_prometheus = shutil.which("prometheus") is not None
    server = start_prometheus(prometheus_dir, targets) if with_prometheus else None
    run_dir = tmp_path / "run"
    steps, batch_size = 60, 4
    try:
        with Scraper([port, port + 1], interval=0.05) as scraper:
            check_ok(torchrun(run_dir, data, steps=steps, batch_size=batch_size, checkpoint_every=30,
                              extra=("--metrics-port", str(port))))
        if server is not None:
            # The targets are gone: range functions still see the samples (stale markers are skipped).
            step_series = prometheus_query(server[1], "max_over_time(shardkit_train_step[10m])")
            assert {r["metric"]["rank"] for r in step_series} == {"0", "1"}
            assert {r["metric"]["instance"] for r in step_series} == set(targets)
            assert all(0 < float(r["value"][1]) <= steps for r in step_series)
            assert prometheus_query(server[1], "max_over_time(shardkit_loader_downloaded_bytes_total[10m])")
    finally:
        if server is not None:
            server[0].terminate()
            server[0].wait(timeout=30)
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "loss" in r}
    tokens_per_step = 2 * batch_size * 32
    for rank, rank_port in enumerate((port, port + 1)):
        series = scraper.series[rank_port]
        assert len(series) >= 3, f"rank {rank}'s endpoint was not reachable while it trained"
        assert check_counters_increase(series) > 0
        last = series[-1]
        step = int(total(last, "shardkit_train_step", rank=str(rank)))
        assert step >= 1
        # What the endpoint said at its last scrape is what metrics.jsonl says of that step.
        assert total(last, "shardkit_train_loss", rank=str(rank)) == records[step]["loss"]
        assert total(last, "shardkit_train_tokens_total", rank=str(rank)) == step * tokens_per_step
        assert total(last, "shardkit_train_step_seconds_count", rank=str(rank)) == step
        assert total(last, "shardkit_train_data_wait_seconds_total", rank=str(rank)) == pytest.approx(
            sum(records[s]["data_wait_fraction"] * records[s]["step_time_s"] for s in range(1, step + 1)),
            rel=1e-6) if rank == 0 else True  # other ranks time their own steps
        # Saves at step 30 and after the last step; a scrape can fall between a step and its save.
        saves = total(last, "shardkit_train_checkpoints_total", rank=str(rank), operation="save")
        assert (step > 30) + (step == steps) >= saves >= (step > 30)
        # The loader publishes its batch counts every 64 batches or every second (issue 23): a scrape
        # mid-run may lag the step by that much.
        assert total(last, "shardkit_loader_batches_total") >= step - 64


def _starvation_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shardkit.metrics" and "starvation" in r.getMessage()]


def train_small_chunks(run_dir: Path, data: str, options: dict) -> list[str]:
    """Train 8 steps of 16 samples in order (one shard each) with the starvation alarm over 3 steps. The
    loader gathers 16 samples at a time (instead of 2048), so it fetches shards as the run goes (one
    step ahead), as it does on any dataset larger than one chunk."""
    config = config_from_dict({
        "steps": 8, "device": "cpu", "optimizer": {"warmup_steps": 2},
        # Steps of ~0.3 s or more: a normal loader (a shard GET of a few ms, one step ahead) keeps up; one
        # that waits 2 s per store request does not. With steps of ~0.05 s (d_model 128, 2 layers) on a
        # quiet machine the normal run spent 57% of its steps waiting and the alarm was right to fire.
        "model": {"d_model": 256, "n_layer": 4},
        "data": {"data": data, "batch_size": 16, "cache_dir": str(run_dir.parent / "cache"),
                 "storage_options": json.dumps(options), "loader": {"shuffle": False, "chunk_samples": 16}},
        "logging": {"run_dir": str(run_dir), "log_every": 100, "tensorboard": False,
                    "starvation_window": 3, "starvation_threshold": 0.5}})
    run = build(config)
    assert run.data.loader.dataset.config.chunk_samples == 16
    try:
        assert train(run) == 0
    finally:
        close(run)


class SlowStoreTracker:
    """Keeps `proxy.slow_seconds` at `factor` x the longest compute time (step time less data wait) of any
    step the runs in `run_dirs` have logged so far, polling their metrics.jsonl while in use."""

    def __init__(self, proxy, run_dirs: list[Path], *, factor: float):
        self.proxy, self.run_dirs, self.factor = proxy, run_dirs, factor
        self.longest, self.delays = 0.0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def update(self) -> None:
        for run_dir in self.run_dirs:
            path = run_dir / "metrics.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:  # the line being written
                    continue
                if "step_time_s" in record and record["step"] > 1:  # step 1 also warms up
                    compute = record["step_time_s"] * (1 - record["data_wait_fraction"])
                    self.longest = max(self.longest, compute)
        delay = self.factor * self.longest
        if delay != self.proxy.slow_seconds:
            self.proxy.slow_seconds = delay
            self.delays.append(round(delay, 3))

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            self.update()

    def __enter__(self) -> SlowStoreTracker:
        self.update()
        assert self.longest > 0, "the normal run logged no step"
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
@pytest.mark.s3
def test_starvation_warning_names_slow_downloads_and_stays_silent_on_a_normal_run(tmp_path, faulty_bucket, caplog):
    url, options, proxy = faulty_bucket
    write_byte_dataset(url, num_samples=16 * 8, storage_options=options)
    caplog.set_level(logging.WARNING, logger="shardkit.metrics")
    # One compute thread: on a busy machine two threads' barriers spin against the load and steps take
    # tens of seconds; the comparison below holds at any speed, the run just ends sooner.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_small_chunks(tmp_path / "normal" / "run", url, options)
        assert _starvation_warnings(caplog) == []
        _train_beside_a_slow_store(tmp_path, url, options, proxy)
    finally:
        torch.set_num_threads(threads)
    warnings = _starvation_warnings(caplog)
    assert len(warnings) == 1, warnings  # one warning per run
    assert "downloads are behind" in warnings[0] and "--num-workers" in warnings[0]
    assert options["endpoint_url"] not in warnings[0]


def _train_beside_a_slow_store(tmp_path: Path, url: str, options: dict, proxy) -> None:
    """Train again while every store request is delayed (see `SlowStoreTracker`)."""
    # The slow store's delay is a multiple of the steps this machine runs (not a fixed time): on a busy machine
    # every step is slow too, and a fixed delay could be kept up with. Each step needs a new shard, fetched
    # one step ahead, so with a delay D per request and a compute time S per step the wait is at least
    # D - S: D = 4 x the longest compute step yet (the normal run's, then the slow run's own as it goes, the
    # machine's load may change between runs) keeps the waiting fraction >= 0.75, over the 0.5 threshold.
    # The delay may pass botocore's 60 s read timeout on a very busy machine: the slow store is slow, not dead.
    patient = {**options, "config_kwargs": {"read_timeout": 3600}}
    slow_seconds = proxy.slow_seconds
    try:
        with SlowStoreTracker(proxy, [tmp_path / "normal" / "run", tmp_path / "slow" / "run"], factor=4) as tracker:
            proxy.configure(rate=1.0, kinds=("slow",))
            train_small_chunks(tmp_path / "slow" / "run", url, patient)
    finally:
        proxy.configure(rate=0.0)
        proxy.slow_seconds = slow_seconds
    print(f"longest compute step {tracker.longest:.3f}s; slow store delays: {tracker.delays}")
