"""A build killed with SIGKILL and run again finishes without redoing shards, with the same manifest."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from shardkit.manifest import MANIFEST_NAME
from shardkit.tools.state import CHECKPOINT_NAME, load_checkpoint
from shardkit.storage import Storage

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()


def command(corpus, output, packing):
    return [sys.executable, "-m", "shardkit", "build", str(corpus), "--output", str(output), "--tokenizer", "byte",
            "--seq-len", "127", "--pack", packing, "--shard-size", "24KB", "--unit-size", "32KiB", "--workers", "1",
            "--no-progress"]


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["concat", "bestfit"])
def test_sigkill_then_rerun_gives_the_uninterrupted_manifest(tmp_path, packing):
    rng = random.Random(0)
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as fh:
        for i in range(3000):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150)))}) + "\n")
    reference = tmp_path / "reference"
    subprocess.run(command(corpus, reference, packing), check=True, capture_output=True)

    killed = tmp_path / "killed"
    process = subprocess.Popen(command(corpus, killed, packing), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    storage = Storage(str(killed))
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and process.poll() is None:
            checkpoint = load_checkpoint(storage) if (killed / CHECKPOINT_NAME).exists() else None
            if checkpoint is not None and len(checkpoint[0]["shards"]) >= 5:
                break
            time.sleep(0.005)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the build and its worker processes, at once
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the build finished before it could be killed; make the corpus larger"
    assert not (killed / MANIFEST_NAME).exists()
    done = load_checkpoint(storage)[0]["shards"]
    before = {s["name"]: (killed / s["name"]).stat() for s in done}

    rerun = subprocess.run(command(corpus, killed, packing), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "(resumed)" in rerun.stderr
    assert (killed / MANIFEST_NAME).read_bytes() == (reference / MANIFEST_NAME).read_bytes()
    for name, stat in before.items():  # finished shards were not rewritten
        after = (killed / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns), name
    report = json.loads((killed / "build_report.json").read_text())
    assert report["resumed"] and report["shards_from_before_resume"] == len(before)
    assert report["documents"]["in"] == 3000 == report["documents"]["written"]
    assert sorted(os.listdir(killed)) == sorted(os.listdir(reference))  # no leftovers


def test_a_build_killed_after_publishing_its_manifest_leaves_nothing_after_the_next_run(tmp_path):
    """A SIGKILL between the manifest's publication and the checkpoint's removal leaves `_build/`; the next
    run finds the finished build ("done") and removes what the killed one left."""
    rng = random.Random(1)
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as fh:
        for _ in range(300):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150)))}) + "\n")
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(command(corpus, reference, "concat"), check=True, capture_output=True)
    # The kill lands exactly there: the build's own clear_state is replaced by a SIGKILL of the process.
    kill_at_clear = ("import os, signal, sys; import shardkit.tools.state as state; "
                     "state.clear_state = lambda storage: os.kill(os.getpid(), signal.SIGKILL); "
                     "from shardkit.cli import main; sys.exit(main(sys.argv[1:]))")
    killed_run = subprocess.run([sys.executable, "-c", kill_at_clear, *command(corpus, killed, "concat")[3:]],
                                capture_output=True, text=True)
    assert killed_run.returncode == -signal.SIGKILL, killed_run.stderr
    assert (killed / MANIFEST_NAME).exists() and (killed / CHECKPOINT_NAME).exists()
    rerun = subprocess.run(command(corpus, killed, "concat"), capture_output=True, text=True)
    assert rerun.returncode == 0 and "already holds this build" in rerun.stderr, rerun.stderr
    assert sorted(os.listdir(killed)) == sorted(os.listdir(reference))  # the checkpoint and _build/ are gone
    assert (killed / MANIFEST_NAME).read_bytes() == (reference / MANIFEST_NAME).read_bytes()
