"""--precision: the choice for 'auto', fp16 with dynamic loss scaling (real fp16 autocast on CPU), forced
overflows skipped on every rank of DDP, FSDP2, TP, PP and DiLoCo layouts, and bitwise SIGKILL resume."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from conftest import free_port
from shardkit import metrics
from shardkit.train import faults
from shardkit.train.checkpoint import find_latest, read_marker
from shardkit.train.config import TrainConfig, config_from_dict
from shardkit.train.loop import build, close, train
from shardkit.train.precision import LossScaler, TooManyOverflows, build_loss_scaler, choose_precision
from train_runs import (check_ok, checkpoints, loss_scales, losses, sample_ids, torchrun,
                        write_byte_dataset)

FP16 = {"precision": "fp16"}
FP16_CHOICE = choose_precision("fp16", device_type="cpu", native_bf16=False)


@pytest.mark.parametrize("requested, device_type, native_bf16, chosen, why", [
    ("auto", "cuda", True, "bf16", "computes bf16 natively"),
    ("auto", "cuda", False, "fp16", "no native bf16"),
    ("auto", "cpu", False, "fp32", "on cpu"),
    ("bf16", "cuda", False, "bf16", "emulated and slow; --precision fp16 is faster"),
    ("bf16", "cpu", False, "bf16", "asked for by --precision bf16"),
    ("fp16", "cpu", False, "fp16", "asked for by --precision fp16"),
    ("fp32", "cuda", True, "fp32", "asked for by --precision fp32"),
])
def test_the_choice_depends_on_the_request_and_the_device_and_says_why(requested, device_type, native_bf16,
                                                                       chosen, why):
    choice = choose_precision(requested, device_type=device_type, native_bf16=native_bf16)
    assert choice.name == chosen and why in choice.reason
    assert choice.compute_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[chosen]


@pytest.mark.parametrize("values, message", [
    ({"precision": "fp16", "parallelism": {"parallel": "ddp", "comm_hook": "powersgd"}},
     "--comm-hook powersgd does not compose with --precision fp16"),
    ({"precision": "fp32", "loss_scale": 1024.0}, "--loss-scale, --loss-scale-growth-interval and "
                                                  "--max-overflow-steps apply to --precision fp16 only, not fp32"),
    ({"precision": "bf16", "max_overflow_steps": 5}, "apply to --precision fp16 only, not bf16"),
    ({"precision": "fp16", "max_overflow_steps": 0}, "--max-overflow-steps must be >= 1"),
    ({"precision": "bf16", "loss_scale_growth_interval": 10}, "apply to --precision fp16 only, not bf16"),
    ({"precision": "fp16", "loss_scale": 0.0}, "--loss-scale must be a normal float32 number"),
    ({"precision": "fp16", "loss_scale": float("inf")}, "--loss-scale must be a normal float32 number"),
    # Finite in float64 but inf in float32 (the scale's tensor), and a float32 subnormal: NaN gradients.
    ({"precision": "fp16", "loss_scale": 1e39}, "--loss-scale must be a normal float32 number, between "
                                                "1.175e-38 and 3.403e[+]38, got 1e[+]39"),
    ({"precision": "fp16", "loss_scale": 1e-39}, "--loss-scale must be a normal float32 number.*got 1e-39"),
    ({"precision": "fp16", "loss_scale_growth_interval": 0}, "--loss-scale-growth-interval must be >= 1"),
    ({"precision": "fp8"}, "--precision must be one of"),
])
def test_bad_precision_options_are_refused_naming_the_option(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        config_from_dict(values)


def test_auto_is_checked_again_once_it_resolved_to_fp16(tmp_path, data, monkeypatch):
    """'auto' with PowerSGD is fine on CPU and bf16 GPUs; on a GPU without bf16 'auto' means fp16, which the
    trainer checks again before training. (No such GPU here: the device's facts are simulated.)"""
    import shardkit.train.loop as loop
    from shardkit.train.precision import PrecisionChoice

    values = {"device": "cpu", "parallelism": {"comm_hook": "powersgd"}, "data": {"data": data},
              "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False}}
    assert config_from_dict(values).mixed_precision.precision == "auto"
    monkeypatch.setattr(loop, "choose_precision", lambda *_, **__: PrecisionChoice("fp16", "a GPU without bf16"))
    with pytest.raises(ValueError, match="--comm-hook powersgd does not compose with --precision fp16"):
        build(config_from_dict(values))


def test_help_lists_fp16_and_the_loss_scale_options(capsys):
    from shardkit.train.options import parse_train_args

    with pytest.raises(SystemExit):
        parse_train_args(["--help"])
    text = capsys.readouterr().out
    assert "fp16" in text and "--loss-scale" in text and "--loss-scale-growth-interval" in text
    config = parse_train_args(["--data", "/d", "--precision", "fp16", "--loss-scale", "1024",
                               "--loss-scale-growth-interval", "3"])
    assert dataclasses.astuple(config.mixed_precision)[:3] == ("fp16", 1024.0, 3)


def _tiny_step(scaler: LossScaler, model: torch.nn.Module, optimizer, *, overflow: bool) -> bool:
    loss = model(torch.ones(2, 4)).float().pow(2).mean()
    (loss * scaler.scale * (float("inf") if overflow else 1.0)).backward()
    scaler.unscale_(optimizer)
    applied = scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return applied


def test_loss_scaler_skips_an_overflow_halves_grows_and_resumes_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = build_loss_scaler(FP16_CHOICE, device=torch.device("cpu"), agree_over_ranks=False, init_scale=1024.0,
                               growth_interval=2)
    assert build_loss_scaler(choose_precision("bf16", device_type="cpu", native_bf16=False),
                             device=torch.device("cpu"), agree_over_ranks=False, init_scale=1.0,
                             growth_interval=1) is None
    assert _tiny_step(scaler, model, optimizer, overflow=False)
    before = [p.detach().clone() for p in model.parameters()]
    assert not _tiny_step(scaler, model, optimizer, overflow=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was skipped
    assert {int(state["step"]) for state in optimizer.state.values()} == {1}
    assert scaler.step_metrics() == {"loss_scale": 1024.0, "overflow": True, "overflow_steps": 1}
    assert scaler.scale == 512.0
    assert _tiny_step(scaler, model, optimizer, overflow=False)  # one clean step: the growth tracker is at 1
    saved = json.loads(json.dumps(scaler.state_dict()))  # the checkpoint marker holds it as JSON
    assert saved == {"scale": 512.0, "growth_tracker": 1, "overflow_steps": 1, "overflows_in_a_row": 0}
    resumed = build_loss_scaler(FP16_CHOICE, device=torch.device("cpu"), agree_over_ranks=False, init_scale=1024.0,
                                growth_interval=2)
    resumed.load_state_dict(saved)
    for continued in (scaler, resumed):  # the second clean step in a row doubles the scale, in both
        assert _tiny_step(continued, model, optimizer, overflow=False)
        assert continued.scale == 1024.0 and continued.overflow_steps == 1


def test_the_scale_stops_at_its_floor_and_too_many_overflows_in_a_row_stop_the_run():
    """Every step overflowing used to halve the scale down to 0.0 (no growth recovers from it) while the run
    went on and exited 0."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = build_loss_scaler(FP16_CHOICE, device=torch.device("cpu"), agree_over_ranks=False, init_scale=4.0,
                               growth_interval=2, max_overflow_steps=5)
    for _ in range(4):
        assert not _tiny_step(scaler, model, optimizer, overflow=True)
        scaler.check(step=1)  # fewer than 5 in a row: goes on
    assert scaler.scale == 1.0 and scaler.step_metrics()["overflow"]  # 4 -> 2 -> 1, then held at the floor of 1
    assert _tiny_step(scaler, model, optimizer, overflow=False) and scaler.overflows_in_a_row == 0  # a clean step
    for step in range(5):
        assert not _tiny_step(scaler, model, optimizer, overflow=True)
    assert scaler.scale == 1.0 and scaler.overflow_steps == 9
    with pytest.raises(TooManyOverflows, match="the last 5 optimizer steps .* overflowed although the loss scale "
                                               "went down to 1 .*--max-overflow-steps 5.*lower --lr"):
        scaler.check(step=10)
    small = build_loss_scaler(FP16_CHOICE, device=torch.device("cpu"), agree_over_ranks=False, init_scale=0.25,
                              growth_interval=2)
    assert small.min_scale == 0.25  # a scale asked below 1 is its own floor


def test_a_run_whose_every_step_overflows_stops_with_one_line_and_exit_1(tmp_path, data, monkeypatch, capsys):
    from shardkit.cli import main

    monkeypatch.setenv(faults.ENV_NAME, ",".join(f"overflow:{step}" for step in range(1, 9)))
    run_dir = tmp_path / "run"
    code = main(["train", "--data", data, "--steps", "8", "--warmup-steps", "1", "--batch-size", "4", "--device",
                 "cpu", "--precision", "fp16", "--loss-scale", "8", "--max-overflow-steps", "6", "--run-dir",
                 str(run_dir), "--cache-dir", str(tmp_path / "cache"), "--tensorboard", "false"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.count("\n") == 1 and err.startswith("error: fp16: the gradients of the last 6 optimizer steps (up "
                                                   "to step 6) overflowed"), err
    scales = loss_scales(run_dir)  # the records up to the stop are written: 8, 4, 2, 1, then held at 1
    assert [scales[step][0] for step in range(1, 7)] == [8.0, 4.0, 2.0, 1.0, 1.0, 1.0]
    assert all(scales[step][1] for step in range(1, 7)) and max(scales) == 6


def test_overflow_faults_are_parsed_and_act_on_every_attempt(monkeypatch):
    assert faults.parse_faults("overflow:3:1,step:7") == [("overflow", 3, 1), ("step", 7, None)]
    monkeypatch.setenv(faults.ENV_NAME, "overflow:3:1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # a restarted attempt meets the same batch again
    assert faults.overflow_now(3, 1) and not faults.overflow_now(3, 0) and not faults.overflow_now(4, 1)
    with pytest.raises(ValueError, match="WHERE:STEP"):
        faults.parse_faults("underflow:3")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    write_byte_dataset(str(root / "bytes"))
    return str(root / "bytes")


def run_in_process(run_dir, data, **top) -> TrainConfig:
    values = {"steps": 8, "device": "cpu", "optimizer": {"warmup_steps": 2},
              "data": {"data": data, "batch_size": 12, "cache_dir": str(run_dir.parent / "cache")},
              "logging": {"run_dir": str(run_dir), "log_every": 100, "tensorboard": False, "log_sample_ids": True},
              **top}
    run = build(config_from_dict(values))
    try:
        assert train(run) == 0
    finally:
        close(run)
    return run


def test_fp16_on_cpu_skips_the_forced_overflow_consumes_its_batches_and_records_it(tmp_path, data, monkeypatch,
                                                                                  caplog):
    """One process, real fp16 autocast on CPU: the step made to overflow logs its loss but does not
    update, the scale halves, every step reads the batch an fp32 run reads, and the count reaches
    metrics.jsonl, the Prometheus registry and the checkpoint."""
    caplog.set_level("INFO", logger="shardkit.train.loop")
    run_in_process(tmp_path / "fp32", data)
    assert "precision fp32: --precision auto: on cpu" in caplog.text
    monkeypatch.setenv(faults.ENV_NAME, "overflow:3")
    counted = metrics.value("shardkit_train_overflow_steps_total", rank="0")
    run = run_in_process(tmp_path / "fp16", data, **FP16)
    assert "precision fp16: asked for by --precision fp16" in caplog.text
    scales = loss_scales(tmp_path / "fp16")
    assert scales[2] == (65536.0, False, 0) and scales[3] == (65536.0, True, 1)
    assert all(scales[step] == (32768.0, False, 1) for step in range(4, 9))
    assert sample_ids(tmp_path / "fp16") == sample_ids(tmp_path / "fp32")  # the skipped step consumed its batch
    fp16, fp32 = losses(tmp_path / "fp16"), losses(tmp_path / "fp32")
    # Steps 1-3 see the same weights: fp16 rounding only (a run that did not compute in fp16 matches bitwise at
    # every step; one step's mean loss may round to the same float32 by chance: the data is cut from this
    # repository's sources, so it changes with every commit).
    assert all(fp16[step] == pytest.approx(fp32[step], rel=1e-2) for step in (1, 2, 3))
    assert any(fp16[step] != fp32[step] for step in (1, 2, 3))
    # Adam stepped 7 times, not 8: step 3 made no update.
    assert {int(state["step"]) for state in run.optimizer.state.values()} == {7}
    assert metrics.value("shardkit_train_overflow_steps_total", rank="0") - counted == 1
    assert metrics.value("shardkit_train_loss_scale", rank="0") == 32768.0
    marker = read_marker(find_latest(tmp_path / "fp16" / "checkpoints"))
    assert marker["precision"] == "fp16"
    assert marker["loss_scaler"] == {"scale": 32768.0, "growth_tracker": 5, "overflow_steps": 1,
                                     "overflows_in_a_row": 0}
    assert json.loads((tmp_path / "fp16" / "config.json").read_text())["mixed_precision"]["precision"] == "fp16"


def test_a_bf16_checkpoint_resumed_in_fp16_starts_at_the_initial_scale(tmp_path, data, caplog):
    caplog.set_level("INFO", logger="shardkit.train.loop")
    run_in_process(tmp_path / "run", data, steps=8, checkpoint={"checkpoint_every": 4}, precision="bf16")
    (tmp_path / "run" / "checkpoints" / "step_00000008").rename(tmp_path / "unused")
    run_in_process(tmp_path / "run", data, steps=8, loss_scale=1024.0, **FP16)
    assert "saved by a bf16 run, this run is fp16: the loss scale starts at --loss-scale" in caplog.text
    assert loss_scales(tmp_path / "run")[5][0] == 1024.0


# -- several ranks -------------------------------------------------------------------------------

LAYOUTS = {  # name -> (parallelism options, model options)
    "ddp": ({"parallel": "ddp"}, {}),
    "fsdp": ({"parallel": "fsdp"}, {}),
    "tp": ({"tp": 2}, {}),
    "pp": ({"pp": 2}, {"tie_embeddings": False}),
    "diloco": ({"parallel": "diloco"}, {}),
}


def _rank_worker(rank: int, port: int, layout: str, data: str, run_dir: str, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    # Rank 1 only (the last pipeline stage, which computes the loss): the others must skip as well.
    os.environ[faults.ENV_NAME] = "overflow:3:1"
    torch.set_num_threads(1)
    parallelism, model = LAYOUTS[layout]
    values = {"steps": 5, "device": "cpu", "precision": "fp16", "optimizer": {"warmup_steps": 1},
              "parallelism": {**parallelism, "comm_stats": False}, "model": model,
              "data": {"data": data, "batch_size": 6, "cache_dir": run_dir + "-cache"},
              "checkpoint": {"save_final": False}, "logging": {"run_dir": run_dir, "tensorboard": False}}
    run = build(config_from_dict(values))
    try:
        train(run)
        steps = {int(state["step"]) for state in run.optimizer.state.values()}
        results[rank] = {"overflow_steps": run.scaler.overflow_steps, "scale": run.scaler.scale,
                         "optimizer_steps": sorted(steps), "scaler": type(run.scaler.scaler).__name__}
    finally:
        close(run)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_forced_overflow_on_one_rank_is_skipped_on_every_rank(tmp_path, data, layout):
    results = mp.Manager().dict()
    run_dir = str(tmp_path / "run")
    mp.start_processes(_rank_worker, args=(free_port(), layout, data, run_dir, results), nprocs=2,
                       start_method="spawn")
    expected_scaler = "GradScaler" if layout == "ddp" else "ShardedGradScaler"
    for rank in range(2):  # 5 steps, one skipped: 4 optimizer updates on every rank, the same scale
        assert results[rank] == {"overflow_steps": 1, "scale": 32768.0, "optimizer_steps": [4],
                                 "scaler": expected_scaler}, (rank, dict(results))
    scales = loss_scales(tmp_path / "run")
    assert [scales[step][:2] for step in (2, 3, 4)] == [(65536.0, False), (65536.0, True), (32768.0, False)]


# The scale doubles after every 3 clean steps in a row: the checkpoint of step 4 is one clean step into a
# round, so the resumed run grows at step 7 only if it got the growth tracker back, not only the scale.
DYNAMIC = ("--precision", "fp16", "--loss-scale", "32768", "--loss-scale-growth-interval", "3")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_fp16_sigkill_of_every_rank_then_resume_is_bitwise_exact(tmp_path, data, parallel):
    reference = tmp_path / "reference"
    check_ok(torchrun(reference, data, parallel=parallel, fault="overflow:7:1", extra=DYNAMIC))
    scales = loss_scales(reference)
    assert scales[4][0] == 2 * scales[3][0] and scales[7][0] == 2 * scales[6][0], scales  # grew at 4 and 7
    assert [step for step, (_, overflow, _) in scales.items() if overflow] == [7], scales  # the forced one
    assert scales[8] == (scales[7][0] / 2, False, 1), scales
    run_dir = tmp_path / "run"
    killed = torchrun(run_dir, data, parallel=parallel, fault="overflow:7:1,step:8", extra=DYNAMIC)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    # It ran steps 5-7 (their sample ids are logged at once); their metrics records waited for the next sync
    # point (step 8's checkpoint) and died with the run: the resumed run writes them.
    assert checkpoints(run_dir) == ["step_00000004"] and max(sample_ids(run_dir)) == 7
    assert max(losses(run_dir)) == 4
    resumed = check_ok(torchrun(run_dir, data, parallel=parallel, fault="overflow:7:1", extra=DYNAMIC))
    assert "resumed from" in resumed.stdout and "step 4" in resumed.stdout
    assert losses(run_dir) == losses(reference)  # float equality: bitwise
    assert loss_scales(run_dir) == scales
    assert sample_ids(run_dir) == sample_ids(reference)
    final = read_marker(find_latest(run_dir / "checkpoints"))["loss_scaler"]
    assert final == read_marker(find_latest(reference / "checkpoints"))["loss_scaler"]
