"""The trainer's metrics endpoint stops before the trainer exits (a scrape is then refused, never answered with an
empty body by a process shutting down), and an endpoint the user started is left to the user."""

from __future__ import annotations

import socket

import pytest

from conftest import free_port
from metrics_scrape import scrape, total
from shardkit.metrics import TrainerMetrics, serving_metrics, start_metrics_server, stop_metrics_server
from shardkit.train.config import config_from_dict
from shardkit.train.loop import build, close, train
from train_runs import write_byte_dataset

pytest.importorskip("prometheus_client")


def refused(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_trainer_metrics_close_stops_the_endpoint_it_started_and_releases_the_port():
    port = free_port()
    watch = TrainerMetrics(rank=0, port=port)
    text, _ = scrape(port)
    assert "shardkit_train_step" in text
    watch.close()
    assert not serving_metrics(port) and refused(port)
    # Released, not merely unlisted: the port can be served again in this process.
    assert start_metrics_server(port) == port
    stop_metrics_server(port)
    assert refused(port)


def test_an_endpoint_the_user_started_outlives_the_trainer_metrics():
    port = free_port()
    start_metrics_server(port)
    try:
        TrainerMetrics(rank=0, port=port).close()
        assert serving_metrics(port) and not refused(port)
        scrape(port)
    finally:
        stop_metrics_server(port)


def test_the_trainer_stops_its_endpoint_when_the_run_closes(tmp_path):
    write_byte_dataset(str(tmp_path / "data"))
    port = free_port()
    run = build(config_from_dict({
        "steps": 3, "device": "cpu", "optimizer": {"warmup_steps": 1},
        "data": {"data": str(tmp_path / "data"), "batch_size": 4, "cache_dir": str(tmp_path / "cache")},
        "logging": {"run_dir": str(tmp_path / "run"), "log_every": 100, "tensorboard": False, "metrics_port": port}}))
    try:
        assert train(run) == 0
        _, samples = scrape(port)  # still served after the last step, until the run closes
        assert total(samples, "shardkit_train_step") == 3
    finally:
        close(run)
    assert not serving_metrics(port) and refused(port)
