"""`shardkit convert` and `shardkit export`: argument parsing only (heavy imports happen inside).

Options are generated from `ConvertConfig` and `ExportConfig` fields by the build command's generator,
so options shared with `shardkit build` are spelled, documented and checked the same way.
"""

from __future__ import annotations

import sys
from typing import Any

from shardkit.cli.build import _configure_logging, config_from_args, run_pipeline_command
from shardkit.options import Namespace, add_command

CONVERT_EPILOG = """\
examples:
  shardkit convert data/my-corpus_text_document --from megatron --output ds --tokenizer tiktoken:gpt2 --seq-len 2048
  shardkit convert s3://bucket/tokenized/train --from hf --token-field input_ids --output s3://bucket/ds \\
      --tokenizer tokenizer.json --seq-len 4096 --workers 8
  shardkit convert 'shards/*.parquet' --from hf --output ds --tokenizer spm.model --seq-len 1024 --pack none

Documents keep their boundaries (Megatron documents, HF rows): every sample stores its segments with the
source file and the document's number in it. Nothing is re-tokenized: the ids are checked against the
tokenizer's vocabulary and packed as `shardkit build` packs. The output, the resume after an interruption
(run the same command again), the report (build_report.json) and --workers/--executor are the build's.
"""

EXPORT_EPILOG = """\
examples:
  shardkit export ds --to megatron --output megatron/my-corpus_text_document
  shardkit export s3://bucket/ds --to megatron --output /data/ds_text_document --unit sample

The result opens with megatron-core's IndexedDataset(PREFIX) (and Megatron's --data-path PREFIX).
"""


def register(subparsers: Any) -> None:
    from shardkit.tools.convert.config import ConvertConfig, ExportConfig

    # Plain flags, as for `shardkit build`: a `--flag [BOOL]` would swallow a following SRC.
    add_command(subparsers, "convert", run_convert_command, options=[ConvertConfig], bool_values=False,
                help="convert a tokenized dataset (Megatron, Hugging Face) into shards without re-tokenizing",
                description="Read documents of token ids from another format and write shardkit shards and a "
                            "manifest, exactly as 'shardkit build' would from text. Every option is a field of "
                            "shardkit.tools.convert.config.ConvertConfig.",
                epilog=CONVERT_EPILOG)
    add_command(subparsers, "export", run_export_command, options=[ExportConfig], bool_values=False,
                help="write a shardkit dataset in another format (a Megatron indexed dataset)",
                description="Write a shardkit dataset's documents (or samples) as a Megatron indexed dataset. Every "
                            "option is a field of shardkit.tools.convert.config.ExportConfig.",
                epilog=EXPORT_EPILOG)


def run_convert_command(args: Namespace) -> int:
    def convert():
        from shardkit.tools.convert import ConvertConfig, run_convert

        config = config_from_args(args, ConvertConfig)
        return config, run_convert(config)

    return run_pipeline_command("shardkit convert", convert)


def run_export_command(args: Namespace) -> int:
    _configure_logging()
    from shardkit.tools.convert.config import ExportConfig
    from shardkit.tools.convert.export import run_export

    try:
        result = run_export(config_from_args(args, ExportConfig))
    except (ValueError, OSError) as err:  # CorruptShardError and FileExistsError are among these
        print(f"shardkit export: error: {err}", file=sys.stderr)
        return 1
    print(f"shardkit export: wrote {result.prefix}.bin/.idx: {result.documents:,} documents, {result.tokens:,} "
          f"tokens ({result.dtype})", file=sys.stderr)
    return 0
