"""`shardkit build` against hostile or careless use: inputs edited between runs, Ctrl-C, symlinks out of the
output, files that are not tokenizers, unreadable inputs (issue #10 items 4, 9, 12, 13; #9 item 6)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import shardkit.tools.build as build_module
from shardkit.cli import main
from shardkit.manifest import MANIFEST_NAME
from shardkit.tools.build import BuildConfig, run_build
from shardkit.tools.state import CHECKPOINT_NAME

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


def write_jsonl(path, docs: int, *, seed: int = 0, length: int = 40) -> None:
    import random

    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(docs):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, length)))}) + "\n")


def config(inputs, output, **overrides) -> BuildConfig:
    base = dict(inputs=tuple(map(str, inputs)), output=str(output), tokenizer="byte", seq_len=63,
                shard_size=4000, unit_bytes=4096, workers=1, progress=False)
    return BuildConfig(**{**base, **overrides})


def edit_keeping_size(path) -> None:
    """Swap two letters of one word in the middle of the file: same size, other content."""
    data = bytearray(path.read_bytes())
    middle = data.index(b"alpha", len(data) // 2)
    data[middle:middle + 5] = b"ahpla"
    path.write_bytes(bytes(data))


# -- 10.4: inputs are fingerprinted by content ---------------------------------------------------------
def test_input_edited_in_place_with_the_same_size_is_named_on_rerun(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, 300)
    out = tmp_path / "out"
    assert run_build(config([corpus], out)).status == "built"
    size = corpus.stat().st_size
    edit_keeping_size(corpus)
    assert corpus.stat().st_size == size
    with pytest.raises(FileExistsError, match=rf"input {corpus} changed \(content\)"):
        run_build(config([corpus], out))


def test_input_edited_before_a_resume_is_not_mixed_into_the_old_shards(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, 300)
    out = tmp_path / "out"

    def die(*args, **kwargs):
        raise KeyboardInterrupt("stopped before the manifest")

    with monkeypatch.context() as patch:  # an interrupted build: shards and checkpoint, no manifest
        patch.setattr(build_module, "write_manifest", die)
        with pytest.raises(KeyboardInterrupt):
            run_build(config([corpus], out))
    assert (out / CHECKPOINT_NAME).exists() and not (out / MANIFEST_NAME).exists()
    edit_keeping_size(corpus)
    with pytest.raises(FileExistsError, match=rf"unfinished build .*input {corpus} changed \(content\)"):
        run_build(config([corpus], out))
    # The CLI says the same in one line.
    code = main(["build", str(corpus), "--output", str(out), "--tokenizer", "byte", "--seq-len", "63",
                 "--shard-size", "4000", "--unit-size", "4096", "--workers", "1", "--no-progress"])
    assert code == 1


# -- 10.9: a JSON file that is not a tokenizer ----------------------------------------------------------
@pytest.mark.parametrize("name, content", [("vocab.json", '{"hello": 1, "world": 2}'), ("list.json", "[1, 2, 3]"),
                                           ("broken.model", "not a sentencepiece model")])
def test_a_file_that_is_not_a_tokenizer_is_one_clear_line(tmp_path, capsys, name, content):
    corpus = tmp_path / "c.jsonl"
    write_jsonl(corpus, 5)
    (tmp_path / name).write_text(content)
    code = main(["build", str(corpus), "--output", str(tmp_path / "out"), "--tokenizer", str(tmp_path / name),
                 "--seq-len", "8", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"shardkit build: error: --tokenizer {tmp_path / name}: not ") and "Traceback" not in err[0]


# -- 10.12: Ctrl-C -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_during_a_build_prints_one_line_and_exits_130(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, 6000, length=120)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "shardkit", "build", str(corpus), "--output", str(out), "--tokenizer", "byte",
               "--seq-len", "127", "--shard-size", "16KB", "--unit-size", "16KiB", "--workers", "2", "--no-progress"]
    # Its own process group, like a shell job: the terminal's Ctrl-C reaches the build and its workers.
    # SIGINT back to its default there: under a non-interactive shell's `cmd &` (how CI may run us) it is
    # inherited as ignored, and Python then never raises KeyboardInterrupt (a foreground job has it).
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if any(name.startswith("shard-") for name in os.listdir(out)) if out.exists() else False:
                break
            time.sleep(0.01)
        assert process.poll() is None, "the build finished before Ctrl-C; make the corpus larger"
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["interrupted"], stderr
    # ... and the rerun resumes from what the interrupted one finished.
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0 and "(resumed)" in rerun.stderr, rerun.stderr


# -- 10.13: --overwrite never follows links out of the output --------------------------------------------
def output_with_links_out(tmp_path):
    """An output whose `_build` and one shard name are symbolic links to precious files outside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "checkpoint.npz").write_bytes(b"precious")
    (outside / "notes.txt").write_text("precious too")
    (tmp_path / "precious-shard").write_bytes(b"precious shard")
    out = tmp_path / "out"
    out.mkdir()
    (out / "_build").symlink_to(outside, target_is_directory=True)
    (out / "shard-000000.arrow").symlink_to(tmp_path / "precious-shard")
    return out, outside


def assert_outside_intact(tmp_path, outside):
    assert sorted(p.name for p in outside.iterdir()) == ["checkpoint.npz", "notes.txt"]
    assert (outside / "checkpoint.npz").read_bytes() == b"precious"
    assert (outside / "notes.txt").read_text() == "precious too"
    assert (tmp_path / "precious-shard").read_bytes() == b"precious shard"


def test_overwrite_never_deletes_through_a_symlink_out_of_the_output(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, 200)
    out, outside = output_with_links_out(tmp_path)
    assert run_build(config([corpus], out, overwrite=True)).status == "built"
    assert_outside_intact(tmp_path, outside)
    assert (out / "_build").exists() is False and not (out / "shard-000000.arrow").is_symlink()


def test_a_linked_build_state_is_refused_without_overwrite(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, 200)
    out, outside = output_with_links_out(tmp_path)
    with pytest.raises(FileExistsError, match="_build is a symbolic link"):  # never read or written through
        run_build(config([corpus], out))
    assert_outside_intact(tmp_path, outside)


# -- 9.6: unreadable files count in the report ---------------------------------------------------------
def test_documents_in_unreadable_files_are_counted_by_their_bytes(tmp_path):
    good = tmp_path / "a.jsonl"
    write_jsonl(good, 200)
    lines = [json.dumps({"text": f"document {i} " + "word " * 30}) for i in range(2000)]
    whole = gzip.compress(("\n".join(lines) + "\n").encode())
    broken = tmp_path / "b.jsonl.gz"
    broken.write_bytes(whole[: len(whole) // 2])  # a truncated download
    unreadable = tmp_path / "c.jsonl.gz"
    unreadable.write_bytes(b"\x1f\x8b" + os.urandom(3000))  # a gzip header, then noise
    out = tmp_path / "out"
    report = run_build(config([good, broken, unreadable], out)).report
    sizes = sum(p.stat().st_size for p in (good, broken, unreadable))
    assert report["bytes"]["in"] == sizes
    assert len(report["file_errors"]) == 2
    # What was not read is counted, file by file, so bytes in = bytes read + bytes unreadable.
    unread = {e["file"]: e["unread_bytes"] for e in report["file_errors"]}
    assert unread[str(unreadable)] > 0 and 0 <= unread[str(broken)] < broken.stat().st_size
    assert report["bytes"]["unreadable"] == sum(unread.values())
    assert report["bytes"]["read"] + report["bytes"]["unreadable"] == sizes and report["bytes"]["balanced"]
    # Documents, against an independent count: the complete lines zlib recovers from the truncated file
    # are written, its cut last line is rejected; "in" (the reader's count) = written + rejected.
    import zlib

    recovered = zlib.decompressobj(31).decompress(broken.read_bytes())
    complete = recovered.count(b"\n")
    docs = report["documents"]
    assert docs["written"] == 200 + complete and docs["rejected"] == 1, docs
    assert docs["in"] == 200 + complete + 1 and docs["balanced"]
    assert "unreadable 3," in run_summary(report) or "unreadable" in run_summary(report)


def run_summary(report) -> str:
    from shardkit.tools.report import summary_table

    return summary_table(report)
