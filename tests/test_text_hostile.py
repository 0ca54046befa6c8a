"""The text layer under hostile input, through the real `shardkit build` and the real raw-text loader (issue 45,
items 1-3): records Python cannot decode, a paragraph without end, Windows line ends."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter

import pytest

from conftest import REPO, shared_path
from shardkit.cli import main
from shardkit.text.inputs import expand_inputs, iter_units
from test_build import documents_from_samples, read_samples


@pytest.fixture(scope="module")
def tokenizer() -> str:
    return str(shared_path("tokenizers/gpt2_hf_tokenizer.json"))


def build(inputs, output, tokenizer, *options) -> dict:
    """`shardkit build` (its CLI entry, in this process); the build report."""
    code = main(["build", *map(str, inputs), "--output", str(output), "--tokenizer", tokenizer, "--seq-len", "64",
                 "--workers", "1", "--no-progress", *options])
    assert code == 0
    return json.loads((output / "build_report.json").read_text())


def first_lane_epoch(dataset, reasons) -> tuple[list[list[int]], dict[str, float]]:
    """The real tokens of every sample the raw loader delivers in lane epoch 0 of a one-lane corpus, and the
    documents it rejected meanwhile by reason (`reasons`, and "all"), as it publishes them."""
    from shardkit import metrics
    from shardkit.loaders import StreamingDataLoader
    from shardkit.loaders.sources.documents import dense_segment_ids

    def rejected() -> dict[str, float]:
        name = "shardkit_loader_documents_rejected_total"
        return {"all": metrics.value(name), **{reason: metrics.value(name, reason=reason) for reason in reasons}}

    before, samples = rejected(), []
    batches = iter(StreamingDataLoader(dataset, batch_size=4))
    for batch in batches:
        segments = dense_segment_ids(batch["cu_seqlens"], batch["padding_segments"], *batch["tokens"].shape)
        for epoch, tokens, segment in zip(batch["lane_epoch"].tolist(), batch["tokens"], segments):
            if epoch == 0:
                samples.append(tokens[segment >= 0].tolist())
        if epoch > 0:
            break
    del batches  # the loader publishes its counts as it stops
    return samples, {reason: count - before[reason] for reason, count in rejected().items()}


def good_line(i: int) -> bytes:
    return json.dumps({"text": f"document {i}: " + "ordinary words " * 8}).encode() + b"\n"


# Valid or nearly valid JSON that Python's decoders refuse: reason category expected (None: accepted by orjson,
# past json's recursion limit without it; either way a record, never an error).
UNDECODABLE = [
    (b'{"text": "a long number elsewhere", "n": ' + b"9" * 5000 + b"}", "undecodable JSON"),
    (b'{"text": ' + b"1" * 5000 + b"}", "undecodable JSON"),
    (b'{"text": "deep", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"text": "lone \\udc80 surrogate"}', "'text' holds a lone surrogate"),
    (b'{"text": "bad \xff byte"}', "invalid UTF-8"),
]


def test_a_record_python_cannot_decode_is_a_rejected_record_in_the_build_and_the_loader(tmp_path, tokenizer,
                                                                                       caplog, figures):
    """Item 1: a 5,000-digit integer (past Python's int conversion limit) ended the raw loader in a traceback and
    the build with an error naming no file or line. Every such record is rejected, counted by reason and named
    by its file and line (the build) or the byte offset of its line (the loader), the same in both."""
    from shardkit.loaders import StreamingDataset

    path = tmp_path / "hostile.jsonl"
    lines = [good_line(i) for i in range(30)]
    hostile_at = {}  # line index -> expected reason category
    for line, category in UNDECODABLE:
        hostile_at[len(lines)] = category
        lines += [line + b"\n", good_line(len(lines))]
    lines += [good_line(100 + i) for i in range(30)]
    path.write_bytes(b"".join(lines))

    report = build([path], tmp_path / "built", tokenizer)
    documents = report["documents"]
    expected = Counter(c for c in hostile_at.values() if c is not None)
    optional = sum(c is None for c in hostile_at.values())
    assert expected.items() <= documents["rejected_by_reason"].items(), documents["rejected_by_reason"]
    assert documents["rejected"] - expected.total() in range(optional + 1) and documents["balanced"]
    named = {example["line"] - 1: example["reason"] for example in documents["examples"]}
    assert {i for i, c in hostile_at.items() if c} <= set(named) <= set(hostile_at)
    assert all(example["file"] == str(path) for example in documents["examples"])

    dataset = StreamingDataset(str(path), tokenizer=tokenizer, seq_len=64, lanes=1)
    with caplog.at_level(logging.WARNING):
        samples, rejected = first_lane_epoch(dataset, documents["rejected_by_reason"])
    assert samples and rejected == {"all": documents["rejected"], **documents["rejected_by_reason"]}
    starts = [sum(map(len, lines[:i])) for i in range(len(lines))]
    logged = {r.getMessage().split(": rejected a document: ")[0] for r in caplog.records
              if "rejected a document" in r.getMessage()}
    assert logged == {f"{path} byte offset {starts[i]}" for i in named}
    figures.add("text_record_undecodable", runs=1, records=len(lines), build_rejected=documents["rejected"],
                loader_rejected=rejected["all"], loader_samples=len(samples))


PEAK_RSS = """
import json, resource, sys
from pathlib import Path

sys.path.insert(0, {tests!r})
from test_text_hostile import build, first_lane_epoch

path, tokenizer, out = sys.argv[1:4]
if sys.argv[4] == "build":
    rejected = build([path], Path(out), tokenizer, "--txt-mode", "paragraph", "--max-doc-chars", "100000",
                     "--pack", "none")["documents"]["rejected_by_reason"]
    documents = None
else:
    from shardkit.loaders import StreamingDataset

    dataset = StreamingDataset(path, tokenizer=tokenizer, seq_len=64, lanes=1, txt_mode="paragraph",
                               pack="none", max_doc_chars=100_000)
    samples, counted = first_lane_epoch(dataset, ["enormous document", "paragraph is longer than 400000 bytes"])
    documents, rejected = len(samples), {{reason: count for reason, count in counted.items() if count}}
    rejected.pop("all")
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({{"peak_kib": peak, "rejected": rejected, "samples": documents}}))
"""


def peak_rss(path, tokenizer, out, side: str) -> dict:
    """Peak resident size (KiB) of a fresh interpreter that builds `path` or reads it with the raw loader."""
    script = PEAK_RSS.format(tests=str(REPO / "tests"))
    done = subprocess.run([sys.executable, "-c", script, str(path), tokenizer, str(out), side], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def paragraphs(count: int) -> bytes:
    return b"".join(b"paragraph %d of ordinary words\nand its second line\n\n" % i for i in range(count))


@pytest.mark.slow
def test_an_endless_paragraph_is_rejected_at_the_read_bound_without_being_held(tmp_path, tokenizer, figures):
    """Item 2: a .txt read by paragraphs held a paragraph whole however long (a 200 MB one: +668 MB peak), where
    the same bytes as a JSONL line are dropped at the read bound. A paragraph past the bound for plain text (4 bytes
    a character of --max-doc-chars, as a whole .txt file) is rejected while it is read, counted by the build and
    the loader alike, and the paragraphs after it are read; peak memory does not grow with it."""
    endless = 64 << 20
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    small.write_bytes(paragraphs(20) + b"no blank line in this one " * 4000 + b"\n\n" + paragraphs(20))
    with open(big, "wb") as fh:
        fh.write(paragraphs(20))
        line = b"no blank line in this one " * 40 + b"\n"
        for _ in range(endless // len(line)):
            fh.write(line)
        fh.write(b"\r\n" + paragraphs(20))
    figures_by_side = {}
    for side in ("build", "loader"):
        base = peak_rss(small, tokenizer, tmp_path / f"{side}-small", side)
        peak = peak_rss(big, tokenizer, tmp_path / f"{side}-big", side)
        grown_mib = (peak["peak_kib"] - base["peak_kib"]) / 1024
        # Held whole, the paragraph costs 2-3 copies of its 64 MiB; bounded, a few units of 1-2 MiB at most.
        assert grown_mib < 24, f"{side}: peak grew {grown_mib:.0f} MiB reading a {endless >> 20} MiB paragraph"
        reason = "paragraph is longer than 400000 bytes"  # 4 x --max-doc-chars
        assert base["rejected"] == {"enormous document": 1} and peak["rejected"] == {reason: 1}, (base, peak)
        assert peak["samples"] == base["samples"]  # the 40 paragraphs around it, in either file
        figures_by_side[f"{side}_peak_growth_mib"] = round(grown_mib, 1)
    figures.add("text_paragraph_read_bound", runs=2, paragraph_mib=endless >> 20, **figures_by_side)


def test_windows_and_mixed_line_ends_split_paragraphs_alike(tmp_path, tokenizer, figures):
    """Item 3: `\\r\\n\\r\\n` was never a paragraph break where units are cut, so a CRLF .txt was one unit (one
    segment that a loader's resume reads and tokenizes whole), and each paragraph kept its last `\\r`. Now LF,
    CRLF and mixed files give the same paragraphs, the same built tokens and the same loader documents, in
    units of about unit_bytes alike."""
    from shardkit.loaders import StreamingDataset

    texts = [f"paragraph {i}: " + "some words " * (1 + i % 17) for i in range(300)]
    breaks = {"lf": ["\n\n"], "crlf": ["\r\n\r\n"], "mixed": ["\r\n\n", "\n\r\n", "\r\n \r\n", "\n\n\n", "\r\n\r\n"]}
    files = {}
    for name, separators in breaks.items():
        files[name] = tmp_path / f"{name}.txt"
        body = "".join(t + separators[i % len(separators)] for i, t in enumerate(texts))
        files[name].write_bytes(body.encode())

    built, loaded, units = {}, {}, {}
    for name, path in files.items():
        report = build([path], tmp_path / f"built-{name}", tokenizer, "--txt-mode", "paragraph", "--pack", "none")
        assert report["documents"]["written"] == len(texts)
        built[name] = documents_from_samples(read_samples(str(tmp_path / f"built-{name}"))[1])
        dataset = StreamingDataset(str(path), tokenizer=tokenizer, seq_len=64, lanes=1, txt_mode="paragraph",
                                   pack="none", unit_bytes=4096)
        loaded[name] = sorted(first_lane_epoch(dataset, ())[0])
        payloads = [len(u.payload) for u in iter_units(expand_inputs([str(path)]), txt_mode="paragraph",
                                                        unit_bytes=4096)]
        units[name] = (len(payloads), max(payloads))
    assert built["crlf"] == built["lf"] == built["mixed"]
    assert len(loaded["lf"]) == len(texts) and loaded["crlf"] == loaded["lf"] == loaded["mixed"]
    longest = max(len(t) for t in texts) + 8
    for name, (count, largest) in units.items():
        assert count >= files[name].stat().st_size // 4096 and largest <= 4096 + longest, (name, units)
    figures.add("text_paragraph_line_ends", runs=3, paragraphs=len(texts),
                **{f"{name}_units": count for name, (count, _) in units.items()})


def test_without_orjson_each_undecodable_record_is_a_rejection_not_an_error(monkeypatch):
    """The standard parser raises RecursionError (orjson a ValueError) on JSON nested past its limit: without
    orjson installed (a README venv has none) that ended the build's worker. With the standard parser alone every
    line of UNDECODABLE is a rejection, the deep one (which orjson accepts) as nested too deeply."""
    from shardkit.text import documents

    monkeypatch.setattr(documents, "_fast_loads", json.loads)
    for line, category in UNDECODABLE:
        if category == "invalid UTF-8":
            continue  # rejected before any JSON parser sees the line
        parsed = documents._parse_json_line(line.decode("utf-8"), "text")
        assert isinstance(parsed, documents._Reject) and (category or "nested too deeply") in parsed, (category, parsed)
