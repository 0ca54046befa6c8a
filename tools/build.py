"""`run_build`: inputs -> work units -> parallel tokenization -> ordered packing -> shards -> manifest.

The parent reads the inputs and cuts them into work units (`inputs`), workers tokenize units in
parallel (`executors`, `documents`), and the parent consumes the results strictly in unit order,
packs them (`packing`) and writes shards (`ShardWriter`). The sample stream therefore depends only on
the inputs and the configuration, never on the worker count or the executor. After every shard the
resume checkpoint is rewritten (`state`); the build report and then the manifest are written last.

A build is four steps over one `BuildRun`: `prepare` (resolve the configuration, decide fresh /
resume / done, restore a checkpoint), `emit` (tokenize, pack and write, with a `snapshot` of the
resume state before each unit), and `finish` (report, manifest, remove the state).
"""

from __future__ import annotations

import copy
import logging
from collections import deque
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shardkit import metrics
from shardkit.formats import ShardArrays, ShardWriter
from shardkit.manifest import Manifest, ShardInfo, TokenizerInfo, load_manifest, token_dtype_for_vocab, write_manifest
from shardkit.process_info import available_cores
from shardkit.storage import Storage
from shardkit.text.documents import DocumentSettings, UnitResult, record_label, tokenize_unit, warm_up
from shardkit.text.documents import cached_tokenizer as worker_tokenizer
from shardkit.text.inputs import InputFile, WorkUnit, expand_inputs, iter_units
from shardkit.text.packing import Packer, make_packer
from shardkit.text.tokenizers import with_special_ids

from . import state as build_state
from .config import BuildConfig, build_record, parse_compression, parse_size, resume_key
from .encode_threads import choose_encode_threads
from .executors import make_executor
from .report import BuildStats, Progress, report_json, summary_table

__all__ = ["BuildConfig", "BuildInputError", "BuildResult", "InputSide", "parse_compression", "parse_size",
           "print_summary", "run_build", "run_pipeline"]

logger = logging.getLogger(__name__)


class BuildInputError(ValueError):
    """A bad document or unreadable file under `--on-error fail`."""


@dataclass(frozen=True)
class BuildResult:
    """What `run_build` did: "built", "resumed" or "done" (the output already held this build)."""

    status: str
    manifest: Manifest
    report: dict[str, Any] | None


@dataclass(frozen=True)
class InputSide:
    """What an input side hands the shared pipeline (pack, write, resume, account, report).

    `shardkit build` tokenizes text (`text_inputs`); `shardkit convert` reads documents that are
    already token ids (`shardkit.tools.convert`). Everything after the worker's `UnitResult` is shared.

    Attributes:
        files: the inputs in order: the manifest's `sources`, the byte accounting, the progress bar.
        info: the tokenizer identity the manifest records (special ids resolved; `pad_id` set).
        units: the parent's work units from a resume position (unit index, file index, units to skip).
        work: `work(unit, settings) -> UnitResult` in a worker process or Ray task (module-level).
        settings: the second argument of `work` (small and picklable).
        resolved: values that replace the configuration's in the build record (inputs with hashes).
        tool: the command the build record and the summary name.
    """

    files: list[InputFile]
    info: TokenizerInfo
    units: Callable[[tuple[int, int, int]], Iterator[WorkUnit]]
    work: Callable[[WorkUnit, Any], UnitResult]
    settings: Any
    resolved: dict[str, Any]
    tool: str = "shardkit build"


@dataclass
class BuildRun:
    """What one build carries from step to step (runtime objects and counters, not configuration).

    Attributes:
        status: "fresh", "resume" or "done" (from `state.prepare_output`).
        build: the build record (the manifest's `build` dict, with its fingerprint).
        emitted: samples the packer has produced so far (this run and before a resume).
        skip_samples: samples still to drop because shards written before a resume hold them.
        boundary: the resume state at the start of the unit being packed (metadata, arrays).
        expected_documents: records the parent's reader counted in each unit in flight, by unit index.
    """

    config: BuildConfig
    storage: Storage
    side: InputSide
    files: list[InputFile]
    info: TokenizerInfo
    token_dtype: str
    build: dict[str, Any]
    resume_key: str
    status: str
    packer: Packer
    stats: BuildStats
    workers: int
    began: float
    shards: list[ShardInfo] = field(default_factory=list)
    reused_shards: int = 0
    start: tuple[int, int, int] = (0, 0, 0)
    emitted: int = 0
    skip_samples: int = 0
    tokens_at_start: int = 0
    boundary: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None
    expected_documents: dict[int, int] = field(default_factory=dict)
    writer: ShardWriter | None = None
    units_per_node: dict[str, int] = field(default_factory=dict)  # which node tokenized how many units
    cut_boundaries: deque = field(default_factory=deque)  # `boundary` when each shard in flight was cut


def run_build(config: BuildConfig) -> BuildResult:
    """Run (or resume) a build; returns the manifest and the report.

    Raises:
        BuildInputError: a bad document or file under `on_error="fail"`.
        FileExistsError: the output holds another build and `overwrite` is false.
        ValueError, OSError: bad configuration, unreadable inputs, storage failures.
    """
    began = time.perf_counter()
    # Load the tokenizer here first: a bad --tokenizer is then one clear error from this process, and
    # forked workers inherit the loaded tokenizer.
    worker_tokenizer(config.tokenizer)
    return run_pipeline(config, lambda: text_inputs(config), began=began, initializer=_worker_start,
                        initargs=(config.tokenizer,))


def run_pipeline(config, plan: Callable[[], InputSide], *, began: float, initializer: Callable,
                 initargs: tuple = (), threads: bool = False) -> BuildResult:
    """The shared pipeline of `shardkit build` and `shardkit convert`: work units from `plan()`'s input
    side, processed by `--workers` processes or Ray tasks, packed in unit order, written to shards with
    a resume checkpoint after each, then the report and the manifest.

    Args:
        config: a `BuildConfig` or any configuration with the same output, packing, executor and error
            fields (`ConvertConfig`).
        plan: resolves the input side; called once the executor's workers are starting.
        initializer: runs once in each local worker process (it must ignore SIGINT, see `_worker_start`).
        threads: the input side's work releases the GIL, so local workers are threads of this process
            (`ThreadExecutor`): its results then cost no pickling and no pipe.
    """
    workers = config.workers or available_cores()
    # While the parent encodes a full shard it consumes no results; enough units in flight keep the
    # workers busy meanwhile (~0.4 input bytes per shard byte at zstd's and tiktoken's speeds).
    extra = min(64, math.ceil(0.4 * config.shard_size / config.unit_bytes))
    executor = make_executor(config.executor, workers, ray_address=config.ray_address,
                             initializer=initializer, initargs=initargs, extra_window=extra, threads=threads)
    # Spawned workers start first: they load the tokenizer while the parent sets up.
    with executor:
        run = prepare(config, plan(), workers=workers, began=began)
        if run.status == "done":
            logger.info("%s already holds this build; nothing to do", run.storage.url)
            return BuildResult("done", load_manifest(run.storage), None)
        emit(run, executor)
    return finish(run)


def _worker_start(tokenizer: str | None = None) -> None:
    """Worker initializer: Ctrl-C reaches the whole process group, and the parent alone answers it
    (one `interrupted` line, exit 130), so workers ignore SIGINT and are shut down by the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if tokenizer is not None:
        warm_up(tokenizer)


def text_inputs(config: BuildConfig) -> InputSide:
    """The input side of `shardkit build`: text files cut into units that workers tokenize."""
    info = worker_tokenizer(config.tokenizer).info
    used_info = with_special_ids(info, eos_id=config.eos_id, bos_id=config.bos_id)
    eos, bos = used_info.eos_id, used_info.bos_id
    files = expand_inputs(config.inputs, config.storage_options, content_hashes=True)
    settings = DocumentSettings(tokenizer=config.tokenizer, token_dtype=token_dtype_for_vocab(info.vocab_size),
                                text_field=config.text_field, eos_id=eos, bos_id=bos,
                                max_doc_chars=config.max_doc_chars)

    def units(start: tuple[int, int, int]):
        return iter_units(files, text_field=config.text_field, txt_mode=config.txt_mode,
                          unit_bytes=config.unit_bytes, max_doc_chars=config.max_doc_chars,
                          storage_options=config.storage_options, start=start)

    return InputSide(files=files, info=used_info, units=units, work=tokenize_unit, settings=settings,
                     resolved={"inputs": [f.record() for f in files], "eos_id": eos, "bos_id": bos})


def prepare(config, side: InputSide, *, workers: int, began: float) -> BuildRun:
    """Resolve the configuration, decide fresh / resume / done, and restore a checkpoint to resume."""
    token_dtype = token_dtype_for_vocab(side.info.vocab_size)
    build = {**build_record(config, side.resolved), "tool": side.tool}
    build["fingerprint"] = build_state.fingerprint({**build, "tokenizer_info": asdict(side.info)})
    storage = Storage(config.output, config.storage_options)
    storage.makedirs()
    key = resume_key(config)
    status = build_state.prepare_output(storage, build, overwrite=config.overwrite, extra_key=key)
    packer = make_packer(config.packing, seq_len=config.seq_len, pad_id=side.info.pad_id, token_dtype=token_dtype,
                         buffer_docs=config.bestfit_buffer, max_open=config.bestfit_open)
    run = BuildRun(config=config, storage=storage, side=side, files=side.files, info=side.info,
                   token_dtype=token_dtype, build=build, resume_key=key, status=status, packer=packer,
                   stats=BuildStats(max_examples=config.max_examples, input_bytes=sum(f.size for f in side.files)),
                   workers=workers, began=began)
    if status == "resume":
        _restore(run)
    return run


def _restore(run: BuildRun) -> None:
    """Take up the checkpoint: shards written, packer state, counters, and where to restart."""
    meta, arrays = build_state.load_checkpoint(run.storage)
    run.shards = build_state.shards_from_meta(meta)
    missing = [s.name for s in run.shards
               if not run.storage.exists(s.name) or run.storage.size(s.name) != s.compressed_bytes]
    if missing:
        raise OSError(f"cannot resume the build in {run.storage.url}: shard {missing[0]} named by the checkpoint is "
                      "missing or has the wrong size; rerun with --overwrite to start again")
    boundary = meta["boundary"]
    run.packer.restore({**boundary["packer"], **arrays})
    run.stats = BuildStats.from_dict(boundary["stats"])
    run.start = tuple(boundary["position"])
    run.emitted = boundary["emitted"]
    run.skip_samples = sum(s.samples for s in run.shards) - run.emitted
    run.tokens_at_start = run.packer.stats.document_tokens
    run.reused_shards = len(run.shards)
    logger.info("resuming %s: reusing %d shards, restarting at work unit %d", run.storage.url, run.reused_shards,
                run.start[0])


def snapshot(run: BuildRun, position: tuple[int, int, int]) -> None:
    """Remember the resume state at the start of the unit at `position` (saved with the next shard)."""
    state = run.packer.snapshot()
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    scalars = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
    run.boundary = ({"position": list(position), "emitted": run.emitted, "stats": copy.deepcopy(run.stats.as_dict()),
                     "packer": copy.deepcopy(scalars)}, arrays)


def _save_checkpoint(run: BuildRun, boundary: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None) -> None:
    meta, arrays = boundary or run.boundary
    build_state.save_checkpoint(run.storage, {"fingerprint": run.build["fingerprint"], "extra_key": run.resume_key,
                                              "build": run.build, "shards": build_state.shards_to_meta(run.shards),
                                              "boundary": meta}, arrays)


def _shard_cut(run: BuildRun, index: int) -> None:
    # The checkpoint saved once this shard is stored must resume from a unit whose samples it holds:
    # the boundary now, not the one packing has reached by then (the shard is encoded in the background).
    run.cut_boundaries.append(run.boundary)


def _shard_done(run: BuildRun, shard: ShardInfo) -> None:
    run.shards.append(shard)
    metrics.shard_written(run.config.shard_format, shard.compressed_bytes)
    _save_checkpoint(run, run.cut_boundaries.popleft())


def _write(run: BuildRun, samples: ShardArrays) -> None:
    count = samples.num_samples
    skip = min(run.skip_samples, count)  # already in a shard written before the interruption
    run.emitted += count
    run.skip_samples -= skip
    if skip < count:
        run.writer.write_arrays(samples.slice(skip, count) if skip else samples)


def _counted(run: BuildRun, units):
    """The units, with the records the reader saw in each noted: the workers' accepted + rejected
    must add up to it, an independent check that no document is silently dropped."""
    for unit in units:
        run.expected_documents[unit.index] = unit.records_in_payload + len(unit.rejected)
        yield unit


def emit(run: BuildRun, executor) -> None:
    """Tokenize every unit (in parallel), pack the documents in unit order and write the shards."""
    config = run.config
    snapshot(run, run.start)
    if run.status == "fresh":
        _save_checkpoint(run)  # from the first byte on, the output says which build it belongs to
    run.writer = ShardWriter(run.storage, shard_format=config.shard_format, token_dtype=run.token_dtype,
                             max_bytes=config.shard_size, compression_level=config.compression_level,
                             start_index=len(run.shards), on_shard_done=lambda shard: _shard_done(run, shard),
                             on_shard_cut=lambda index: _shard_cut(run, index),
                             encode_threads=choose_encode_threads(config.shard_size, config.encode_threads))
    units = run.side.units(run.start)
    progress = Progress(run.files, enabled=config.progress)
    next_unit = run.start[0]
    try:
        with run.writer:
            for result, busy in executor.map_ordered(metrics.timed_call, _counted(run, units), run.side.work,
                                                          run.side.settings):
                snapshot(run, (result.index, result.source, result.file_unit))
                expected = run.expected_documents.pop(result.index)
                _account(result, run.files, run.stats, expected=expected, fail=config.on_error == "fail")
                metrics.build_unit_done(documents_in=expected, written=len(result.doc_lengths),
                                        tokens=int(result.doc_lengths.sum()), busy_seconds=busy)
                _write(run, run.packer.feed(result.tokens, result.doc_lengths, result.source, result.doc_index))
                next_unit = result.index + 1
                progress.update(result.source, result.input_offset, run.stats.documents_written,
                                run.packer.stats.document_tokens)
            snapshot(run, (next_unit, len(run.files), 0))
            _write(run, run.packer.finish())
    finally:
        progress.close()
        run.units_per_node = dict(executor.units_per_node)


def finish(run: BuildRun) -> BuildResult:
    """Write the report and then the manifest (which publishes the dataset), and remove the state."""
    config, stats = run.config, run.stats
    if not run.shards:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(stats.rejected_by_reason.items())) or "none"
        unreadable = "; ".join(f"{e['file']}: {e['reason']}" for e in stats.file_errors[:3])
        raise ValueError(f"nothing to write: none of the {stats.documents_in} input documents was accepted "
                         f"(rejected by reason: {reasons}" + (f"; unreadable: {unreadable}" if unreadable else "") + ")")
    seconds = time.perf_counter() - run.began
    manifest = Manifest(shard_format=config.shard_format, token_dtype=run.token_dtype,
                        seq_len=None if config.packing == "none" else config.seq_len,
                        max_sample_tokens=config.seq_len + 1, packing=config.packing, tokenizer=run.info,
                        shards=tuple(run.shards), sources=tuple(f.url for f in run.files),
                        compression={"codec": "zstd", "level": config.compression_level},
                        build={**run.build, "documents": {"in": stats.documents_in,
                                                          "written": stats.documents_written,
                                                          "rejected": stats.documents_rejected}})
    report = _report(config, manifest, stats, run.packer.stats.as_dict(), seconds=seconds,
                     tokens=run.packer.stats.document_tokens - run.tokens_at_start, workers=run.workers,
                     resumed=run.status == "resume", reused_shards=run.reused_shards, nodes=run.units_per_node)
    run.storage.write_bytes(build_state.REPORT_NAME, report_json(report))
    write_manifest(run.storage, manifest)
    build_state.clear_state(run.storage)
    return BuildResult("resumed" if run.status == "resume" else "built", manifest, report)


def _account(result: UnitResult, files, stats: BuildStats, *, expected: int, fail: bool) -> None:
    """Count a unit's documents; under --on-error fail, stop at its first problem."""
    url = files[result.source].url
    label = record_label(result.kind)
    if fail and (result.rejected or result.file_error):
        if result.rejected:
            record, reason = result.rejected[0]
            message = f"{url}: {label} {record + 1}: {reason}"
        else:
            message = f"{url}: {result.file_error}"
        raise BuildInputError(f"{message} (--on-error fail; use --on-error skip to count and report bad input)")
    stats.documents_in += expected
    stats.documents_written += len(result.doc_lengths)
    stats.text_chars += result.text_chars
    for record, reason in result.rejected:
        stats.reject(url, label, record, reason)
    stats.reached(result.source, result.input_offset)
    if result.file_error:
        stats.file_error(url, result.file_error, unread_bytes=files[result.source].size - result.input_offset)


def _report(config: BuildConfig, manifest: Manifest, stats: BuildStats, packing: dict[str, int], *,
            seconds: float, tokens: int, workers: int, resumed: bool, reused_shards: int,
            nodes: dict[str, int]) -> dict[str, Any]:
    totals = manifest.totals()
    sample_tokens = totals["tokens"]
    return {
        "tool": manifest.build["tool"],
        "output": config.output,
        "manifest_fingerprint": manifest.build["fingerprint"],
        "resumed": resumed,
        "shards_from_before_resume": reused_shards,
        "totals": totals,
        "documents": {
            "in": stats.documents_in, "written": stats.documents_written, "rejected": stats.documents_rejected,
            "balanced": stats.documents_in == stats.documents_written + stats.documents_rejected,
            "rejected_by_reason": stats.rejected_by_reason, "examples": stats.examples,
            "text_characters": stats.text_chars,
        },
        "file_errors": stats.file_errors,
        "bytes": {"in": stats.input_bytes, "read": stats.bytes_read, "unreadable": stats.unreadable_bytes,
                  "balanced": stats.input_bytes == stats.bytes_read + stats.unreadable_bytes},
        "packing": {**packing, "mode": config.packing, "seq_len": config.seq_len,
                    "padding_fraction": packing["padding_tokens"] / sample_tokens if sample_tokens else 0.0},
        "timing": {"seconds": seconds, "tokens_this_run": tokens,
                   "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
                   "workers": workers, "executor": config.executor,
                   # Units of this run by the node that tokenized them (Ray: "ADDRESS/NODE-ID").
                   "units_per_node": nodes},
    }


def print_summary(report: dict[str, Any], stream) -> None:
    print(summary_table(report), file=stream)
