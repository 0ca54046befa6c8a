"""Unreadable raw-text units: on_corrupt="raise" stops naming the file, "skip" cuts the unit where reading failed,
logs and counts it, agrees on it over the ranks, and resumes exactly (the cuts are in the state)."""

from __future__ import annotations

import gzip
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from resume_contract import check_elastic_resume, check_resume
from shardkit import metrics
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.sources.raw.segment_samples import SegmentSamples
from shardkit.loaders.sources.raw.unreadable import UnitCut, UnitCuts, Unreadable, settle
from test_build import config, read_samples, write_corpus
from test_raw_text import first_epoch, rows, take
from shardkit.loaders.state.envelope import decode

SETTINGS = dict(tokenizer="byte", seq_len=256, unit_bytes=4096, lanes=4)
STEPS_PAST_THE_DAMAGE = 160  # batches of 4: `damaged`'s two units are cut before half of them


def damage_zst(path, keep=0.2):
    """Cut a .zst file short: its first segments decompress, then the stream ends inside its frame (written again
    in small blocks first, so that a prefix of it decompresses)."""
    text = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
    writer = zstandard.ZstdCompressor().compressobj()
    blocks = [writer.compress(text[k:k + 512]) + writer.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
              for k in range(0, len(text), 512)]
    data = b"".join(blocks) + writer.flush()
    path.write_bytes(data[:int(len(data) * keep)])


def damage_row_group(path, group):
    """Scramble one row group's column chunk (the footer and the other row groups stay readable)."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    for k in range(start + 20, start + chunk.total_compressed_size - 5):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.fixture
def damaged(tmp_path):
    """The shared small corpus with a truncated .zst and a Parquet file whose row group 1 does not decode."""
    corpus = write_corpus(tmp_path / "in", docs=150)
    damage_zst(corpus / "c.jsonl.zst")
    texts = [f"row {i} " + "words " * (20 + i % 30) for i in range(48)]
    pq.write_table(pa.table({"text": texts}), corpus / "d.parquet", row_group_size=16, compression="zstd")
    damage_row_group(corpus / "d.parquet", 1)
    return corpus


def dataset(corpus, **overrides):
    return StreamingDataset(str(corpus), **{**SETTINGS, "on_corrupt": "skip", **overrides})


@pytest.mark.parametrize("workers", [0, 2])
def test_raise_stops_naming_the_file(damaged, workers):
    loader = StreamingDataLoader(dataset(damaged, on_corrupt="raise", lanes=1, shuffle=False), batch_size=4,
                                 num_workers=workers, multiprocessing_context="fork" if workers else None)
    with pytest.raises(OSError, match=r"c.jsonl.zst: cannot read it: read failed after \d+ complete records: "
                                      r"TruncatedInputError") as err:
        take(loader, 400)
    assert workers or "\n" not in str(err.value)  # one line (a worker's comes with its traceback)


def test_skip_logs_and_counts_each_unreadable_unit_once_and_goes_on(damaged, caplog):
    loader = StreamingDataLoader(dataset(damaged), batch_size=4)
    before = {name: metrics.value("shardkit_loader_skipped_units_total", stream=name)
              for name in ("c.jsonl.zst", "d.parquet")}
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.unreadable"):
        batches = take(loader, 150)  # every lane well into its second lane epoch
    assert {int(e) for b in batches for e in b["lane_epoch"]} >= {0, 1, 2}
    skipped = [r.getMessage() for r in caplog.records if "skipped an unreadable unit" in r.getMessage()]
    assert len(skipped) == 2 and loader.counters()["skipped_units"] == 2, skipped  # once each, though every lane epoch meets them
    zst = next(m for m in skipped if "c.jsonl.zst" in m)
    parquet = next(m for m in skipped if "d.parquet" in m)
    assert "from its segment" in zst and "TruncatedInputError" in zst  # its readable segments were read first
    assert "d.parquet row group 1 (" in parquet and "ZSTD decompression failed" in parquet
    for name in ("c.jsonl.zst", "d.parquet"):
        assert metrics.value("shardkit_loader_skipped_units_total", stream=name) - before[name] == 1
    assert len(decode(loader.state_dict())["raw_text"]["unreadable"]) == 2


def test_skipping_gives_the_builds_documents_of_a_truncated_file(tmp_path):
    """What the loader reads of a damaged corpus is what `shardkit build --on-error skip` reads: every complete
    record before the damage, the incomplete last one counted as rejected as the build counts it."""
    from shardkit.tools.build import run_build

    corpus = write_corpus(tmp_path / "in", docs=150)
    damage_zst(corpus / "c.jsonl.zst")
    (corpus / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a gz file that ends early"}\n' * 200)[:-40])
    report = run_build(config([corpus], tmp_path / "built", packing="none", seq_len=256, on_error="skip")).report
    assert len(report["file_errors"]) == 2
    _, built = read_samples(str(tmp_path / "built"))
    ds = dataset(corpus, pack="none")
    raw = first_epoch(ds)
    assert sorted(tuple(s) for s in raw) == sorted(tuple(s.tokens.tolist()) for s in built)
    assert ds.source.rejected == report["documents"]["rejected_by_reason"]
    assert ds.source.rejected["incomplete record at the end of a truncated or corrupt file"] == 2


def test_a_file_that_vanishes_is_skipped_unit_by_unit_and_the_run_goes_on(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "in", docs=150)
    reference = StreamingDataLoader(dataset(corpus), batch_size=4)
    head = take(reference, 3)
    (corpus / "a.jsonl").unlink()  # listed, partly read: its remaining byte ranges cannot be read
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.unreadable"):
        tail = take(reference, 100)
    skipped = [r.getMessage() for r in caplog.records if "skipped an unreadable unit" in r.getMessage()]
    assert skipped and all("a.jsonl bytes " in m and "FileNotFoundError" in m for m in skipped)
    assert reference.counters()["skipped_units"] == len(skipped)
    assert len(rows(head + tail)) == 4 * 103


def resumed_rows(corpus, state, steps, **overrides):
    loader = StreamingDataLoader(dataset(corpus, **overrides), batch_size=4)
    loader.load_state_dict(state)
    return rows(take(loader, steps))


def test_the_cuts_travel_in_the_state_so_a_resume_skips_the_same_units(tmp_path):
    corpus = write_corpus(tmp_path / "in", docs=150)
    plain = (corpus / "a.jsonl").read_bytes()
    loader = StreamingDataLoader(dataset(corpus, lanes=1, shuffle=False), batch_size=4)
    head = take(loader, 2)
    (corpus / "a.jsonl").unlink()
    head += take(loader, 30)  # its byte ranges after the first are cut
    state = loader.state_dict()
    reference = rows(head + take(loader, 30))
    (corpus / "a.jsonl").write_bytes(plain)  # back again: the resumed run still reads what the state says
    assert rows(head) + resumed_rows(corpus, state, 30, lanes=1, shuffle=False) == reference
    cuts = decode(state)["raw_text"]["unreadable"]
    assert cuts and all(epoch == 0 and segment == 0 for _, epoch, segment, _ in cuts)


def test_a_cut_inside_a_segment_keeps_the_samples_before_it(tmp_path):
    """A unit that failed for a reader resuming into it (it vanished after its first samples were handed out) is
    cut there: a state that says so delivers those samples of the unit and goes on with the next unit."""
    corpus = write_corpus(tmp_path / "in", docs=150)
    settings = dict(lanes=1, shuffle=False)  # one lane, its units in corpus order: unit 0 first
    ds = dataset(corpus, **settings)
    raw = ds.source.corpus
    in_unit_0 = len(list(iter(SegmentSamples(next(raw.segments(0)), raw).take, None)))
    reference = [t for _, _, t in rows(take(StreamingDataLoader(ds, batch_size=4), 20))]
    state = StreamingDataLoader(dataset(corpus, **settings), batch_size=4).state_dict()
    next(iter(state["streams"].values()))["unreadable"] = [[0, 0, 0, 3]]  # unit 0 ends after its first 3 samples
    got = [t for _, _, t in resumed_rows(corpus, state, 10, **settings)]
    assert in_unit_0 > 3 and got == reference[:3] + reference[in_unit_0:in_unit_0 + 37]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_contract_with_skipped_units(damaged, workers):
    def make_loader(rank, world_size):
        return StreamingDataLoader(dataset(damaged, rank=rank, world_size=world_size), batch_size=4,
                                   num_workers=workers, multiprocessing_context="fork" if workers else None)

    check_resume(make_loader, steps=STEPS_PAST_THE_DAMAGE // 2)
    run = make_loader(0, 1)
    take(run, STEPS_PAST_THE_DAMAGE // 2 - 1)
    assert run.counters()["skipped_units"] == 2  # saved before, between and after the cuts


def test_cuts_saved_on_one_rank_hold_on_three(damaged):
    """An elastic resume from a state that skipped units: the resumed ranks skip them where the state says (here
    under "raise", so that ranks in one process need no process group to agree: any new failure would raise)."""
    def make_loader(rank, world_size):
        policy = "skip" if world_size == 1 else "raise"
        return StreamingDataLoader(dataset(damaged, rank=rank, world_size=world_size, on_corrupt=policy),
                                   batch_size=4)

    saver = make_loader(0, 1)
    take(saver, STEPS_PAST_THE_DAMAGE // 2)
    assert saver.counters()["skipped_units"] == 2  # both units are cut before the save point
    check_elastic_resume(make_loader, before=1, after=3, steps=STEPS_PAST_THE_DAMAGE)


def found(unit, segment, within, lane_samples, *, epoch=0, lane=0):
    return Unreadable(UnitCut(unit, epoch, segment, within), lane, lane_samples, f"unit {unit}", "broken")


def test_settle_takes_the_earliest_cut_and_says_when_the_ranks_read_the_step_again():
    counts = np.array([10, 0])
    first = [found(3, 2, 0, 14)]
    second = [found(3, 1, 5, 12)]  # another rank failed earlier in the same unit
    cuts, again = settle([first, second], lane_counts=counts)
    assert [c.cut for c in cuts] == [UnitCut(3, 0, 1, 5)] and again  # the first rank read past the cut
    assert settle([second, second], lane_counts=counts) == (second, False)  # both read it with that cut
    assert settle([[], []], lane_counts=counts) == ([], False)
    assert settle([[], second], lane_counts=counts)[1]  # a rank read the step without the cut: all again
    assert settle([second], lane_counts=counts) == (second, False)  # one rank: its own cuts stand
    with pytest.raises(OSError, match="unit 3: cannot be read .* after 13 of its samples were handed out"):
        settle([[], second], lane_counts=np.array([13, 0]))


def test_cuts_end_a_unit_from_their_lane_epoch_on_and_round_trip_in_state_rows():
    cuts = UnitCuts((UnitCut(4, 1, 2, 3), UnitCut(4, 2, 0, 0), UnitCut(7, 0, 0, 0)))
    assert cuts.end(4, 0) is None and cuts.end(4, 1) == (2, 3) and cuts.end(4, 5) == (0, 0)
    assert cuts.end(7, 3) == (0, 0) and cuts.end(5, 3) is None
    assert UnitCuts.from_rows(cuts.rows()) == cuts
    with pytest.raises(ValueError, match="raw_text.unreadable"):
        UnitCuts.from_rows([[1, 2, 3]])


@pytest.mark.parametrize(("option", "value", "message"), [
    ("on_corrupt", "ignore", "on_corrupt must be one of"),
    ("skip_samples", [5, 17], "skip_samples is not supported for raw text: a raw sample id is a position"),
    ("quarantine_list", "bad.json", "quarantine_list names shards of a built dataset"),
])
def test_options_raw_text_cannot_honour_are_refused_by_name(tmp_path, option, value, message):
    corpus = write_corpus(tmp_path / "in", docs=40)
    with pytest.raises(ValueError, match=message):
        dataset(corpus, **{option: value})


def test_skipping_on_several_ranks_needs_the_loader_that_agrees(tmp_path):
    corpus = write_corpus(tmp_path / "in", docs=40)
    with pytest.raises(ValueError, match="on_corrupt='skip' on several ranks needs StreamingDataLoader"):
        iter(dataset(corpus, rank=0, world_size=2, batch_size=2))
    with pytest.raises(ValueError, match="needs an initialised torch.distributed process group"):
        take(StreamingDataLoader(dataset(corpus, rank=0, world_size=2), batch_size=2), 1)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_that_share_a_lane_agree_when_only_one_of_them_cannot_read(process_pool, workers):
    """Rank 1 alone loses a file (its own in-memory filesystem): both ranks skip the units it could not read at
    the same points, read the step again, hand out the rows a single rank gives when the file is gone, count the
    bad record of the step read twice once, and save one state."""
    from conftest import free_port
    from raw_procs import raw_rank_run

    lost = "".join(f'{{"text": "lost {i} {"b" * (40 + i % 50)}"}}\n' for i in range(60))
    good = "not json\n" + "".join(f'{{"text": "good {i} {"a" * (40 + i % 50)}"}}\n' for i in range(120))
    files = {"a_lost.jsonl": lost, "b_good.jsonl": good}  # one lane, in corpus order: the lost units come first
    settings = dict(tokenizer="byte", seq_len=64, unit_bytes=1024, lanes=1, shuffle=False, on_corrupt="skip")
    port = free_port()
    runs = process_pool.run(raw_rank_run, [
        dict(inputs="memory://agree", settings=settings, batch_size=3, rank=r, world_size=2, port=port, steps=40,
             files=files, remove=["a_lost.jsonl"] if r == 1 else [], workers=workers) for r in range(2)])
    assert runs[0]["state"] == runs[1]["state"] and decode(runs[0]["state"])["raw_text"]["unreadable"]
    assert runs[0]["skipped"] == runs[1]["skipped"] >= 1
    reference = process_pool.run(raw_rank_run, [
        dict(inputs="memory://agree", settings=settings, batch_size=6, rank=0, world_size=1, port=free_port(),
             steps=40, files=files, remove=["a_lost.jsonl"])])[0]
    both = [row for step in range(40) for rank in (0, 1) for row in runs[rank]["rows"][3 * step:3 * step + 3]]
    assert both == reference["rows"]
    assert runs[0]["rejected"] == runs[1]["rejected"] == reference["rejected"] == {"malformed JSON": 1}


def test_a_parquet_file_with_an_unreadable_footer_is_one_unit_that_raises_or_is_skipped(tmp_path, caplog):
    """A footer that cannot be read fails the file's one unit, not the listing: under skip the loader reads what
    `shardkit build --on-error skip` reads; under raise the lane that reaches it stops naming the file."""
    from shardkit.tools.build import run_build

    corpus = write_corpus(tmp_path / "in", docs=150)
    texts = [f"row {i} " + "words " * (20 + i % 30) for i in range(48)]
    pq.write_table(pa.table({"text": texts}), corpus / "d.parquet", row_group_size=16)
    data = (corpus / "d.parquet").read_bytes()
    (corpus / "d.parquet").write_bytes(data[:-8] + b"\0" * 8)  # the footer's length and magic
    report = run_build(config([corpus], tmp_path / "built", packing="none", seq_len=256, on_error="skip")).report
    assert [e["file"] for e in report["file_errors"]] == [str(corpus / "d.parquet")]
    _, built = read_samples(str(tmp_path / "built"))
    with caplog.at_level(logging.WARNING, logger="shardkit.loaders.sources.raw.unreadable"):
        raw = first_epoch(dataset(corpus, pack="none"))
    assert sorted(tuple(s) for s in raw) == sorted(tuple(s.tokens.tolist()) for s in built)
    skipped = [r.getMessage() for r in caplog.records if "skipped an unreadable unit" in r.getMessage()]
    assert len(skipped) == 1 and "d.parquet" in skipped[0] and "Parquet footer" in skipped[0], skipped
    loader = StreamingDataLoader(dataset(corpus, on_corrupt="raise", lanes=1, shuffle=False), batch_size=4)
    with pytest.raises(OSError, match=r"d.parquet: cannot read it: cannot read its Parquet footer: ") as err:
        take(loader, 400)
    assert "change or vanish" not in str(err.value)
