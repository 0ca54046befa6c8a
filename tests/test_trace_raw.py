"""`shardkit trace RUN_DIR --step N` on runs that trained on raw text: each logged sample is read again from its
lane, and its segments name the input file and document the loader packed, with the tokens it gave the trainer."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import zstandard

from shardkit.cli import main
from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset
from shardkit.text.tokenizers import load_tokenizer
from test_build import read_samples, write_corpus
from test_raw_mixture import data, tokenizer  # noqa: F401  (fixtures)
from test_raw_text import take
from test_train_raw import run
from train_runs import sample_ids

SEQ_LEN = 64


def traced(capsys, run_dir, step, *extra) -> dict:
    code = main(["trace", str(run_dir), "--step", str(step), "--json", *map(str, extra)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def documents(path: Path) -> list[str]:
    """The lines of a JSONL input (plain, .gz or .zst), as the loader numbers documents."""
    raw = path.read_bytes()
    raw = gzip.decompress(raw) if path.suffix == ".gz" else \
        zstandard.ZstdDecompressor().stream_reader(raw).read() if path.suffix == ".zst" else raw
    return raw.decode("utf-8", errors="replace").splitlines()


def loader_rows(loader, steps) -> dict[int, np.ndarray]:
    """sample id -> tokens of the first `steps` batches."""
    return {int(i): t.numpy() for batch in take(loader, steps) for i, t in zip(batch["sample_id"], batch["tokens"])}


def check_samples(result, rows, decode):
    """Every traced sample is the loader's: its segments tile its tokens and hold their text; a raw segment's text
    is part of the document it names."""
    for sample in result["samples"]:
        tokens = rows[sample["sample_id"]]
        segments = sample["segments"]
        assert [s["start"] for s in segments][0] == 0 and segments[-1]["end"] == len(tokens) == SEQ_LEN + 1
        assert all(a["end"] == b["start"] for a, b in zip(segments, segments[1:]))
        for segment in segments:
            assert segment["text"] == decode(tokens[segment["start"]:segment["end"]].tolist())
            if "lane" in sample and segment["source"] >= 0:
                line = documents(Path(segment["source_name"]))[segment["doc"]]
                text = segment["text"].replace("\ufffd", "").replace("<|endoftext|>", "")  # EOS, as each decodes it
                assert text in json.loads(line)["text"], segment


@pytest.fixture
def raw_run(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", docs=60)
    run(corpus, tmp_path / "run", 3)
    return corpus, tmp_path / "run"


def test_a_raw_text_runs_steps_are_traced_to_their_files_and_documents(raw_run, capsys):
    corpus, run_dir = raw_run
    byte = load_tokenizer("byte")
    # The trainer's loader (the run's options: byte tokenizer, 3 lanes, seed 0, shuffled), read again here.
    dataset = StreamingDataset(f"{corpus}/*.jsonl*", tokenizer="byte", seq_len=SEQ_LEN, lanes=3)
    rows = loader_rows(StreamingDataLoader(dataset, batch_size=4), 3)
    logged = sample_ids(run_dir)
    for step in (1, 3):
        result = traced(capsys, run_dir, step, "--text")
        assert sorted(s["sample_id"] for s in result["samples"]) == logged[step]
        assert {s["lane"] for s in result["samples"]} == {0, 1, 2}  # each position's lane: p % 3
        assert {s["dataset"] for s in result["samples"]} == {f"{corpus}/*.jsonl*"}  # the run's --data
        check_samples(result, rows, lambda ids: byte.decode(ids))
    text = main(["trace", str(run_dir), "--step", "2"])
    assert text == 0 and "lane 1 #" in capsys.readouterr().out


def test_raw_text_changed_since_the_run_is_refused_by_name(raw_run, capsys):
    corpus, run_dir = raw_run
    with open(corpus / "a.jsonl", "a") as handle:
        handle.write(json.dumps({"text": "a document added after the run"}) + "\n")
    assert main(["trace", str(run_dir), "--step", "1"]) == 2
    err = capsys.readouterr().err
    assert "is not what run" in err and "read at step 1" in err and "--data" in err


def test_a_raw_mixtures_steps_are_traced_across_a_weight_change(data, tokenizer, tmp_path, capsys):  # noqa: F811
    decoder = load_tokenizer(tokenizer)
    before = {"data": f"{data['built']}:0.5 {data['a']}/*.jsonl*:0.5", "tokenizer": tokenizer, "lanes": 2,
              "batch_size": 4}
    after = {**before, "data": f"{data['built']}:0.2 {data['a']}/*.jsonl*:0.8", "allow_mixture_change": True}
    run(None, tmp_path / "run", 2, data=before)
    run(None, tmp_path / "run", 4, data=after)
    capsys.readouterr()  # the runs' output

    def mixture(weights):
        return StreamingDataset([Stream(data["built"], weights[0]), Stream(f"{data['a']}/*.jsonl*", weights[1],
                                                                          raw_text=True)],
                                tokenizer=tokenizer, seq_len=SEQ_LEN, lanes=2)

    first = StreamingDataLoader(mixture((0.5, 0.5)), batch_size=4)
    rows = loader_rows(first, 2)
    changed = StreamingDataLoader(mixture((0.2, 0.8)), batch_size=4)
    changed.load_state_dict(first.state_dict(), allow_mixture_change=True)
    rows.update(loader_rows(changed, 2))
    built = len(read_samples(data["built"])[1])
    kinds = set()
    for step in (1, 2, 3, 4):
        result = traced(capsys, tmp_path / "run", step, "--text")
        assert sorted(s["sample_id"] for s in result["samples"]) == sample_ids(tmp_path / "run")[step]
        check_samples(result, rows, decoder.decode)
        for sample in result["samples"]:
            kinds.add("lane" in sample)
            assert sample["dataset"].rstrip("/") in (data["built"], f"{data['a']}/*.jsonl*")
            assert ("shard" in sample) == (sample["sample_id"] < built)
    assert kinds == {True, False}  # raw and built samples both traced


def test_a_file_given_where_a_dataset_belongs_is_named_as_such(raw_run, capsys):
    corpus, _ = raw_run
    for argv in (["inspect", corpus / "a.jsonl"], ["trace", corpus / "a.jsonl", "--source", "a.jsonl", "--doc", "1"]):
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert f"no dataset at {corpus / 'a.jsonl'}: it is a file" in err and "--tokenizer" in err, err


def test_a_step_is_read_again_from_the_newest_checkpoint_before_it(tmp_path, capsys):
    """The lanes are read again from the loader state of the run's newest checkpoint before the step (cursors and
    cuts), not from their start: the same samples, fewer lane samples packed."""
    import shutil

    corpus = write_corpus(tmp_path / "corpus", docs=60)
    run_dir = tmp_path / "run"
    run(corpus, run_dir, 6, checkpoint_every=2)
    capsys.readouterr()
    from_checkpoint = traced(capsys, run_dir, 5, "--text")
    assert from_checkpoint["replayed"]["from_checkpoint_step"] == 4
    shutil.move(run_dir / "checkpoints", tmp_path / "elsewhere")
    from_start = traced(capsys, run_dir, 5, "--text")
    assert from_start["replayed"]["from_checkpoint_step"] is None
    assert from_checkpoint["samples"] == from_start["samples"]
    # 4 steps x 4 samples over 3 lanes were read before the checkpoint: the replay from the start packs them too.
    assert from_start["replayed"]["lane_samples_read"] - from_checkpoint["replayed"]["lane_samples_read"] == 16


def test_a_raw_mixtures_steps_are_traced_across_a_change_of_streams(data, tokenizer, tmp_path, capsys):  # noqa: F811
    """Built + A for 2 steps, then A + B (built removed, B added) for 2: each step is traced with the streams then
    in force (samples/streams.jsonl), the changed mixture's lanes seeded and numbered from the checkpoint it was
    changed at; without that checkpoint, the steps after the change are refused by name."""
    import shutil

    decoder = load_tokenizer(tokenizer)
    first = {"data": f"{data['built']}:0.5 {data['a']}/*.jsonl*:0.5", "tokenizer": tokenizer, "lanes": 2,
             "batch_size": 4}
    second = {**first, "data": f"{data['a']}/*.jsonl*:0.6 {data['b']}/*.jsonl*:0.4", "allow_mixture_change": True}
    run(None, tmp_path / "run", 2, data=first, checkpoint_every=1, keep=10)
    run(None, tmp_path / "run", 4, data=second, checkpoint_every=1, keep=10)
    capsys.readouterr()

    def mixture(sources):
        return StreamingDataset([Stream(url, weight, raw_text=raw) for url, weight, raw in sources],
                                tokenizer=tokenizer, seq_len=SEQ_LEN, lanes=2)

    before = StreamingDataLoader(mixture([(data["built"], 0.5, False), (f"{data['a']}/*.jsonl*", 0.5, True)]),
                                 batch_size=4)
    rows = {1: loader_rows(before, 2)}
    after = StreamingDataLoader(mixture([(f"{data['a']}/*.jsonl*", 0.6, True), (f"{data['b']}/*.jsonl*", 0.4, True)]),
                                batch_size=4)
    after.load_state_dict(before.state_dict(), allow_mixture_change=True)
    rows[3] = loader_rows(after, 2)
    logged = sample_ids(tmp_path / "run")
    for step in (1, 2, 3, 4):
        result = traced(capsys, tmp_path / "run", step, "--text")
        assert sorted(s["sample_id"] for s in result["samples"]) == logged[step]
        check_samples(result, rows[1 if step <= 2 else 3], decoder.decode)
        names = {s["dataset"].rstrip("/").rsplit("/", 2)[-2 if "*" in s["dataset"] else -1] for s in result["samples"]}
        assert names <= ({"built", "a"} if step <= 2 else {"a", "b"}), names
        assert result["replayed"]["from_checkpoint_step"] == (step - 1 or None)
    shutil.move(tmp_path / "run" / "checkpoints", tmp_path / "elsewhere")
    assert main(["trace", str(tmp_path / "run"), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert "changed to at step 2" in err and "needs a checkpoint saved from step 2 on and before step 3" in err, err
    assert traced(capsys, tmp_path / "run", 2)["replayed"]["from_checkpoint_step"] is None  # the first mixture's
