"""`shardkit convert` and `shardkit export`: argument parsing only (heavy imports happen inside).

Options are generated from `ConvertConfig` and `ExportConfig` fields by the build command's generator,
so options shared with `shardkit build` are spelled, documented and checked the same way.
"""

from __future__ import annotations

import argparse
import sys

from shardkit.cli.build import _configure_logging, run_pipeline_command
from shardkit.cli.dataset import parse_storage_options

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


def register(subparsers) -> None:
    from shardkit.options import add_dataclass_options
    from shardkit.tools.convert.config import ConvertConfig, ExportConfig

    convert = subparsers.add_parser(
        "convert", help="convert a tokenized dataset (Megatron, Hugging Face) into shards without re-tokenizing",
        description="Read documents of token ids from another format and write shardkit shards and a manifest, "
                    "exactly as 'shardkit build' would from text. Every option is a field of "
                    "shardkit.tools.convert.config.ConvertConfig.",
        epilog=CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Plain flags, as for `shardkit build`: a `--flag [BOOL]` would swallow a following SRC.
    add_dataclass_options(convert, ConvertConfig, bool_values=False)
    convert.set_defaults(func=run_convert_command)
    export = subparsers.add_parser(
        "export", help="write a shardkit dataset in another format (a Megatron indexed dataset)",
        description="Write a shardkit dataset's documents (or samples) as a Megatron indexed dataset. Every option "
                    "is a field of shardkit.tools.convert.config.ExportConfig.",
        epilog=EXPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_options(export, ExportConfig, bool_values=False)
    export.set_defaults(func=run_export_command)


def config_from_args(args: argparse.Namespace, config_class):
    """The configuration the parsed options describe (options not given keep the dataclass defaults)."""
    from shardkit.options import given_values

    given = given_values(args, config_class)
    if "storage_options" in given:
        given["storage_options"] = parse_storage_options(given["storage_options"])
    return config_class(**given)


def run_convert_command(args: argparse.Namespace) -> int:
    def convert():
        from shardkit.tools.convert import ConvertConfig, run_convert

        config = config_from_args(args, ConvertConfig)
        return config, run_convert(config)

    return run_pipeline_command("shardkit convert", convert)


def run_export_command(args: argparse.Namespace) -> int:
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
