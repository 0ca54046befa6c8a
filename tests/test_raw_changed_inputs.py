"""Raw-text inputs that change after the loader listed them (issue 45, item 6): a file cut, appended to or replaced
by another of the same size is noticed at read, a one-line OSError naming the file (or skipped and counted under
on_corrupt="skip"), never read short or past its listed end in silence; and what the listing saw is plain data
on the corpus (name relative to the INPUT's root, size, change marker)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from shardkit.loaders import StreamingDataLoader, StreamingDataset
from test_raw_text import rows, take

SETTINGS = dict(tokenizer="byte", seq_len=256, unit_bytes=8192, lanes=4)
LINES = [json.dumps({"text": f"document {i} " + "word " * (150 + i % 40)}) + "\n" for i in range(240)]


def write_inputs(root):
    """a.jsonl (many byte-range units, in a subdirectory) and b.jsonl (a few): 1 + 4 lanes' worth."""
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.jsonl").write_text("".join(LINES))
    (root / "b.jsonl").write_text("".join(LINES[:60]))
    return root


def read_all(loader, steps=400):
    """Every batch of `steps` steps (a few lane epochs of this corpus)."""
    return take(loader, steps)


def cut_to_a_third(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 3])


def append_lines(path):
    with path.open("a") as out:
        out.writelines(LINES[:20])


def replace_same_size(path):
    data = path.read_bytes()
    stat = path.stat()
    path.write_bytes(data.replace(b"word", b"WORD"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))  # as a copy a moment later would


CHANGES = {"cut": cut_to_a_third, "grown": append_lines, "same size": replace_same_size}


@pytest.mark.parametrize("change", CHANGES)
def test_a_file_changed_after_listing_is_one_oserror_naming_it(tmp_path, change):
    root = write_inputs(tmp_path / "in")
    loader = StreamingDataLoader(StreamingDataset(str(root), **SETTINGS), batch_size=4)
    CHANGES[change](root / "sub" / "a.jsonl")
    with pytest.raises(OSError) as caught:
        read_all(loader)
    message = str(caught.value)
    assert message.startswith(f"{root / 'sub' / 'a.jsonl'}: cannot read it: ") and "\n" not in message
    assert "changed since it was listed" in message
    assert ("same size, but mtime:" if change == "same size" else "bytes when listed") in message


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_counts_the_changed_files_units_and_reads_the_others(tmp_path, workers, caplog):
    root = write_inputs(tmp_path / "in")
    # One lane: the units of both files in one stream, so that skipping a.jsonl's leaves b.jsonl's to read.
    dataset = StreamingDataset(str(root), **{**SETTINGS, "lanes": 1}, on_corrupt="skip")
    loader = StreamingDataLoader(dataset, batch_size=4, num_workers=workers)
    units_of_a = sum(1 for source in dataset.source.corpus.units.source if source == 1)
    cut_to_a_third(root / "sub" / "a.jsonl")
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.unreadable"):
        batches = read_all(loader, 80)  # past lane epoch 0 (b.jsonl alone is ~55 steps)
    skipped = [r.getMessage() for r in caplog.records if "skipped an unreadable unit" in r.getMessage()]
    assert len(skipped) == units_of_a == loader.counters()["skipped_units"]  # each once, at its first reading
    assert all("a.jsonl bytes " in m and "changed since it was listed" in m for m in skipped)
    # Nothing of a.jsonl is read, not even its first third still there: every row is b.jsonl's text (its
    # documents 0-59, the byte tokenizer's ids below 256 being the text's bytes).
    text = b"".join(bytes(t for t in tokens if t < 256) for _, _, tokens in rows(batches)).decode()
    numbers = {int(part.split()[0]) for part in text.split("document ")[1:] if part[:1].isdigit()}
    assert numbers and max(numbers) < 60


def test_the_listing_is_plain_data_relative_to_the_inputs_root(tmp_path):
    root = write_inputs(tmp_path / "in")
    for inputs, names in ((str(root), ["b.jsonl", "sub/a.jsonl"]), (str(root / "sub" / "*.jsonl"), ["a.jsonl"]),
                          ([str(root / "b.jsonl"), str(root / "sub")], ["b.jsonl", "a.jsonl"])):
        listing = StreamingDataset(inputs, **SETTINGS).source.corpus.listing
        assert [f["name"] for f in listing] == names
        for entry in listing:
            path = root / "sub" / "a.jsonl" if entry["name"].endswith("a.jsonl") else root / "b.jsonl"
            assert entry["size"] == path.stat().st_size
            assert entry["change_marker"] == f"mtime:{path.stat().st_mtime}"
        json.dumps(listing)  # plain data


def test_an_object_replaced_by_another_of_the_same_size_is_noticed_by_its_etag(s3_bucket):
    import s3fs

    prefix, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    fs.pipe(f"{prefix}/sub/a.jsonl", "".join(LINES).encode())
    fs.pipe(f"{prefix}/b.jsonl", "".join(LINES[:60]).encode())
    dataset = StreamingDataset(prefix, **SETTINGS, storage_options=options)
    listing = dataset.source.corpus.listing
    assert [f["name"] for f in listing] == ["b.jsonl", "sub/a.jsonl"]
    assert all(f["change_marker"].startswith("etag:") for f in listing)
    loader = StreamingDataLoader(dataset, batch_size=4)
    fs.pipe(f"{prefix}/sub/a.jsonl", "".join(LINES).replace("word", "WORD").encode())
    with pytest.raises(OSError, match=r"sub/a.jsonl: cannot read it: .*changed since it was listed \(same size, "
                                      r"but etag:\w+ when listed, etag:\w+ now\)"):
        read_all(loader)
