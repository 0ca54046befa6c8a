"""Metrics records: throughput, MFU formula, data wait, the JSONL log and resume truncation."""

from __future__ import annotations

import json

import pytest
import torch

from shardkit.train.metrics import (MetricsLogger, SampleLog, format_line, peak_flops, peak_memory_gib,
                                    step_metrics)
from shardkit.train.precision import PrecisionChoice


def test_step_metrics_formula():
    record = step_metrics(step=3, loss=2.5, lr=1e-3, grad_norm=0.5, step_time=2.0, data_wait=0.1, tokens=8000,
                          world_size=4, flops_per_token=1e9, peak=1e12, memory_gib=1.5)
    assert record["tokens_per_s"] == 4000 and record["tokens_per_s_per_device"] == 1000
    assert record["mfu"] == pytest.approx(1e9 * 1000 / 1e12)
    assert record["data_wait_fraction"] == pytest.approx(0.05)
    cpu = step_metrics(step=3, loss=2.5, lr=1e-3, grad_norm=0.5, step_time=2.0, data_wait=0.1, tokens=8000,
                       world_size=4, flops_per_token=1e9, peak=None, memory_gib=1.5)
    assert cpu["mfu"] is None
    line = format_line(cpu, 10)
    assert "mfu n/a" in line and "4.0k tok/s (1.0k/dev)" in line and "data wait 5.0%" in line


def test_no_peak_on_cpu_and_memory_is_measured():
    assert peak_flops(torch.device("cpu"), precision=PrecisionChoice("bf16", "asked for")) is None
    assert peak_memory_gib(torch.device("cpu")) > 0


def test_logger_writes_jsonl_and_truncates_on_resume(tmp_path, capsys):
    def record(step):
        return step_metrics(step=step, loss=1.0 / step, lr=0.1, grad_norm=1.0, step_time=1.0, data_wait=0.0,
                            tokens=10, world_size=1, flops_per_token=1.0, peak=None, memory_gib=0.1)

    logger = MetricsLogger(tmp_path, is_main=True, total_steps=6, log_every=2, tensorboard=False)
    for step in range(1, 6):
        logger.log(record(step))
    logger.log({"step": 4, "eval_loss": 0.7}, echo=True)
    logger.close()
    printed = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].split()[1] for line in printed] == ["1/6", "2/6", "4/6", "4/6"]
    # A resumed run from step 3 forgets what the crashed attempt logged after step 3.
    logger = MetricsLogger(tmp_path, is_main=True, total_steps=6, log_every=2, tensorboard=False, resume_step=3)
    logger.log(record(4))
    logger.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_non_main_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", is_main=False, total_steps=2, log_every=1, tensorboard=False)
    logger.log({"step": 1, "eval_loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_sample_log_truncation_covers_every_rank(tmp_path):
    for rank in range(3):
        log = SampleLog(tmp_path, rank=rank)
        for step in (1, 2, 3):
            log.log(step, [step * 10 + rank])
        log.close()
    SampleLog.truncate_all(tmp_path, 2)
    for rank in range(3):
        lines = (tmp_path / "samples" / f"rank-{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["ids"] for line in lines] == [[10 + rank], [20 + rank]]
