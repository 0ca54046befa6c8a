"""SIGKILL matrices (>= 20 seeded random kill points each) and 16 processes sharing one cache under a
limit, each scenario run by one long-lived harness process (tests/kill_harness.py) that forks its
runs. Training kills are covered by the trainer's own tests (tests/test_loop.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from loader_helpers import write_fixed

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
POINTS = 20
WORDS = "the of and to in is was for on that with as by at from his her it an were are which be this".split()


def harness(mode: str, source, workdir, amount, seed: int = 1) -> dict:
    result = subprocess.run([sys.executable, str(HERE / "kill_harness.py"), mode, str(source), str(workdir),
                             str(amount), str(seed)], capture_output=True, text=True, timeout=300, cwd=HERE.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_build_sigkill_matrix(tmp_path, figures):
    corpus = tmp_path / "corpus.jsonl"
    rng = random.Random(0)
    with open(corpus, "w") as fh:
        for _ in range(600):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))}) + "\n")
    (tmp_path / "work").mkdir()
    result = harness("build", corpus, tmp_path / "work", POINTS)
    assert result["runs"] >= POINTS and result["killed_mid_build"] >= POINTS * 3 // 4, result
    assert result["mismatches"] == 0, result  # every resumed output == the uninterrupted build's manifest
    # A resume, not a rebuild: after a late kill the final run reports the shards it took up (exactly
    # those the checkpoint held), and none of the shards finished before any kill was rewritten.
    assert result["late_kill_outputs"] >= 1 and result["resumed_outputs"] == result["late_kill_outputs"], result
    assert result["reused_shards"] > 0 and result["reuse_mismatches"] == 0 and result["rewritten_shards"] == 0, result
    assert result["leftovers"] == 0 and result["orphaned_workers"] == 0, result
    figures.add("sigkill_build", runs=result["runs"], kills=result["killed_mid_build"],
                samples_checked=result["samples_checked"], lost=0, duplicated=0, corrupt=result["mismatches"],
                reused_shards=result["reused_shards"], rewritten_shards=result["rewritten_shards"],
                leftover_temporaries=result["leftovers"], orphaned_workers=result["orphaned_workers"])


def test_cache_download_sigkill_matrix(tmp_path, figures):
    dataset = tmp_path / "ds"
    write_fixed(str(dataset), 6 * 1000, seq_len=63, per_shard=1000)
    (tmp_path / "work").mkdir()
    result = harness("cache", dataset, tmp_path / "work", POINTS)
    assert result["killed_mid_run"] == POINTS and result["runs"] >= POINTS, result
    assert result["kills_during_download"] >= POINTS // 4, result
    assert result["deadlocks"] == 0 and result["corrupt"] == 0 and result["leftovers"] == 0, result
    figures.add("sigkill_cache_download", runs=result["runs"], kills=result["killed_mid_run"],
                kills_during_download=result["kills_during_download"], samples_checked=result["samples_checked"],
                lost=0, duplicated=0, corrupt=result["corrupt"], deadlocks=result["deadlocks"])


def test_training_sigkill_matrix(tmp_path, figures):
    """20 seeded random SIGKILLs of a training run (start-up, steps, checkpoint saves), each resumed
    with --resume auto: losses bitwise equal to an uninterrupted run, every sample id once."""
    from train_runs import write_byte_dataset

    write_byte_dataset(str(tmp_path / "data"))
    (tmp_path / "work").mkdir()
    command = [sys.executable, str(HERE / "train_kill_harness.py"), str(tmp_path / "data"), str(tmp_path / "work"),
               str(POINTS), "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=HERE.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runs"] == POINTS and result["kills"] >= POINTS * 3 // 4, result
    assert result["killed_before_first_checkpoint"] <= POINTS // 2, result  # most resume from a checkpoint
    assert result["failed_resumes"] == 0 and result["loss_mismatches"] == 0 and result["id_mismatches"] == 0, result
    # Each resumed run said which checkpoint it continued, the newest the kill left: starting over fails this.
    assert result["resume_mismatches"] == 0 and result["resumed_from_checkpoint"] >= POINTS // 2, result
    assert result["duplicated"] == 0 and result["lost"] == 0 and result["samples_checked"] == POINTS * 96, result
    figures.add("sigkill_training", runs=result["runs"], kills=result["kills"],
                killed_before_first_checkpoint=result["killed_before_first_checkpoint"],
                resumed_from_checkpoint=result["resumed_from_checkpoint"], resume_mismatches=result["resume_mismatches"],
                samples_checked=result["samples_checked"], lost=result["lost"], duplicated=result["duplicated"],
                corrupt=result["loss_mismatches"])


def test_training_sigkill_from_raw_text(tmp_path, figures):
    """Training straight from raw text (tokenized and packed in the loader) killed at seeded random moments and
    resumed: losses bitwise equal to an uninterrupted run, every sample id once (a small matrix)."""
    from test_build import write_corpus

    corpus = write_corpus(tmp_path / "corpus", docs=120)
    (tmp_path / "work").mkdir()
    points = 6
    options = {"data": {"tokenizer": "byte", "lanes": 4}, "model": {"seq_len": 64}}
    command = [sys.executable, str(HERE / "train_kill_harness.py"), f"{corpus}/*.jsonl*", str(tmp_path / "work"),
               str(points), "3", json.dumps(options)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=HERE.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runs"] == points and result["kills"] >= points // 2, result
    assert result["failed_resumes"] == 0 and result["loss_mismatches"] == 0, result
    assert result["id_mismatches"] == 0 and result["resume_mismatches"] == 0, result
    assert result["resumed_from_checkpoint"] >= 1, result
    assert result["duplicated"] == 0 and result["lost"] == 0 and result["samples_checked"] == points * 96, result
    figures.add("sigkill_training_raw_text", runs=result["runs"], kills=result["kills"],
                resumed_from_checkpoint=result["resumed_from_checkpoint"], samples_checked=result["samples_checked"],
                lost=result["lost"], duplicated=result["duplicated"], corrupt=result["loss_mismatches"])


def test_training_sigkill_with_a_weight_schedule(tmp_path, figures):
    """A two-stream mixture whose weights switch at step 4 (issue 15: "a schedule across a kill +
    resume"): SIGKILLed at seeded random moments and resumed, every run reproduces the uninterrupted
    run's losses bitwise and its sample ids step by step, on both sides of the switch."""
    from train_runs import write_byte_dataset

    write_byte_dataset(str(tmp_path / "a"), seed=0)
    write_byte_dataset(str(tmp_path / "b"), seed=1)
    data = f"{tmp_path / 'a'}:[[0,0.8],[4,0.2]] {tmp_path / 'b'}:[[0,0.2],[4,0.8]]"
    (tmp_path / "work").mkdir()
    points = 6
    command = [sys.executable, str(HERE / "train_kill_harness.py"), data, str(tmp_path / "work"), str(points), "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=HERE.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # A kill may come after a fast run finished; most runs must have been killed and resumed.
    assert result["runs"] == points and result["kills"] >= points // 2, result
    assert result["failed_resumes"] == 0 and result["loss_mismatches"] == 0 and result["id_mismatches"] == 0, result
    assert result["resume_mismatches"] == 0 and result["resumed_from_checkpoint"] >= 2, result
    assert result["duplicated"] == 0 and result["lost"] == 0, result
    # Both streams before and after the switch: the reference's steps 0-3 lean on a, 4-7 on b.
    assert result["reference_stream_shares"][0] > 0.5 > result["reference_stream_shares"][1], result
    figures.add("sigkill_training_weight_schedule", runs=result["runs"], kills=result["kills"],
                resumed_from_checkpoint=result["resumed_from_checkpoint"], samples_checked=result["samples_checked"],
                lost=result["lost"], duplicated=result["duplicated"], corrupt=result["loss_mismatches"])


def test_training_sigkill_in_fp16_keeps_the_loss_scale_bitwise(tmp_path, figures):
    """--precision fp16 with a high initial scale (real overflows in the first steps, then growth after every
    two clean steps) and an overflow forced at step 5: SIGKILLed at seeded random moments and resumed, every
    run repeats the uninterrupted run's losses, loss scales and overflow-skipped counts bitwise, and the
    skipped steps' samples are consumed once, in their steps."""
    from train_runs import write_byte_dataset

    write_byte_dataset(str(tmp_path / "data"))
    (tmp_path / "work").mkdir()
    points = 6
    # From 2**20 this run doubles its scale after step 2, overflows for real at step 3 (the chunked loss keeps
    # smaller scales clean), and doubles again after step 7; seed 1 aims kills after the checkpoints of steps 1
    # and 6, where the scale's growth tracker is 1, not 0.
    options = {"precision": "fp16", "loss_scale": 1048576.0, "loss_scale_growth_interval": 2}
    command = [sys.executable, str(HERE / "train_kill_harness.py"), str(tmp_path / "data"), str(tmp_path / "work"),
               str(points), "1", json.dumps(options)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=HERE.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "SHARDKIT_FAULT_INJECT": "overflow:5"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    scales = {int(step): value for step, value in result["reference_loss_scales"].items()}
    overflows = [step for step, (_, overflow, _) in sorted(scales.items()) if overflow]
    assert 5 in overflows and len(overflows) >= 2, scales  # the forced overflow and real ones
    assert any(scales[step][0] > scales[step - 1][0] for step in range(2, 9)), scales  # the scale grew too
    assert result["runs"] == points and result["kills"] >= points // 2, result
    assert result["failed_resumes"] == 0 and result["loss_mismatches"] == 0 and result["id_mismatches"] == 0, result
    assert result["scale_mismatches"] == 0, result
    assert result["resume_mismatches"] == 0 and result["resumed_from_checkpoint"] >= 2, result
    assert result["duplicated"] == 0 and result["lost"] == 0, result
    figures.add("sigkill_training_fp16", runs=result["runs"], kills=result["kills"],
                resumed_from_checkpoint=result["resumed_from_checkpoint"], samples_checked=result["samples_checked"],
                lost=result["lost"], duplicated=result["duplicated"],
                corrupt=result["loss_mismatches"] + result["scale_mismatches"])


def test_sixteen_processes_share_a_cache_smaller_than_the_dataset(tmp_path, figures):
    dataset = tmp_path / "ds"
    manifest = write_fixed(str(dataset), 48 * 50, seq_len=255, per_shard=50)
    (tmp_path / "work").mkdir()
    # The limit holds 36 of the 48 decoded shards: every epoch must evict at least 12.
    result = harness("concurrency", dataset, tmp_path / "work", 0.75)
    assert result["processes"] == 16 and result["deadlocks"] == 0 and result["failed"] == 0, result
    assert result["corrupt"] == 0 and result["lost"] == 0 and result["duplicated"] == 0, result
    assert result["samples_checked"] == 2 * (manifest.num_samples - manifest.num_samples % 16)
    assert result["epochs_differ"] == 1 and result["peak_cache_bytes_ok"] == 1
    figures.add("cache_16_processes", runs=1, processes=16, epochs=2, samples_checked=result["samples_checked"],
                lost=result["lost"], duplicated=result["duplicated"], corrupt=result["corrupt"],
                deadlocks=result["deadlocks"])


def test_build_rerun_removes_temporaries_a_kill_left(tmp_path, monkeypatch):
    """Found by the build SIGKILL matrix: a kill while the report or the manifest is being written
    leaves `build_report.json.tmp-<uuid>` / `shardkit.json.tmp-<uuid>` in the output, and the resumed
    build never removes them (the shards' temporaries are removed)."""
    import shardkit.tools.build as build_module
    from shardkit.tools.build import BuildConfig, run_build

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200)))
    output = tmp_path / "out"
    config = BuildConfig(inputs=(str(corpus),), output=str(output), tokenizer="byte", seq_len=63, shard_size=4000,
                         workers=1, progress=False)

    def die(*args, **kwargs):
        raise KeyboardInterrupt("killed just before the manifest")

    # The state a kill during the final writes leaves: shards and checkpoint in place, the manifest
    # not published, the temporaries of the interrupted atomic writes beside them.
    with monkeypatch.context() as patch:
        patch.setattr(build_module, "write_manifest", die)
        with pytest.raises(KeyboardInterrupt):
            run_build(config)
    (output / "build_report.json.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"{")
    (output / "shardkit.json.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"{")
    (output / "shard-000001.tar.tmp-0123456789abcdef0123456789abcdef").write_bytes(b"x")
    assert run_build(config).status == "resumed"
    assert sorted(p.name for p in output.iterdir() if ".tmp-" in p.name) == []
