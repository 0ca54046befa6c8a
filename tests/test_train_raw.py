"""The trainer straight from raw text: `--data 'corpus/*.jsonl' --tokenizer SPEC` trains without a build, and a
resumed run continues with exactly the samples of an uninterrupted one."""

from __future__ import annotations

import json

from shardkit.cli import main
from shardkit.train.config import config_from_dict
from shardkit.train.loop import build, close, train
from test_build import write_corpus
from train_runs import losses, sample_ids


def run(corpus, run_dir, steps, *, data=None, **checkpoint):
    """Train `steps` steps on `corpus` with the byte tokenizer (or on the data options `data`) in this process."""
    data = data or {"data": f"{corpus}/*.jsonl*", "tokenizer": "byte", "lanes": 3, "batch_size": 4,
                    "eval_data": f"{corpus}/d.parquet", "eval_batches": 2}
    values = {"steps": steps, "device": "cpu", "optimizer": {"warmup_steps": 1}, "eval_every": 2,
              "model": {"seq_len": 64}, "data": data,
              "checkpoint": checkpoint,
              "logging": {"run_dir": str(run_dir), "tensorboard": False, "log_sample_ids": True}}
    state = build(config_from_dict(values))
    try:
        train(state)
    finally:
        close(state)


def test_train_from_raw_text_and_resume_exactly(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs=60)
    run(corpus, tmp_path / "whole", 4)
    run(corpus, tmp_path / "split", 2)
    run(corpus, tmp_path / "split", 4)  # resumes from the step-2 checkpoint
    assert sample_ids(tmp_path / "split") == sample_ids(tmp_path / "whole")
    assert sorted(sample_ids(tmp_path / "whole")) == [1, 2, 3, 4]
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    evaluated = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evaluated if "eval_loss" in r] == [2, 4]  # the held-out set is raw text too


def test_raw_text_needs_seq_len(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    code = main(["train", "--data", f"{corpus}/*.jsonl", "--tokenizer", "byte", "--steps", "1", "--device", "cpu",
                 "--run-dir", str(tmp_path / "run"), "--tensorboard", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "needs --seq-len" in err and "Traceback" not in err


def test_bad_input_options_reach_the_raw_loader(tmp_path, capsys):
    """--on-corrupt skip trains through a truncated file; --skip-samples is refused by name, not ignored."""
    from test_raw_unreadable import damage_zst

    corpus = write_corpus(tmp_path / "corpus", docs=60)
    damage_zst(corpus / "c.jsonl.zst", keep=0.3)  # about 3 kB of text before the damage: read within 12 steps
    args = ["train", "--data", f"{corpus}/c.jsonl.zst", "--tokenizer", "byte", "--seq-len", "64", "--lanes", "1",
            "--batch-size", "8", "--steps", "12", "--device", "cpu", "--tensorboard", "false"]
    assert main([*args, "--run-dir", str(tmp_path / "raise")]) != 0
    assert "c.jsonl.zst: cannot read it" in capsys.readouterr().err
    assert main([*args, "--run-dir", str(tmp_path / "skip"), "--on-corrupt", "skip"]) == 0
    code = main([*args, "--run-dir", str(tmp_path / "ids"), "--skip-samples", "5"])
    err = capsys.readouterr().err
    assert code == 2 and "skip_samples is not supported for raw text" in err and "Traceback" not in err


def test_a_built_held_out_set_beside_raw_training_text(tmp_path, capsys):
    """--eval-data naming a built dataset is read as built data under --tokenizer, and a held-out set built with
    other settings is refused by name before step 1 (not with the Python API's message about mixtures)."""
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    for name, seq_len in (("held64", "64"), ("held32", "32")):
        assert main(["build", f"{corpus}/d.parquet", "--output", str(tmp_path / name), "--tokenizer", "byte",
                     "--seq-len", seq_len]) == 0
    args = ["train", "--data", f"{corpus}/*.jsonl", "--tokenizer", "byte", "--seq-len", "64", "--batch-size", "2",
            "--steps", "1", "--device", "cpu", "--tensorboard", "false", "--eval-batches", "1"]
    assert main([*args, "--eval-data", str(tmp_path / "held64"), "--run-dir", str(tmp_path / "run")]) == 0
    evaluated = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evaluated if "eval_loss" in r] == [1]
    capsys.readouterr()
    assert main([*args, "--eval-data", str(tmp_path / "held32"), "--run-dir", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "--eval-data" in err and "seq_len 32" in err and "Traceback" not in err


def test_built_training_data_under_tokenizer_is_refused_by_name(tmp_path, capsys):
    """--tokenizer tokenizes raw text; a --data whose every entry is a built dataset is refused with the options
    to change (not the Python API's message about marking raw-text streams); raw text beside it still mixes."""
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    assert main(["build", f"{corpus}/d.parquet", "--output", str(tmp_path / "built"), "--tokenizer", "byte",
                 "--seq-len", "64"]) == 0
    capsys.readouterr()
    args = ["train", "--tokenizer", "byte", "--seq-len", "64", "--batch-size", "2", "--steps", "1", "--device", "cpu",
            "--tensorboard", "false"]
    assert main([*args, "--data", str(tmp_path / "built"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--data {tmp_path / 'built'}" in err and "drop --tokenizer" in err and "Traceback" not in err
    assert "Stream(" not in err
