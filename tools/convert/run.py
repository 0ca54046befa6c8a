"""`run_convert`: the source side for `--from FORMAT` plugged into the build's pipeline (see the package)."""

from __future__ import annotations

import time
from dataclasses import replace

from shardkit.manifest import TokenizerInfo, token_dtype_for_vocab
from shardkit.text.documents import cached_tokenizer

from ..build import BuildResult, InputSide, _worker_start, run_pipeline
from .config import ConvertConfig
from .documents import TokenSettings, file_units

__all__ = ["run_convert", "source_side", "tokenizer_identity"]

# Formats whose worker reads a byte range or a whole file and checks it with numpy and pyarrow, which
# release the GIL: their local workers are threads, so no id is pickled and piped to the packer (a copy
# of every byte in each process, and most of a worker process's CPU). An MDS shard is parsed sample by
# sample in Python: processes.
READ_IN_THREADS = ("megatron", "hf", "litdata")


def run_convert(config: ConvertConfig) -> BuildResult:
    """Run (or resume) a conversion; returns the manifest and the report, like `run_build`.

    Raises:
        BuildInputError: a bad record or file under `on_error="fail"`.
        FileExistsError: the output holds another dataset and `overwrite` is false.
        ValueError, OSError: bad configuration, unreadable sources, storage failures.
    """
    began = time.perf_counter()
    return run_pipeline(config, lambda: source_side(config), began=began, initializer=_worker_start,
                        threads=config.source_format in READ_IN_THREADS)


def source_side(config: ConvertConfig) -> InputSide:
    """The input side for `--from FORMAT`: the source's files, units and worker function."""
    options = config.storage_options
    if config.source_format == "megatron":
        from . import megatron

        pairs = megatron.expand_sources(config.inputs, options)
        indexes = [megatron.load_index(idx, options) for _, idx in pairs]
        files = [bin_file for bin_file, _ in pairs]
        recorded = [f.record() for pair in pairs for f in pair]
        metadata = megatron.read_metadata(files[0], options) if files else None
        units = lambda start: megatron.units(pairs, indexes, unit_bytes=config.unit_bytes, start=start)  # noqa: E731
        work = megatron.read_unit
    elif config.source_format in ("mds", "litdata"):  # read a whole file (shard, chunk) per unit
        from . import litdata, mds

        if config.source_format == "mds":
            sources = mds.expand_sources(config.inputs, token_field=config.token_field, storage_options=options)
            work = mds.read_shard_unit
        else:
            sources = litdata.expand_sources(config.inputs, options)
            work = litdata.read_chunk_unit
        files = [file for file, _, _ in sources]
        recorded, metadata = [f.record() for f in files], None
        units = lambda start: file_units(sources, kind=config.source_format, start=start)  # noqa: E731
    else:
        from . import hf

        files = hf.expand_sources(config.inputs, options)
        recorded, metadata = [f.record() for f in files], None
        units = lambda start: hf.units(files, token_field=config.token_field, unit_bytes=config.unit_bytes,  # noqa: E731
                                       storage_options=options, start=start)
        work = hf.read_rows
    info = tokenizer_identity(config.tokenizer, metadata, source=config.inputs[0])
    settings = TokenSettings(vocab_size=info.vocab_size, token_dtype=token_dtype_for_vocab(info.vocab_size),
                             storage_options=options)
    return InputSide(files=files, info=info, units=units, work=work, settings=settings,
                     resolved={"inputs": recorded}, tool="shardkit convert")


def tokenizer_identity(spec: str | None, metadata: TokenizerInfo | None, *, source: str) -> TokenizerInfo:
    """The tokenizer the ids came from: `--tokenizer` when given, else the source's metadata; the pad id
    is the tokenizer's, else its EOS, else 0 (as `shardkit build` pads).

    Raises:
        ValueError: neither names a tokenizer (ids without a vocabulary cannot be checked or decoded).
    """
    if spec is not None:
        info = cached_tokenizer(spec).info
    elif metadata is not None:
        info = metadata
    else:
        raise ValueError(f"--tokenizer is required: {source} records no tokenizer identity (give the tokenizer the "
                         "ids were made with, e.g. --tokenizer tiktoken:gpt2 or --tokenizer path/tokenizer.json)")
    pad = info.pad_id if info.pad_id is not None else (info.eos_id if info.eos_id is not None else 0)
    return replace(info, pad_id=pad)
