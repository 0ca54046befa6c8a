"""`run_build`: inputs -> work units -> parallel tokenization -> ordered packing -> shards -> manifest.

The parent reads the inputs and cuts them into work units (`inputs`), workers tokenize units in
parallel (`executors`, `documents`), and the parent consumes the results strictly in unit order,
packs them (`packing`) and writes shards (`ShardWriter`). The sample stream therefore depends only on
the inputs and the configuration, never on the worker count or the executor. After every shard the
resume checkpoint is rewritten (`state`); the build report and then the manifest are written last.
"""

from __future__ import annotations

import copy
import math
import logging
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from shardkit import metrics
from shardkit.formats import ShardWriter
from shardkit.manifest import Manifest, ShardInfo, load_manifest, token_dtype_for_vocab, write_manifest
from shardkit.storage import Storage
from shardkit.tools import state as build_state
from shardkit.tools.documents import DocumentSettings, UnitResult, tokenize_unit, warm_up
from shardkit.tools.documents import cached_tokenizer as worker_tokenizer
from shardkit.tools.executors import EXECUTORS, available_cores, make_executor
from shardkit.tools.inputs import TXT_MODES, expand_inputs, iter_units
from shardkit.tools.packing import PACKING_MODES, make_packer
from shardkit.tools.report import BuildStats, Progress, record_label, report_json, summary_table

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
                 "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str | int, *, option: str = "--shard-size") -> int:
    """Bytes in "64MB" (decimal units: KB, MB, GB), "64MiB" (binary: KiB, MiB, GiB, or K, M, G) or "1000"."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        if not match or match.group(2).lower() not in _SIZE_FACTORS:
            raise ValueError(f"{option}: cannot read {text!r} as a size (examples: 64MB, 256MiB, 1000000)")
        value = int(float(match.group(1)) * _SIZE_FACTORS[match.group(2).lower()])
    if value < 1:
        raise ValueError(f"{option} must be at least 1 byte, got {text!r}")
    return value


def parse_compression(text: str) -> int:
    """zstd level from "zstd" (level 3) or "zstd:LEVEL" (1-22)."""
    codec, _, level = text.partition(":")
    if codec != "zstd":
        raise ValueError(f"--compression: only zstd is supported, got {text!r} (examples: zstd, zstd:9)")
    try:
        value = int(level) if level else 3
    except ValueError:
        raise ValueError(f"--compression: level must be an integer, got {level!r}") from None
    if not 1 <= value <= 22:
        raise ValueError(f"--compression: zstd level must be in 1-22, got {value}")
    return value


def _special(value: int | str | None, tokenizer_value: int | None, option: str, vocab_size: int) -> int | None:
    if value == "auto":
        return tokenizer_value
    if value is None or value == "none":
        return None
    try:
        token_id = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{option} must be an integer id, 'auto' or 'none', got {value!r}") from None
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"{option} {token_id} is outside the tokenizer's vocabulary [0, {vocab_size})")
    return token_id


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """Everything `shardkit build` is told (one field per CLI option).

    Attributes:
        inputs: files, directories, globs or fsspec URLs.
        output: dataset prefix (any fsspec URL).
        tokenizer: tokenizer spec (`load_tokenizer`).
        seq_len: training context length; packed windows hold seq_len + 1 tokens.
        shard_format: "tar" or "arrow".
        packing: "concat", "bestfit" or "none".
        shard_size: raw (uncompressed) payload bytes per shard.
        compression_level: zstd level.
        text_field: JSON key / Parquet column holding the text.
        txt_mode: "file" (a .txt file is one document) or "paragraph" (blank-line separated).
        on_error: "skip" (count and report bad documents) or "fail" (stop at the first).
        eos_id: id after each document: "auto" (the tokenizer's), an id, or None.
        bos_id: id before each document: None (default), "auto" (the tokenizer's) or an id.
        max_doc_chars: longer documents are rejected as enormous.
        bestfit_buffer: documents sorted and placed together by bestfit.
        bestfit_open: partly filled windows bestfit keeps open between buffers.
        workers: parallel tokenizer processes / Ray tasks (None: available cores).
        executor: "local" or "ray".
        ray_address: Ray cluster to join (None: start a local instance).
        overwrite: replace another build's data in `output`.
        unit_bytes: decompressed input bytes per work unit.
        max_examples: rejected documents listed in the report.
        progress: show the progress bar.
        storage_options: fsspec options for inputs and output (never logged).
    """

    inputs: tuple[str, ...]
    output: str
    tokenizer: str
    seq_len: int
    shard_format: str = "arrow"
    packing: str = "concat"
    shard_size: int = 64 * 10**6
    compression_level: int = 3
    text_field: str = "text"
    txt_mode: str = "file"
    on_error: str = "skip"
    eos_id: int | str | None = "auto"
    bos_id: int | str | None = None
    max_doc_chars: int = 10_000_000
    bestfit_buffer: int = 2048
    bestfit_open: int = 512
    workers: int | None = None
    executor: str = "local"
    ray_address: str | None = None
    overwrite: bool = False
    unit_bytes: int = 1 << 20
    max_examples: int = 20
    progress: bool = True
    storage_options: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.inputs:
            raise ValueError("give at least one INPUT")
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"--seq-len must be a positive integer, got {self.seq_len!r}")
        if self.shard_format not in ("tar", "arrow"):
            raise ValueError(f"--format must be 'tar' or 'arrow', got {self.shard_format!r}")
        if self.packing not in PACKING_MODES:
            raise ValueError(f"--pack must be one of {', '.join(PACKING_MODES)}, got {self.packing!r}")
        if self.on_error not in ("skip", "fail"):
            raise ValueError(f"--on-error must be 'skip' or 'fail', got {self.on_error!r}")
        if self.txt_mode not in TXT_MODES:
            raise ValueError(f"--txt-mode must be one of {', '.join(TXT_MODES)}, got {self.txt_mode!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"--executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not 1 <= self.compression_level <= 22:
            raise ValueError(f"--compression level must be in 1-22, got {self.compression_level}")
        for name in ("shard_size", "max_doc_chars", "bestfit_buffer", "unit_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


class BuildInputError(ValueError):
    """A bad document or unreadable file under `--on-error fail`."""


@dataclass(frozen=True)
class BuildResult:
    """What `run_build` did: "built", "resumed" or "done" (the output already held this build)."""

    status: str
    manifest: Manifest
    report: dict[str, Any] | None


def _build_record(config: BuildConfig, files, eos, bos) -> dict[str, Any]:
    """The configuration that decides the output (recorded in the manifest; its hash is the fingerprint)."""
    record: dict[str, Any] = {
        "tool": "shardkit build",
        "inputs": [{"url": f.url, "bytes": f.size} for f in files],
        "tokenizer": config.tokenizer,
        "seq_len": config.seq_len,
        "packing": config.packing,
        "shard_format": config.shard_format,
        "shard_size": config.shard_size,
        "compression_level": config.compression_level,
        "text_field": config.text_field,
        "txt_mode": config.txt_mode,
        "eos_id": eos,
        "bos_id": bos,
        "max_doc_chars": config.max_doc_chars,
    }
    if config.packing == "bestfit":
        record["bestfit"] = {"buffer_docs": config.bestfit_buffer, "max_open": config.bestfit_open}
    return record


def run_build(config: BuildConfig) -> BuildResult:
    """Run (or resume) a build; returns the manifest and the report.

    Raises:
        BuildInputError: a bad document or file under `on_error="fail"`.
        FileExistsError: the output holds another build and `overwrite` is false.
        ValueError, OSError: bad configuration, unreadable inputs, storage failures.
    """
    began = time.perf_counter()
    workers = config.workers or available_cores()
    # While the parent encodes a full shard it consumes no results; enough units in flight keep the
    # workers busy meanwhile (~0.4 input bytes per shard byte at zstd's and tiktoken's speeds).
    extra = min(64, math.ceil(0.4 * config.shard_size / config.unit_bytes))
    executor = make_executor(config.executor, workers, ray_address=config.ray_address,
                             initializer=warm_up, initargs=(config.tokenizer,), extra_window=extra)
    if executor.forks:
        warm_up(config.tokenizer)  # forked workers inherit the loaded tokenizer
    # Otherwise the workers start first: they spawn and load the tokenizer while the parent sets up.
    with executor:
        return _run(config, executor, workers, began)


def _run(config: BuildConfig, executor, workers: int, began: float) -> BuildResult:
    tokenizer = worker_tokenizer(config.tokenizer)  # the cached instance when already loaded
    info = tokenizer.info
    eos = _special(config.eos_id, info.eos_id, "--eos-id", info.vocab_size)
    bos = _special(config.bos_id, info.bos_id, "--bos-id", info.vocab_size)
    pad = info.pad_id if info.pad_id is not None else (eos if eos is not None else 0)
    used_info = replace(info, eos_id=eos, bos_id=bos, pad_id=pad)
    token_dtype = token_dtype_for_vocab(info.vocab_size)
    files = expand_inputs(config.inputs, config.storage_options)
    build = _build_record(config, files, eos, bos)
    build["fingerprint"] = build_state.fingerprint({**build, "tokenizer_info": asdict(used_info)})
    storage = Storage(config.output, config.storage_options)
    storage.makedirs()
    extra_key = f"unit_bytes={config.unit_bytes}"
    status = build_state.prepare_output(storage, build, overwrite=config.overwrite, extra_key=extra_key)
    if status == "done":
        logger.info("%s already holds this build; nothing to do", storage.url)
        return BuildResult("done", load_manifest(storage), None)

    packer = make_packer(config.packing, seq_len=config.seq_len, pad_id=pad, token_dtype=token_dtype,
                         buffer_docs=config.bestfit_buffer, max_open=config.bestfit_open)
    stats = BuildStats(max_examples=config.max_examples)
    shards: list[ShardInfo] = []
    start, emitted, skip_samples, tokens_at_start = (0, 0, 0), 0, 0, 0
    if status == "resume":
        meta, arrays = build_state.load_checkpoint(storage)
        shards = build_state.shards_from_meta(meta)
        missing = [s.name for s in shards if not storage.exists(s.name) or storage.size(s.name) != s.compressed_bytes]
        if missing:
            raise OSError(f"cannot resume the build in {storage.url}: shard {missing[0]} named by the checkpoint is "
                          "missing or has the wrong size; rerun with --overwrite to start again")
        boundary = meta["boundary"]
        packer.restore({**boundary["packer"], **arrays})
        stats = BuildStats.from_dict(boundary["stats"])
        start = tuple(boundary["position"])
        emitted = boundary["emitted"]
        skip_samples = sum(s.samples for s in shards) - emitted
        tokens_at_start = packer.stats.document_tokens
        logger.info("resuming %s: %d shards done, restarting at work unit %d", storage.url, len(shards), start[0])

    settings = DocumentSettings(tokenizer=config.tokenizer, token_dtype=token_dtype, text_field=config.text_field,
                                eos_id=eos, bos_id=bos, max_doc_chars=config.max_doc_chars)

    def snapshot(position: tuple[int, int, int]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        state = packer.snapshot()
        arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
        scalars = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
        return {"position": list(position), "emitted": emitted, "stats": copy.deepcopy(stats.as_dict()),
                "packer": copy.deepcopy(scalars)}, arrays

    boundary_state = snapshot(start)

    def save() -> None:
        meta, arrays = boundary_state
        build_state.save_checkpoint(storage, {"fingerprint": build["fingerprint"], "extra_key": extra_key,
                                              "build": build, "shards": build_state.shards_to_meta(shards),
                                              "boundary": meta}, arrays)

    def on_shard_done(shard: ShardInfo) -> None:
        shards.append(shard)
        metrics.shard_written(config.shard_format, shard.compressed_bytes)
        save()

    if status == "fresh":
        save()  # from the first byte on, the output says which build it belongs to
    writer = ShardWriter(storage, shard_format=config.shard_format, token_dtype=token_dtype,
                         max_bytes=config.shard_size, compression_level=config.compression_level,
                         start_index=len(shards), on_shard_done=on_shard_done)

    def emit(samples) -> None:
        nonlocal emitted, skip_samples
        for sample in samples:
            emitted += 1
            if skip_samples > 0:  # already in a shard written before the interruption
                skip_samples -= 1
                continue
            writer.write(sample)

    progress = Progress(files, enabled=config.progress)
    units = iter_units(files, text_field=config.text_field, txt_mode=config.txt_mode, unit_bytes=config.unit_bytes,
                       max_doc_chars=config.max_doc_chars, storage_options=config.storage_options, start=start)
    next_unit = start[0]
    try:
        with writer:
            for result, busy in executor.map_ordered(metrics.timed_call, units, tokenize_unit, settings):
                boundary_state = snapshot((result.index, result.source, result.file_unit))
                _account(result, files, stats, fail=config.on_error == "fail")
                metrics.build_unit_done(documents_in=result.documents_in, written=len(result.doc_lengths),
                                        tokens=int(result.doc_lengths.sum()), busy_seconds=busy)
                emit(packer.feed(result.tokens, result.doc_lengths, result.source, result.doc_index))
                next_unit = result.index + 1
                progress.update(result.source, result.input_offset, stats.documents_written,
                                packer.stats.document_tokens)
            boundary_state = snapshot((next_unit, len(files), 0))
            emit(packer.finish())
    finally:
        progress.close()
    if not shards:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(stats.rejected_by_reason.items())) or "none"
        unreadable = "; ".join(f"{e['file']}: {e['reason']}" for e in stats.file_errors[:3])
        raise ValueError(f"nothing to write: none of the {stats.documents_in} input documents was accepted "
                         f"(rejected by reason: {reasons}" + (f"; unreadable: {unreadable}" if unreadable else "") + ")")
    seconds = time.perf_counter() - began
    manifest = Manifest(shard_format=config.shard_format, token_dtype=token_dtype,
                        seq_len=None if config.packing == "none" else config.seq_len,
                        max_sample_tokens=config.seq_len + 1, packing=config.packing, tokenizer=used_info,
                        shards=tuple(shards), sources=tuple(f.url for f in files),
                        compression={"codec": "zstd", "level": config.compression_level},
                        build={**build, "documents": {"in": stats.documents_in, "written": stats.documents_written,
                                                      "rejected": stats.documents_rejected}})
    report = _report(config, manifest, stats, packer.stats.as_dict(), seconds=seconds,
                     tokens=packer.stats.document_tokens - tokens_at_start, workers=workers,
                     resumed=status == "resume", resumed_shards=len(shards) - len(writer.shards))
    storage.write_bytes(build_state.REPORT_NAME, report_json(report))
    write_manifest(storage, manifest)
    build_state.clear_state(storage)
    return BuildResult("resumed" if status == "resume" else "built", manifest, report)


def _account(result: UnitResult, files, stats: BuildStats, *, fail: bool) -> None:
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
    stats.documents_in += result.documents_in
    stats.documents_written += len(result.doc_lengths)
    stats.text_chars += result.text_chars
    for record, reason in result.rejected:
        stats.reject(url, label, record, reason)
    if result.file_error:
        stats.file_error(url, result.file_error)


def _report(config: BuildConfig, manifest: Manifest, stats: BuildStats, packing: dict[str, int], *,
            seconds: float, tokens: int, workers: int, resumed: bool, resumed_shards: int) -> dict[str, Any]:
    totals = manifest.totals()
    sample_tokens = totals["tokens"]
    return {
        "output": config.output,
        "manifest_fingerprint": manifest.build["fingerprint"],
        "resumed": resumed,
        "shards_from_before_resume": resumed_shards if resumed else 0,
        "totals": totals,
        "documents": {
            "in": stats.documents_in, "written": stats.documents_written, "rejected": stats.documents_rejected,
            "balanced": stats.documents_in == stats.documents_written + stats.documents_rejected,
            "rejected_by_reason": stats.rejected_by_reason, "examples": stats.examples,
            "text_characters": stats.text_chars,
        },
        "file_errors": stats.file_errors,
        "packing": {**packing, "mode": config.packing, "seq_len": config.seq_len,
                    "padding_fraction": packing["padding_tokens"] / sample_tokens if sample_tokens else 0.0},
        "timing": {"seconds": seconds, "tokens_this_run": tokens,
                   "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
                   "workers": workers, "executor": config.executor},
    }


def print_summary(report: dict[str, Any], stream) -> None:
    print(summary_table(report), file=stream)
