"""The training loop in this process (one rank, no torchrun): SIGTERM checkpoints, accumulation, eval."""

from __future__ import annotations

import json
import os
import signal

import pytest

from shardkit.train.checkpoint import find_latest
from shardkit.train.config import config_from_dict
from shardkit.train.loop import build, close, train
from train_runs import losses, write_byte_dataset


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    write_byte_dataset(str(root / "train"))
    write_byte_dataset(str(root / "eval"), num_samples=48, seed=1)
    return str(root / "train"), str(root / "eval")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, datasets):
    """One uninterrupted 8-step run, shared by the comparisons below."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert run_training(run_dir, datasets[0]) == 0
    return run_dir


def run_training(run_dir, data, *, signal_at_batch=None, **options):
    values = {"steps": 8, "device": "cpu", "optimizer": {"warmup_steps": 2},
              "data": {"data": data, "batch_size": 12, "cache_dir": str(run_dir.parent / "cache")},
              "logging": {"run_dir": str(run_dir), "log_every": 100, "tensorboard": False}}
    for key, value in options.items():
        section, _, name = key.rpartition(".")
        (values.setdefault(section, {}) if section else values)[name] = value
    run = build(config_from_dict(values))
    if signal_at_batch is not None:
        stream, count = run.data, [0]

        class SignalOnBatch:  # delivers SIGTERM while the loop waits for batch k, like a scheduler would
            def __next__(self):
                count[0] += 1
                if count[0] == signal_at_batch:
                    os.kill(os.getpid(), signal.SIGTERM)
                return next(stream)

            def state_dict(self):
                return stream.state_dict()

        run.data = SignalOnBatch()
    try:
        return train(run)
    finally:
        close(run)


def test_sigterm_saves_a_checkpoint_and_resume_is_exact(tmp_path, datasets, reference, capsys):
    data, _ = datasets
    run_dir = tmp_path / "run"
    handler_before = signal.getsignal(signal.SIGTERM)  # not always SIG_DFL: e.g. ray.init installs one
    assert run_training(run_dir, data, signal_at_batch=3) == 128 + signal.SIGTERM
    assert "stopped by a signal after step 3" in capsys.readouterr().out
    assert find_latest(run_dir / "checkpoints").name == "step_00000003"
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the loop restored the handlers
    assert run_training(run_dir, data) == 0
    # Starting over would reproduce the reference too: the run must say it continued from step 3.
    assert "step_00000003 at step 3" in capsys.readouterr().out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["resumed_from"] for r in records if "resumed_from" in r] == ["step_00000003"]
    assert losses(run_dir) == losses(reference)


def test_gradient_accumulation_matches_the_full_batch(tmp_path, datasets, reference):
    data, _ = datasets
    run_training(tmp_path / "accumulated", data, grad_accum=2, **{"data.batch_size": 6})
    full, accumulated = losses(reference), losses(tmp_path / "accumulated")
    assert full.keys() == accumulated.keys()
    for step in full:  # same samples per step; only the summation order differs
        assert accumulated[step] == pytest.approx(full[step], rel=1e-5)


def test_eval_every_n_steps_and_document_mask(tmp_path, datasets):
    data, eval_data = datasets
    run_training(tmp_path / "run", data, eval_every=4, steps=16, **{"data.eval_data": eval_data,
                                                                   "model.document_mask": True})
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8, 12, 16]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["document_mask"] is True and config["model"]["vocab_size"] == 256


def test_resume_refuses_another_model(tmp_path, datasets, capsys):
    data, _ = datasets
    run_training(tmp_path / "run", data, steps=3)
    first = losses(tmp_path / "run")
    assert run_training(tmp_path / "run", data, steps=3) == 0  # finished already: resumes at 3, trains nothing
    assert "at step 3" in capsys.readouterr().out and losses(tmp_path / "run") == first
    with pytest.raises(ValueError, match="--n-layer 2 \\(now 3\\)"):
        run_training(tmp_path / "run", data, steps=4, **{"model.n_layer": 3})


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="shardkit.json not found"):
        run_training(tmp_path / "run", str(tmp_path / "nowhere"))


def test_activation_checkpointing_gives_the_same_losses(tmp_path, datasets, reference):
    data, _ = datasets
    run_training(tmp_path / "recompute", data, activation_checkpointing=True)
    assert losses(tmp_path / "recompute") == losses(reference)


def test_shardkit_train_command(tmp_path, datasets, capsys):
    from shardkit.cli import main

    data, _ = datasets
    code = main(["train", "--data", data, "--steps", "3", "--warmup-steps", "1", "--batch-size", "4",
                 "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--log-every", "1",
                 "--tensorboard", "false"])
    assert code == 0
    out = capsys.readouterr().out
    assert "step      3/3 | loss" in out and "mfu n/a" in out
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "curves.png").exists()
    assert main(["train", "--data", data, "--n-head", "5"]) == 2
    assert "--d-model (64) must be divisible by --n-head (5)" in capsys.readouterr().err


@pytest.mark.s3
def test_training_from_s3_keeps_storage_options_out_of_the_run_dir(tmp_path, s3_bucket, capsys):
    url, options = s3_bucket
    write_byte_dataset(url, num_samples=24, storage_options=options)
    assert run_training(tmp_path / "run", url, steps=3, **{"data.storage_options": json.dumps(options)}) == 0
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]
    saved = (tmp_path / "run" / "config.json").read_text()
    assert '"storage_options": "<redacted>"' in saved and "endpoint_url" not in saved
    captured = capsys.readouterr()
    assert "endpoint_url" not in captured.out + captured.err
