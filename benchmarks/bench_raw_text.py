"""Training straight from raw text (issue 33, item 6): the raw-text loader against the build's rate and a peer.

On a slice of ../shared/corpora/mix.jsonl.zst (--mb of decompressed JSONL, written as --files .jsonl.zst files
with an `id` per record) with the GPT-2 HF tokenizer (../shared/tokenizers/gpt2_hf_tokenizer.json), all in one
run, every rate the median of --runs runs:

1. The yardstick, the build's per-process tokenize+pack rate: the shared text layer that `shardkit build`
   runs in each worker (`shardkit.text`: `iter_units` -> `tokenize_unit` -> one `concat` packer over the whole
   stream), in this process, without the build's shard encoding and writing (which a loader does not do).
   Tokens are document tokens (EOS included, padding not).
2. The raw-text loader (`StreamingDataset(files, tokenizer=, seq_len=, pack="concat", unit_bytes=, lanes=)`
   under `StreamingDataLoader`, batch --batch) with 0 and 2 workers: document tokens delivered per second over
   lane epoch 0 (the loader is endless: the pass ends before the first batch of a lane's second epoch), from
   `iter()` on (worker start-up included; the dataset's construction, which lists the units once, is timed
   apart). The build's reader cuts the same --unit-bytes units. Skipped with a message where this checkout has
   no raw-text loader (branch `raw`).
3. Padding of online bestfit (the loader, `pack="bestfit"`: each work unit packed on its own, lane epoch 0)
   against the build's bestfit (one `bestfit` packer over the whole stream) from the same documents.
4. The peer: Hugging Face `datasets` streaming (`load_dataset("json", data_files=..., streaming=True)`, one
   `IterableDataset.map` tokenizing with the same tokenizer file and appending EOS, one batched map that
   concatenates each map batch's documents and cuts windows of seq_len + 1, the last one kept and padded as
   shardkit's `concat` does) under torchdata's `StatefulDataLoader` with 0 and 2 workers: tokens/s, and a
   resume: on a small corpus (--resume-docs documents) stop after k batches, `state_dict()`, a new dataset and
   loader, `load_state_dict()`, continue to the end; documents repeated and missing against one
   uninterrupted pass, by document id. The same resume count for the raw-text loader when it is there
   (documents found by their tokens: each lane's samples in order, cut at EOS).
5. Peak memory: each DataLoader worker's RSS high-water mark (VmHWM, polled from /proc; it counts the pages
   a forked worker shares with its parent); with 0 workers, this process's VmHWM over the pass after
   resetting it (/proc/self/clear_refs), and its growth over the RSS before the pass.
6. The trainer's data wait on CPU, raw text against the same text built (`shardkit build`, concat), at the same
   2-layer model (--trainer-seq-len, batch 4, --trainer-steps steps, one rank, no loader workers; in-process
   `build`/`train`/`close`): the wait and its share of the step from `metrics.jsonl`, median over steps 2.. (the
   first step's wait apart), median of --runs runs. `--trainer-only` measures it alone; `--trainer-steps 0`
   skips it.

Rates are wall-clock tokens/s (each loader's per worker against the build's, of the medians and as the median
of each run's ratio to that run's build pass) and tokens per CPU-second (this process plus the workers, which
on a shared machine compares the pipelines' work where wall rates mostly measure the other jobs).

Prints tables, writes JSON (--out).
    SHARDKIT_SHARED=/work/shared python benchmarks/bench_raw_text.py --mb 4 --runs 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

# One tokenizer thread per process for every side: parallelism comes from DataLoader workers.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDKIT_SHARED", REPO.parent / "shared"))
LOADER_UNIT_BYTES = 1 << 20  # the raw-text loader's default unit_bytes (RawTextSettings)


# -- the corpus slice ------------------------------------------------------------------------------------------

def corpus_records(corpus: Path, max_bytes: int | None = None, max_docs: int | None = None) -> list[dict]:
    """The first records of a JSONL .zst corpus (up to `max_bytes` of JSON lines or `max_docs` records)."""
    import zstandard

    records, size = [], 0
    with open(corpus, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
        for line in io.TextIOWrapper(reader, encoding="utf-8"):
            records.append(json.loads(line))
            size += len(line.encode())
            if (max_bytes and size >= max_bytes) or (max_docs and len(records) >= max_docs):
                break
    return records


def write_corpus(records: list[dict], directory: Path, files: int, *, marked: bool = False) -> list[Path]:
    """`records` as `files` .jsonl.zst files, record i with `"id": i` (and, `marked`, its text prefixed
    with "[doc i] " so that no two documents have the same tokens)."""
    import zstandard

    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(records) // files)
    paths = []
    for f in range(files):
        chunk = range(f * per_file, min(len(records), (f + 1) * per_file))
        lines = [json.dumps({**records[i], "id": i, "text": (f"[doc {i}] " if marked else "") + records[i]["text"]})
                 for i in chunk]
        path = directory / f"part-{f:03d}.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
        paths.append(path)
    return paths


# -- memory ----------------------------------------------------------------------------------------------------

def _status_kib(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(c) for c in fh.read().split()]
    except OSError:
        pass
    return found


class PeakMemory:
    """This process's RSS high-water mark over a block (reset on entry), and each child process's (polled)."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.workers: dict[int, dict[str, int]] = {}  # pid -> {"first_rss", "peak"} in KiB
        self.main_peak_kib: int | None = None
        self.main_before_kib = _status_kib("self", "VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> PeakMemory:
        try:  # "5" resets the peak RSS (Linux >= 4.0): VmHWM then covers this block only
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self._reset = True
        except OSError:
            self._reset = False
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def _sample(self) -> None:
        for pid in _children(os.getpid()):
            peak, rss = _status_kib(pid, "VmHWM"), _status_kib(pid, "VmRSS")
            if peak is None or rss is None:
                continue
            entry = self.workers.setdefault(pid, {"first_rss": rss, "peak": 0})
            entry["peak"] = max(entry["peak"], peak)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._reset:
            self.main_peak_kib = _status_kib("self", "VmHWM")

    def summary(self) -> dict:
        workers = [w for w in self.workers.values() if w["peak"]]
        out = {"main_peak_mib": self.main_peak_kib / 1024 if self.main_peak_kib else None,
               "main_growth_mib": ((self.main_peak_kib - self.main_before_kib) / 1024
                                   if self.main_peak_kib and self.main_before_kib else None),
               "workers": len(workers)}
        if workers:
            out["worker_peak_mib"] = max(w["peak"] for w in workers) / 1024
            out["worker_growth_mib"] = max(w["peak"] - w["first_rss"] for w in workers) / 1024
        return out


class CpuTime:
    """CPU seconds (user + system) of this process and of the child processes that ended during the block (a
    DataLoader's workers, once the iteration that started them has shut them down): on a shared machine, tokens
    per CPU-second compare pipelines where tokens per second mostly measure the other jobs."""

    def __enter__(self) -> CpuTime:
        self._began = self._now()
        return self

    @staticmethod
    def _now() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def __exit__(self, *exc) -> None:
        self.seconds = self._now() - self._began


# -- 1 and 3: the build's text layer in one process ------------------------------------------------------------

def special_ids(tokenizer: str) -> tuple[int, int]:
    """(EOS, pad) as the build and the raw-text loader choose them (`with_special_ids`, default options)."""
    from shardkit.text.documents import cached_tokenizer
    from shardkit.text.tokenizers import with_special_ids

    info = with_special_ids(cached_tokenizer(tokenizer).info)
    return info.eos_id, info.pad_id


def text_layer_pass(paths: list[Path], tokenizer: str, seq_len: int, pack: str, unit_bytes: int) -> dict:
    """One pass of the build's per-process work: read units, tokenize, pack (one packer over the stream)."""
    from shardkit.text.documents import DocumentSettings, tokenize_unit, warm_up
    from shardkit.text.inputs import expand_inputs, iter_units
    from shardkit.text.packing import make_packer

    warm_up(tokenizer)
    eos, pad = special_ids(tokenizer)
    settings = DocumentSettings(tokenizer=tokenizer, token_dtype="uint16", eos_id=eos)
    began, cpu = time.perf_counter(), time.process_time()
    packer = make_packer(pack, seq_len=seq_len, pad_id=pad, token_dtype="uint16")
    samples = 0
    for unit in iter_units(expand_inputs([str(p) for p in paths]), unit_bytes=unit_bytes):
        result = tokenize_unit(unit, settings)
        samples += packer.feed(result.tokens, result.doc_lengths, result.source, result.doc_index).num_samples
    samples += packer.finish().num_samples
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    stats = packer.stats
    return {"tokens": stats.document_tokens, "seconds": seconds, "tokens_per_s": stats.document_tokens / seconds,
            "tokens_per_cpu_s": stats.document_tokens / cpu, "samples": samples,
            "padding_tokens": stats.padding_tokens,
            "padding_fraction": stats.padding_tokens / (samples * (seq_len + 1))}


# -- 2 and 3: the raw-text loader ------------------------------------------------------------------------------

def raw_loader_missing() -> str | None:
    """Why the raw-text loader cannot be measured here, or None when it can."""
    try:
        import shardkit.loaders.sources.raw.source  # noqa: F401 - branch `raw`'s module
    except ImportError as err:
        return (f"the raw-text loader is not in this checkout ({err}); it is branch `raw`'s "
                "StreamingDataset(files, tokenizer=..., seq_len=...): merge it and run again")
    return None


def padding_per_row(batch: Mapping) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, padding tokens) of each row of a batch, from its `cu_seqlens` and `padding_segments`."""
    return row_padding(batch["tokens"].shape, batch["cu_seqlens"], batch["padding_segments"])


def row_padding(shape: tuple[int, int], cu_seqlens, padding_segments) -> tuple[np.ndarray, np.ndarray]:
    """`padding_per_row` of a batch of `shape` from its two segment arrays."""
    rows, width = shape
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    padding = np.asarray(padding_segments, dtype=np.int64)
    lengths = cu[padding + 1] - cu[padding]
    pad = np.bincount(cu[padding] // width, weights=lengths, minlength=rows).astype(np.int64)
    return np.full(rows, width, dtype=np.int64), pad


def raw_dataset(paths: list[Path], tokenizer: str, seq_len: int, pack: str, **options):
    from shardkit.loaders import StreamingDataset

    return StreamingDataset([str(p) for p in paths], tokenizer=tokenizer, seq_len=seq_len, pack=pack, **options)


def raw_batches_to_lane_end(loader, lanes: int) -> Iterable[dict]:
    """The loader's batches until every lane has started its second lane epoch (the loader is endless)."""
    moved = set()
    for batch in loader:
        yield batch
        for sample_id, epoch in zip(batch["sample_id"].tolist(), batch["lane_epoch"].tolist()):
            if epoch > 0:
                moved.add(sample_id % lanes)
        if len(moved) == lanes:
            return


def raw_loader(paths: list[Path], tokenizer: str, seq_len: int, pack: str, workers: int, batch_size: int,
               **options):
    """(the raw-text loader, its number of lanes, seconds its dataset took to build)."""
    from shardkit.loaders import StreamingDataLoader

    began = time.perf_counter()
    dataset = raw_dataset(paths, tokenizer, seq_len, pack, **options)
    construction = time.perf_counter() - began
    loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                 multiprocessing_context="fork" if workers else None)
    return loader, dataset.source.corpus.num_lanes, construction


def raw_pass(paths: list[Path], tokenizer: str, seq_len: int, workers: int, batch_size: int, *, lane_epochs: int = 1,
             **options) -> dict:
    """One timed pass of the raw-text loader (concat): document tokens delivered per second.

    The pass stops before the first batch holding a lane's epoch `lane_epochs` (its second, by default), and the
    time is taken at the batch before it: with lanes of a few units each (dealt byte-balanced), what was tokenized
    and not delivered is then at most each lane's last tokenizer call (a lane tokenizes a few documents at a time,
    up to its segment's end), a share of the pass that more lane epochs make smaller. The tokens delivered are
    counted after the timing, as a consumer's work: the build's pass counts them in its packer."""
    loader, lanes, construction = raw_loader(paths, tokenizer, seq_len, "concat", workers, batch_size, **options)
    received = []  # each batch's shape and segments: its tokens are counted after the timing (the consumer's work)
    with PeakMemory() as memory, CpuTime() as cpu:
        began = last = time.perf_counter()
        cpu_began, thread_last = time.process_time(), time.thread_time()
        batches = iter(loader)
        for batch in batches:
            if batch["lane_epoch"].numpy().max() >= lane_epochs:  # (numpy: a torch comparison costs ~10 us)
                break
            received.append((batch["tokens"].shape, batch["cu_seqlens"], batch["padding_segments"]))
            # (the thread's clock: the process's costs ~30 us a call here, more than a batch of bytes)
            last, thread_last = time.perf_counter(), time.thread_time()
        # Without workers the CPU time is taken where the wall time is, at the last batch counted: less the batch
        # past it, made on this thread. Workers' CPU time is known once they are reaped: to the end of the pass.
        tail = time.thread_time() - thread_last
        cpu_seconds = time.process_time() - cpu_began - tail
        seconds = last - began
        batches.close()  # stops and reaps the workers, so that their CPU time is counted
    delivered = sum(int(tokens.sum() - pad.sum()) for tokens, pad in (row_padding(*r) for r in received))
    cpu_seconds = cpu_seconds if workers == 0 else cpu.seconds
    return {"construction_s": construction, "seconds": seconds, "tokens": delivered,
            "tokens_per_s": delivered / seconds, "tokens_per_cpu_s": delivered / cpu_seconds, "lanes": lanes,
            "memory": memory.summary()}


def online_padding(paths: list[Path], tokenizer: str, seq_len: int, batch_size: int, **options) -> float:
    """Padding share of the samples of lane epoch 0 with `pack="bestfit"` (each unit packed on its own)."""
    loader, lanes, _ = raw_loader(paths, tokenizer, seq_len, "bestfit", 0, batch_size, **options)
    tokens = padding = 0
    for batch in raw_batches_to_lane_end(loader, lanes):
        rows, pad = padding_per_row(batch)
        first = batch["lane_epoch"].numpy() == 0
        tokens += int(rows[first].sum())
        padding += int(pad[first].sum())
    return padding / max(tokens, 1)


# -- 4: the peer, Hugging Face datasets streaming under StatefulDataLoader ------------------------------------

class HFTokenize:
    """`IterableDataset.map` function: a batch of records -> token ids with EOS (and, `with_ids`, the document
    id of every token). A class, not a closure, so that it pickles into DataLoader workers."""

    def __init__(self, tokenizer: str, with_ids: bool):
        self.path, self.with_ids = tokenizer, with_ids
        self._tokenizer = None

    def __call__(self, batch: dict) -> dict:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(self.path)
            self._eos = self._tokenizer.token_to_id("<|endoftext|>")
            # The call shardkit's HFTokenizer makes (no offsets): compare the pipelines, not two encode calls.
            self._encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        ids = [e.ids + [self._eos] for e in self._encode(batch["text"], add_special_tokens=False)]
        out = {"input_ids": ids}
        if self.with_ids:
            out["doc_ids"] = [[doc] * len(tokens) for doc, tokens in zip(batch["id"], ids)]
        return out


class HFConcatChunk:
    """Batched `map` function: concatenate the map batch's documents, cut windows of `window` tokens, keep the
    last partial one padded with `pad_id` (shardkit's `concat`, per map batch; `length` = real tokens)."""

    def __init__(self, window: int, pad_id: int):
        self.window, self.pad_id = window, pad_id

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {}
        for key, fill in (("input_ids", self.pad_id), ("doc_ids", -1)):
            if key not in batch:
                continue
            flat = np.fromiter((t for doc in batch[key] for t in doc), dtype=np.int64)
            windows = -(-len(flat) // self.window)
            padded = np.full(windows * self.window, fill, dtype=np.int64)
            padded[:len(flat)] = flat
            out[key] = padded.reshape(windows, self.window).tolist()
            out["length"] = np.minimum(self.window, len(flat) - np.arange(windows) * self.window).tolist()
        return out


def hf_collate(rows: list[dict]) -> dict:
    import torch

    return {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}


def hf_dataset(paths: list[Path], tokenizer: str, seq_len: int, *, with_ids: bool = False, shuffle_buffer: int = 0):
    from datasets import load_dataset

    _, pad = special_ids(tokenizer)
    stream = load_dataset("json", data_files=[str(p) for p in paths], split="train", streaming=True)
    if shuffle_buffer:
        stream = stream.shuffle(seed=0, buffer_size=shuffle_buffer)
    columns = ["source", "text", "id"]
    stream = stream.map(HFTokenize(tokenizer, with_ids), batched=True, remove_columns=columns)
    return stream.map(HFConcatChunk(seq_len + 1, pad), batched=True)


def hf_loader(dataset, batch_size: int, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=hf_collate)


def hf_pass(paths: list[Path], tokenizer: str, seq_len: int, workers: int, batch_size: int) -> dict:
    """One timed pass of the peer: document tokens delivered per second (dataset set-up included)."""
    with PeakMemory() as memory, CpuTime() as cpu:
        began = time.perf_counter()
        delivered = 0
        for batch in hf_loader(hf_dataset(paths, tokenizer, seq_len), batch_size, workers):
            delivered += int(batch["length"].sum())
        seconds = time.perf_counter() - began  # the workers are shut down once the pass ends
    return {"seconds": seconds, "tokens": delivered, "tokens_per_s": delivered / seconds,
            "tokens_per_cpu_s": delivered / cpu.seconds, "memory": memory.summary()}


# -- resume: documents repeated and missing (pure functions) --------------------------------------------------

def document_token_counts(doc_ids: Iterable[np.ndarray]) -> Counter:
    """Tokens delivered per document from per-token document ids (negative: padding)."""
    counts: Counter = Counter()
    for ids in doc_ids:
        ids = np.asarray(ids).ravel()
        values, n = np.unique(ids[ids >= 0], return_counts=True)
        counts.update(dict(zip(values.tolist(), n.tolist())))
    return counts


def lane_document_counts(rows: Iterable[tuple[int, np.ndarray]], lanes: int, eos_id: int,
                         documents: Mapping[tuple, int]) -> tuple[Counter, int]:
    """Tokens delivered per document from samples without document ids: `rows` are (sample id, real tokens).

    A lane's samples (sample id % lanes) joined in sample-id order and cut after each EOS give its documents,
    found by their tokens in `documents` ({tokens with EOS: id}); a sample delivered again adds its tokens to
    the documents it holds. Returns (counts, pieces matching no document, or repeats that differ)."""
    by_lane: dict[int, dict[int, np.ndarray]] = {}
    again: list[tuple[int, np.ndarray]] = []
    for sample_id, tokens in rows:
        lane = by_lane.setdefault(sample_id % lanes, {})
        if sample_id in lane:
            again.append((sample_id, np.asarray(tokens)))
        else:
            lane[sample_id] = np.asarray(tokens)
    counts: Counter = Counter()
    unmatched = 0
    where: dict[int, np.ndarray] = {}  # sample id -> the document id of each of its tokens
    for samples in by_lane.values():
        order = sorted(samples)
        stream = np.concatenate([samples[i] for i in order])
        owner = np.full(len(stream), -1, dtype=np.int64)
        ends = np.flatnonzero(stream == eos_id) + 1
        for start, end in zip(np.concatenate([[0], ends]), np.concatenate([ends, [len(stream)]])):
            if start == end:
                continue
            doc = documents.get(tuple(stream[start:end].tolist()))
            if doc is None:
                unmatched += 1
            else:
                owner[start:end] = doc
        offsets = np.cumsum([0] + [len(samples[i]) for i in order])
        where.update((i, owner[offsets[k]:offsets[k + 1]]) for k, i in enumerate(order))
        counts.update(document_token_counts([owner]))
    for sample_id, tokens in again:
        first = by_lane[sample_id % lanes][sample_id]
        if np.array_equal(first, tokens):
            counts.update(document_token_counts([where[sample_id]]))
        else:
            unmatched += 1
    return counts, unmatched


def resume_damage(reference: Mapping[int, int], resumed: Mapping[int, int]) -> dict[str, int]:
    """Documents a resumed run delivered more of (repeated) or less of (missing) than one uninterrupted pass,
    from tokens delivered per document id; a document the reference never delivered counts as repeated."""
    repeated = sum(1 for doc, n in resumed.items() if n > reference.get(doc, 0))
    missing = sum(1 for doc, n in reference.items() if resumed.get(doc, 0) < n)
    return {"documents": len(reference), "repeated": repeated, "missing": missing}


def run_with_resumes(make_loader, stops: list[int], rest=list) -> list[dict]:
    """One pass that stops after each (cumulative) batch count in `stops`, takes `state_dict()`, and goes on in
    a new loader given it by `load_state_dict()`; after the last stop, `rest(loader)` gives the remaining batches."""
    batches, state = [], None
    for stop in stops:
        loader = make_loader()
        if state is not None:
            loader.load_state_dict(state)
        iterator = iter(loader)
        batches += [next(iterator) for _ in range(stop - len(batches))]
        state = loader.state_dict()
        del iterator  # its workers stop here
    loader = make_loader()
    loader.load_state_dict(state)
    return batches + list(rest(loader))


def same_batches(reference: list[dict], resumed: list[dict], key: str) -> bool:
    """Whether a resumed pass delivered the uninterrupted pass's batches, in its order."""
    return len(reference) == len(resumed) and all(bool((a[key] == b[key]).all()) if a[key].shape == b[key].shape
                                                  else False for a, b in zip(reference, resumed))


def stops_at(fractions: list[float], batches: int) -> list[int]:
    """Increasing batch counts at `fractions` of a pass of `batches` batches (at least one batch apart)."""
    stops: list[int] = []
    for fraction in sorted(fractions):
        stop = max(int(fraction * batches), stops[-1] + 1 if stops else 1)
        if stop < batches:
            stops.append(stop)
    return stops


def hf_resume(paths: list[Path], tokenizer: str, seq_len: int, workers: int, batch_size: int,
              fractions: list[float], shuffle_buffer: int) -> dict:
    def make():
        dataset = hf_dataset(paths, tokenizer, seq_len, with_ids=True, shuffle_buffer=shuffle_buffer)
        return hf_loader(dataset, batch_size, workers)

    reference_batches = list(make())
    reference = document_token_counts(b["doc_ids"].numpy() for b in reference_batches)
    stops = stops_at(fractions, len(reference_batches))
    row = {"loader": f"HF datasets{f', shuffle buffer {shuffle_buffer}' if shuffle_buffer else ''}",
           "workers": workers, "stops": stops, "batches": len(reference_batches)}
    try:
        batches = run_with_resumes(make, stops)
    except Exception as err:  # noqa: BLE001 - the peer failing to resume is a result, not the benchmark's end
        reason = (str(err).strip().splitlines() or [""])[0]
        last = [line.strip() for line in str(err).strip().splitlines() if line.strip()][-1:] or [""]
        return {**row, "documents": len(reference), "error": f"{type(err).__name__}: {reason} ({last[0]})"}
    resumed = document_token_counts(b["doc_ids"].numpy() for b in batches)
    return {**row, "same_batches": same_batches(reference_batches, batches, "input_ids"),
            **resume_damage(reference, resumed)}


def raw_rows(batches: Iterable[dict]) -> list[tuple[int, np.ndarray]]:
    """(sample id, real tokens) of every lane-epoch-0 row."""
    out = []
    for batch in batches:
        rows, width = batch["tokens"].shape
        cu = np.asarray(batch["cu_seqlens"], dtype=np.int64)
        is_padding = np.zeros(len(cu) - 1, dtype=bool)
        is_padding[np.asarray(batch["padding_segments"], dtype=np.int64)] = True
        keep = ~np.repeat(is_padding, np.diff(cu))
        flat = batch["tokens"].numpy().reshape(-1)
        row_of = np.arange(rows * width) // width
        for row, (sample_id, epoch) in enumerate(zip(batch["sample_id"].tolist(), batch["lane_epoch"].tolist())):
            if epoch == 0:
                out.append((sample_id, flat[keep & (row_of == row)]))
    return out


def raw_resume(paths: list[Path], records: list[dict], tokenizer: str, seq_len: int, workers: int,
               batch_size: int, fractions: list[float], unit_bytes: int, lanes: int) -> dict:
    from shardkit.loaders import StreamingDataLoader
    from shardkit.text.documents import cached_tokenizer

    eos, _ = special_ids(tokenizer)
    encode = cached_tokenizer(tokenizer).encode
    documents = {tuple(encode(f"[doc {i}] " + r["text"]).tolist()) + (eos,): i for i, r in enumerate(records)}

    def make():
        dataset = raw_dataset(paths, tokenizer, seq_len, "concat", unit_bytes=unit_bytes, lanes=lanes)
        make.lanes = dataset.source.corpus.num_lanes
        return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                   multiprocessing_context="fork" if workers else None)

    def to_lane_end(loader):
        return raw_batches_to_lane_end(loader, make.lanes)

    reference_batches = list(to_lane_end(make()))
    reference, unmatched = lane_document_counts(raw_rows(reference_batches), make.lanes, eos, documents)
    stops = stops_at(fractions, len(reference_batches))
    batches = run_with_resumes(make, stops, to_lane_end)
    resumed, resumed_unmatched = lane_document_counts(raw_rows(batches), make.lanes, eos, documents)
    return {"loader": "shardkit raw-text", "workers": workers, "stops": stops, "batches": len(reference_batches),
            "same_batches": same_batches(reference_batches, batches, "tokens"),
            "unmatched_pieces": unmatched + resumed_unmatched, **resume_damage(reference, resumed)}


# -- the run ---------------------------------------------------------------------------------------------------

def trainer_run(data: dict, seq_len: int, batch: int, steps: int, run_dir: Path) -> list[dict]:
    """The step records of one in-process trainer run on CPU (one rank, no loader workers) at a tiny model."""
    from shardkit.train.config import config_from_dict
    from shardkit.train.loop import build, close, train

    values = {"steps": steps, "device": "cpu", "optimizer": {"warmup_steps": 1},
              "model": {"seq_len": seq_len, "n_layer": 2, "n_head": 2, "d_model": 64},
              "data": {**data, "batch_size": batch}, "logging": {"run_dir": str(run_dir), "tensorboard": False}}
    state = build(config_from_dict(values))
    try:
        train(state)
    finally:
        close(state)
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "data_wait_fraction" in r]


def trainer_data_wait(paths: list[Path], tokenizer: str, seq_len: int, batch: int, steps: int, runs: int,
                      work: Path) -> dict:
    """The trainer's data wait, raw text against the same text built (`shardkit build`, same tokenizer, concat),
    at the same model: per run the median over steps 2.. of the wait in ms (step 1 apart: the first batch) and
    of its share of the step; medians of `runs` runs, interleaved."""
    import subprocess

    built = work / "trainer_built"
    subprocess.run([sys.executable, "-m", "shardkit", "build", *map(str, paths), "--output", str(built),
                    "--tokenizer", tokenizer, "--seq-len", str(seq_len), "--workers", "1", "--no-progress"],
                   check=True, capture_output=True)
    sources = {"built": {"data": str(built)},
               "raw": {"data": " ".join(map(str, paths)), "tokenizer": tokenizer, "lanes": len(paths)}}
    found: dict[str, list[dict]] = {name: [] for name in sources}
    for run in range(runs):
        for name, data in sources.items():
            records = trainer_run(data, seq_len, batch, steps, work / f"trainer_{name}_{run}")
            waits = [r["data_wait_fraction"] * r["step_time_s"] * 1000 for r in records]
            found[name].append({"first_ms": waits[0], "wait_ms": statistics.median(waits[1:]),
                                "fraction": statistics.median(r["data_wait_fraction"] for r in records[1:]),
                                "step_ms": statistics.median(r["step_time_s"] * 1000 for r in records[1:])})
    return {"seq_len": seq_len, "batch": batch, "steps": steps, "runs": runs,
            **{name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} | {"per_run": rows}
               for name, rows in found.items()}}


def trainer_table(wait: dict) -> str:
    rows = [f"trainer on CPU, one rank, no loader workers, 2-layer d_model 64 model; seq_len {wait['seq_len']}, "
            f"batch {wait['batch']}, {wait['steps']} steps; medians over steps 2.. then over {wait['runs']} runs",
            "| data | data wait per step | share of the step | step | first step's wait |", "|---|---|---|---|---|"]
    for name, label in (("built", "built shards (shardkit build, concat)"), ("raw", "raw text (tokenized in the loop)")):
        entry = wait[name]
        rows.append(f"| {label} | {entry['wait_ms']:.2f} ms | {entry['fraction']:.1%} | {entry['step_ms']:.0f} ms | "
                    f"{entry['first_ms']:.0f} ms |")
    return "\n".join(rows)


def median_row(runs: list[dict]) -> dict:
    """The run with the median tokens/s (its other figures come with it), plus every run's rate."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "runs": [round(r["tokens_per_s"]) for r in runs]}


def per_worker(row: dict, runs: list[dict], build: list[dict], workers: int) -> dict:
    """`row` with its rate per worker (0 workers: the process) over the build's: of the medians, and the median
    of each run's ratio to the build's pass of the same run (the machine's load changes between runs)."""
    ratios = [r["tokens_per_s"] / max(workers, 1) / b["tokens_per_s"] for r, b in zip(runs, build)]
    cpu = (statistics.median(r["tokens_per_cpu_s"] for r in runs)
           / statistics.median(b["tokens_per_cpu_s"] for b in build))
    return {**row, "per_worker_vs_build": row["tokens_per_s"] / max(workers, 1) / median_row(build)["tokens_per_s"],
            "per_worker_vs_build_same_run": statistics.median(ratios), "per_run_ratios": ratios,
            "tokens_per_cpu_s_median": statistics.median(r["tokens_per_cpu_s"] for r in runs),
            "per_cpu_second_vs_build": cpu}


def measure(args: argparse.Namespace, work: Path) -> dict:
    tokenizer = str(args.tokenizer)
    records = corpus_records(args.corpus, max_bytes=int(args.mb * 2**20))
    paths = write_corpus(records, work / "slice", args.files)
    resume_records = records[:args.resume_docs]
    resume_paths = write_corpus(resume_records, work / "resume", args.files, marked=True)
    results: dict = {"corpus": str(args.corpus), "tokenizer": tokenizer, "mb": args.mb, "documents": len(records),
                     "files": args.files, "unit_bytes": args.unit_bytes, "lanes": args.lanes, "runs": args.runs,
                     "seq_len": args.seq_len, "batch": args.batch,
                     "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "load_average": os.getloadavg()}}
    # Imported before any timing: the first timed run would otherwise pay for them.
    import datasets  # noqa: F401
    import tokenizers  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401

    missing = raw_loader_missing()
    results["raw_loader"] = missing or "measured"
    if missing:
        print(f"raw-text loader skipped: {missing}", file=sys.stderr)
    layout = {"unit_bytes": args.unit_bytes, "lanes": args.lanes}
    build, raw, hf = [], {w: [] for w in args.workers}, {w: [] for w in args.workers}
    for run in range(args.runs):  # interleaved, so that the machine's load changes touch every column alike
        build.append(text_layer_pass(paths, tokenizer, args.seq_len, "concat", args.unit_bytes))
        for workers in args.workers:
            if not missing:
                raw[workers].append(raw_pass(paths, tokenizer, args.seq_len, workers, args.batch, **layout))
            hf[workers].append(hf_pass(paths, tokenizer, args.seq_len, workers, args.batch))
        print(f"run {run + 1}/{args.runs}: build {build[-1]['tokens_per_s'] / 1e6:.2f}M tok/s", file=sys.stderr)
    results["build"] = median_row(build)
    results["build_tokens_per_cpu_s"] = statistics.median(b["tokens_per_cpu_s"] for b in build)
    results["raw"] = {str(w): per_worker(median_row(r), r, build, w) for w, r in raw.items() if r}
    results["hf"] = {str(w): per_worker(median_row(r), r, build, w) for w, r in hf.items() if r}
    bestfit = text_layer_pass(paths, tokenizer, args.seq_len, "bestfit", args.unit_bytes)
    results["padding"] = {"build_bestfit": bestfit["padding_fraction"],
                          "build_concat": results["build"]["padding_fraction"]}
    if not missing:
        results["padding"]["online_bestfit"] = online_padding(paths, tokenizer, args.seq_len, args.batch, **layout)
        if args.unit_bytes != LOADER_UNIT_BYTES:  # and with the loader's default unit size
            results["padding"]["online_bestfit_default_units"] = online_padding(
                paths, tokenizer, args.seq_len, args.batch, unit_bytes=LOADER_UNIT_BYTES, lanes=args.lanes)
    resume = results["resume"] = {"documents": len(resume_records), "rows": []}
    for workers in args.workers:
        for buffer in (0, args.hf_shuffle_buffer):
            resume["rows"].append(hf_resume(resume_paths, tokenizer, args.seq_len, workers, args.batch,
                                            args.resume_at, buffer))
        if not missing:
            resume["rows"].append(raw_resume(resume_paths, resume_records, tokenizer, args.seq_len, workers,
                                             args.batch, args.resume_at, args.resume_unit_bytes, lanes=4))
    results["machine"]["load_average_after"] = os.getloadavg()
    return results


def _mib(value: float | None) -> str:
    return f"{value:.0f} MiB" if value is not None else "-"


def _memory(entry: dict) -> str:
    memory = entry["memory"]
    if memory.get("workers"):
        return f"{_mib(memory['worker_peak_mib'])} per worker (+{_mib(memory['worker_growth_mib'])})"
    return f"{_mib(memory['main_peak_mib'])} process (+{_mib(memory['main_growth_mib'])})"


def table(results: dict) -> str:
    build = results["build"]["tokens_per_s"]
    rows = [f"{results['documents']:,} documents, {results['mb']} MB of JSONL in {results['files']} .jsonl.zst files, "
            f"{results['build']['tokens']:,} document tokens; seq_len {results['seq_len']}, batch {results['batch']}, "
            f"units of {results['unit_bytes']:,} bytes, {results['lanes']} lanes; "
            f"medians of {results['runs']} runs (all runs in brackets)",
            "",
            "| pipeline | workers | tokens/s (runs) | per worker vs build: of the medians / median of the runs' "
            "(runs) | tokens per CPU-second (vs build) | peak RSS (growth) |",
            "|---|---|---|---|---|---|",
            f"| build's text layer, one process (iter_units -> tokenize_unit -> concat packer) | 1 | "
            f"{build / 1e6:.2f}M ({', '.join(f'{r / 1e6:.2f}' for r in results['build']['runs'])}) | 100% | "
            f"{results['build_tokens_per_cpu_s'] / 1e6:.2f}M | - |"]
    for label, key in (("shardkit raw-text loader (concat)", "raw"),
                       ("HF datasets streaming + StatefulDataLoader", "hf")):
        if not results[key]:
            rows.append(f"| {label} | - | skipped: {results['raw_loader']} | | | |")
            continue
        for workers, entry in results[key].items():
            ratios = ", ".join(f"{r:.0%}" for r in entry["per_run_ratios"])
            per_worker = f"{entry['per_worker_vs_build']:.0%} / {entry['per_worker_vs_build_same_run']:.0%} ({ratios})"
            extra = f", construction {entry['construction_s']:.2f} s" if "construction_s" in entry else ""
            rows.append(f"| {label}{extra} | {workers} | {entry['tokens_per_s'] / 1e6:.2f}M "
                        f"({', '.join(f'{r / 1e6:.2f}' for r in entry['runs'])}) | {per_worker} | "
                        f"{entry['tokens_per_cpu_s_median'] / 1e6:.2f}M ({entry['per_cpu_second_vs_build']:.0%}) | "
                        f"{_memory(entry)} |")
    padding = results["padding"]
    rows += ["", "| padding (share of sample tokens) | build's bestfit | online bestfit (loader, lane epoch 0) | "
                 "difference | build's concat |", "|---|---|---|---|---|"]
    online, built = padding.get("online_bestfit"), padding["build_bestfit"]
    online_cells = (f"{online:.2%} | {(online - built) * 100:+.2f} pp" if online is not None
                    else "skipped | -")
    rows.append(f"| seq_len {results['seq_len']}, units of {results['unit_bytes']:,} bytes | {built:.2%} | "
                f"{online_cells} | {padding['build_concat']:.2%} |")
    if "online_bestfit_default_units" in padding:
        online = padding["online_bestfit_default_units"]
        rows.append(f"| the same, the loader's units of {LOADER_UNIT_BYTES:,} bytes | {built:.2%} | {online:.2%} | "
                    f"{(online - built) * 100:+.2f} pp | |")
    resume = results["resume"]
    rows += ["", f"resume on {resume['documents']} documents: stop after k batches, state_dict, new loader, "
                 "load_state_dict (at every k, one pass), to the end; documents against one uninterrupted pass",
             "| loader | workers | stops after (of batches) | documents in the uninterrupted pass | repeated "
             "| missing | the same batches in the same order |",
             "|---|---|---|---|---|---|---|"]
    for entry in resume["rows"]:
        counts = (f"{entry['repeated']} | {entry['missing']} | {'yes' if entry['same_batches'] else 'no'}"
                  if "error" not in entry else f"resume fails: {entry['error']} | - | -")
        rows.append(f"| {entry['loader']} | {entry['workers']} | {', '.join(map(str, entry['stops']))} "
                    f"(of {entry['batches']}) | {entry['documents']} | {counts} |")
    if results["raw_loader"] != "measured":
        rows.append("| shardkit raw-text | - | skipped | | | | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=SHARED / "corpora" / "mix.jsonl.zst")
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "gpt2_hf_tokenizer.json",
                        help="an HF tokenizer.json (the peer loads it with `tokenizers`, shardkit as its spec)")
    parser.add_argument("--mb", type=float, default=3.0, help="MB of the corpus's JSONL to measure on")
    parser.add_argument("--files", type=int, default=4, help=".jsonl.zst files the slice is written as")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--unit-bytes", type=int, default=1 << 16,
                        help="work unit size, for the loader and the build's reader alike")
    parser.add_argument("--lanes", type=int, default=4,
                        help="the loader's lanes (a few units each keeps the work a pass leaves undelivered small)")
    parser.add_argument("--resume-docs", type=int, default=600, help="documents of the resume corpus")
    parser.add_argument("--resume-at", type=float, nargs="+", default=[0.3, 0.7],
                        help="where to stop, as fractions of the uninterrupted pass's batches")
    parser.add_argument("--hf-shuffle-buffer", type=int, default=256,
                        help="the peer's resume is also measured with IterableDataset.shuffle(buffer_size=this)")
    parser.add_argument("--resume-unit-bytes", type=int, default=1 << 14,
                        help="the raw-text loader's unit_bytes on the resume corpus (several units per lane)")
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "raw_text.json")
    parser.add_argument("--trainer-steps", type=int, default=12,
                        help="steps of each trainer run measuring the data wait, raw vs built (0: skip it)")
    parser.add_argument("--trainer-seq-len", type=int, default=256)
    parser.add_argument("--trainer-only", action="store_true", help="measure the trainer's data wait alone")
    args = parser.parse_args(argv)
    for path, what in ((args.corpus, "corpus"), (args.tokenizer, "tokenizer")):
        if not path.exists():
            print(f"--{what} {path} is absent: this benchmark needs the shared corpora and tokenizers "
                  "(set SHARDKIT_SHARED)", file=sys.stderr)
            return 2
    if args.runs < 1 or args.mb <= 0 or args.files < 1 or args.resume_docs < args.files:
        print("--runs and --files must be >= 1, --mb > 0, --resume-docs >= --files", file=sys.stderr)
        return 2
    # torchdata's StatefulDataLoader warns about a deprecated torch call at every construction.
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    with tempfile.TemporaryDirectory(prefix="bench_raw_text_") as work:
        results = {} if args.trainer_only else measure(args, Path(work))
        if args.trainer_steps >= 2:
            records = corpus_records(args.corpus, max_bytes=int(args.mb * 2**20))
            paths = write_corpus(records, Path(work) / "trainer", args.files)
            results["trainer_data_wait"] = trainer_data_wait(paths, str(args.tokenizer), args.trainer_seq_len, 4,
                                                             args.trainer_steps, args.runs, Path(work))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print("\n\n".join(([] if args.trainer_only else [table(results)])
                      + ([trainer_table(results["trainer_data_wait"])] if "trainer_data_wait" in results else [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
