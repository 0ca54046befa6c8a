"""The training loop in this process (one rank, no torchrun): SIGTERM checkpoints, accumulation, eval."""

from __future__ import annotations

import json
import os
import signal

import pytest

from shardkit.train.checkpoint import MARKER_NAME, find_latest
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


def run_training(run_dir, data, *, signal_at_batch=None, before_close=None, **options):
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
        code = train(run)
        if before_close is not None:
            before_close()
        return code
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


@pytest.mark.parametrize("step_size", [{"grad_accum": 2}, {"global_batch_tokens": 2 * 6 * 32}])
def test_gradient_accumulation_matches_the_full_batch(tmp_path, datasets, reference, step_size, caplog):
    data, _ = datasets
    caplog.set_level("INFO", logger="shardkit.train.loop")
    run_training(tmp_path / "accumulated", data, **step_size, **{"data.batch_size": 6})
    assert json.loads((tmp_path / "accumulated" / "config.json").read_text())["training"]["grad_accum"] == 2
    assert ("one optimizer step holds 384 tokens: --batch-size 6 x seq_len 32 x --grad-accum 2 micro-steps x 1 "
            "data-parallel rank(s)") in caplog.text
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
    with pytest.raises(ValueError, match="--n-layer: checkpoint 2, this run 3"):
        run_training(tmp_path / "run", data, steps=4, **{"model.n_layer": 3})
    # The case: fields the old hand-written list left out (RoPE's tables are not saved at all).
    with pytest.raises(ValueError, match="--rope-theta: checkpoint 10000.0, this run 500.0; "
                                         "--norm-eps: checkpoint 1e-05, this run 0.1"):
        run_training(tmp_path / "run", data, steps=4, **{"model.rope_theta": 500.0, "model.norm_eps": 0.1})
    # Dropout is declared a change a resumed run may make.
    assert run_training(tmp_path / "run", data, steps=4, **{"model.dropout": 0.1}) == 0
    assert "at step 3" in capsys.readouterr().out and sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["dropout"] == 0.1


def test_resume_without_model_options_builds_the_checkpoints_model(tmp_path, datasets, caplog):
    """nanoGPT's resume: no model option (nor --preset) given, the checkpoint's model is rebuilt, rope_theta
    included, and the run goes on exactly as the uninterrupted run with those options."""
    data, _ = datasets
    model = {"model.n_layer": 3, "model.rope_theta": 500.0, "model.norm_eps": 1e-4}
    run_training(tmp_path / "reference", data, steps=5, **model)
    run_training(tmp_path / "run", data, steps=3, **model)
    with caplog.at_level("INFO", logger="shardkit.train.checkpoint_model"):
        assert run_training(tmp_path / "run", data, steps=5) == 0
    assert "building the model checkpoint" in caplog.text and "--rope-theta 500.0" in caplog.text
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (recorded["n_layer"], recorded["rope_theta"], recorded["norm_eps"]) == (3, 500.0, 1e-4)
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")
    marker = json.loads((find_latest(tmp_path / "run" / "checkpoints") / MARKER_NAME).read_text())
    assert marker["model"] == {**recorded, "padded_vocab_size": 256}


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


def test_resume_from_a_crafted_checkpoint_runs_no_code(tmp_path, datasets, capsys):
    from shardkit.cli import main
    from test_checkpoint import planting, tamper_metadata

    data, _ = datasets
    run_training(tmp_path / "run", data, steps=3)
    flag = tmp_path / "pwned"
    tamper_metadata(find_latest(tmp_path / "run" / "checkpoints"), planting(flag))
    code = main(["train", "--data", data, "--steps", "4", "--warmup-steps", "2", "--batch-size", "12",
                 "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--tensorboard", "false",
                 "--resume", "auto"])
    err = capsys.readouterr().err
    assert code != 0 and not flag.exists()
    assert "refers to builtins.exec, which is not a checkpoint metadata type" in err and "Traceback" not in err


def test_a_torn_last_record_is_dropped_and_damage_elsewhere_is_refused(tmp_path, datasets, caplog):
    data, _ = datasets
    run_dir = tmp_path / "run"
    assert run_training(run_dir, data, steps=3, **{"logging.log_sample_ids": True}) == 0
    metrics, samples = run_dir / "metrics.jsonl", run_dir / "samples" / "rank-0.jsonl"
    for path in (metrics, samples):  # what a crash in the middle of an append leaves
        with open(path, "a") as handle:
            handle.write('{"step": 4, "loss": 1.2, "ids": [1')
    assert run_training(run_dir, data, steps=4, **{"logging.log_sample_ids": True}) == 0
    torn = [r.getMessage() for r in caplog.records if "half-written" in r.getMessage()]
    assert any(str(metrics) in m for m in torn) and any(str(samples) in m for m in torn)
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    assert [json.loads(line)["step"] for line in samples.read_text().splitlines()] == [1, 2, 3, 4]
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], lines[1][:-5], *lines[2:]]) + "\n")  # damage that is no crash's
    with pytest.raises(ValueError, match=f"{metrics} line 2 is damaged"):
        run_training(run_dir, data, steps=5)


def test_the_trainers_endpoint_listens_on_loopback_unless_told(tmp_path, datasets):
    from conftest import accepts, free_port, outside_address

    outside = outside_address()
    if outside is None:
        pytest.skip("this machine has no interface besides loopback")
    data, _ = datasets
    loopback, everywhere = free_port(), free_port()
    listening = []  # checked after the last step, before the run closes (which stops the endpoint)
    assert run_training(tmp_path / "a", data, steps=3, **{"logging.metrics_port": loopback}, before_close=lambda:
                        listening.append((accepts("127.0.0.1", loopback), accepts(outside, loopback)))) == 0
    assert run_training(tmp_path / "b", data, steps=3, **{"logging.metrics_port": everywhere,
                                                           "logging.metrics_address": "0.0.0.0"},
                        before_close=lambda: listening.append((accepts(outside, everywhere),))) == 0
    assert listening == [(True, False), (True,)]
    with pytest.raises(ValueError, match="--metrics-address must be an IP address or host name"):
        run_training(tmp_path / "c", data, **{"logging.metrics_address": "http://0.0.0.0"})


def test_a_diloco_checkpoint_is_not_continued_by_another_mode(tmp_path, datasets):
    data, _ = datasets
    diloco = {"parallelism.parallel": "diloco", "diloco.sync_every": 2}
    assert run_training(tmp_path / "run", data, steps=3, **diloco) == 0
    for mode in ("ddp", "none"):
        with pytest.raises(ValueError, match="saved by a --parallel diloco run: its model entry is one rank's replica"):
            run_training(tmp_path / "run", data, steps=4, **{"parallelism.parallel": mode})
    assert run_training(tmp_path / "run", data, steps=4, **diloco) == 0  # diloco itself continues it


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_checkpoint(tmp_path, datasets, small_disk, capsys):
    from shardkit.cli import main

    data, _ = datasets
    disk = small_disk("600k")  # the tiny model's checkpoint takes about 2 MB
    code = main(["train", "--data", data, "--steps", "3", "--warmup-steps", "1", "--batch-size", "12",
                 "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--tensorboard", "false",
                 "--checkpoint-dir", str(disk / "checkpoints")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if "no space left" in line]
    assert f"no space left in {disk / 'checkpoints'} for checkpoint step 3: it needs about" in line
    assert list((disk / "checkpoints").iterdir()) == []  # nothing half-written left, nothing taken as complete


def test_metrics_ports_beyond_65535_are_refused_on_every_rank_before_any_process_group(tmp_path, datasets):
    from train_runs import torchrun

    data, _ = datasets
    result = torchrun(tmp_path / "run", data, nproc=2, extra=("--metrics-port", "65535"), timeout=120)
    message = "--metrics-port 65535 + local rank goes up to 65536 with 2 ranks on this node, beyond 65535"
    # Every rank checks it before any process group; torchrun stops the other rank as soon as one exits, so the
    # second may be stopped before it prints (a race seen on a busy machine): at least one refusal, no group.
    assert result.returncode != 0 and result.stderr.count(message) >= 1, result.stderr[-3000:]
    assert "gloo" not in result.stderr.lower() and "ProcessGroup" not in result.stderr
