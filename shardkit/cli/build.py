"""`shardkit build` and `shardkit tokenizer train`: their options only (heavy imports happen inside)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from shardkit.options import (Namespace, add_command, add_command_group, given_values, option,
                              parse_storage_options)
from shardkit.text.recipe import recipe_option

BUILD_EPILOG = """\
examples:
  shardkit build corpus/*.jsonl.zst --output s3://bucket/ds --tokenizer tiktoken:cl100k_base --seq-len 2048
  shardkit build data/ --output ds --tokenizer tokenizer.json --seq-len 1024 --pack bestfit --workers 8
  shardkit build books.txt --txt-mode paragraph --output ds --tokenizer byte --seq-len 512 --format arrow
  shardkit build web.parquet --text-field content --output ds --tokenizer spm.model --seq-len 4096 \\
      --executor ray --ray-address auto

samples: with --pack concat/bestfit every sample holds seq-len + 1 tokens: the model reads
tokens[:-1] and predicts tokens[1:]. Windows do not overlap, so every token is a target once.
Every sample stores its document segments (start, input file, document index) so attention can be
kept within documents. The output is the same for any --workers and either --executor. An
interrupted build resumes when the same command is run again; the report of documents read,
written and rejected is saved as build_report.json next to the manifest (shardkit.json).
"""


@dataclass(frozen=True, kw_only=True)
class MetricsOptions:
    """Where the build serves its metrics: not a BuildConfig field, as it changes nothing in the output or its
    fingerprint."""

    metrics_port: int = option(0, "serve Prometheus metrics at http://HOST:P/metrics while the build runs (0: off)",
                               metavar="P")
    metrics_address: str = option("127.0.0.1", "address the metrics endpoint listens on (127.0.0.1: this machine "
                                  "only; 0.0.0.0 for every interface, see docs/OBSERVABILITY.md)", metavar="ADDR")


@dataclass(frozen=True, kw_only=True)
class TokenizerTrainOptions:
    inputs: tuple[str, ...] = option(help="files, directories, globs or fsspec URLs", positional=True,
                                     metavar="INPUT")
    vocab_size: int = option(help="vocabulary size including the 256 byte symbols and specials, e.g. 32000",
                             metavar="N")
    output: str = option(help="tokenizer.json to write", metavar="FILE")
    text_field: str = recipe_option("text_field")
    txt_mode: str = recipe_option("txt_mode")
    min_frequency: int = option(2, "pairs seen fewer times are not merged", metavar="N")
    max_documents: int | None = option(None, "train on the first N accepted documents only", metavar="N",
                                       cli_default="all")


def register(subparsers: Any) -> None:
    from shardkit.tools.config import BuildConfig

    # Plain flags (`--overwrite`, `--no-progress`): a `--flag [BOOL]` would swallow a following INPUT.
    add_command(subparsers, "build", run_build_command, options=[BuildConfig, MetricsOptions], bool_values=False,
                help="tokenize and pack corpora into shards + a manifest",
                description="Tokenize raw corpora, pack the tokens into fixed-length samples and write zstd-compressed "
                            "shards and a manifest (shardkit.json) that the loaders stream. Every option is a field "
                            "of shardkit.tools.config.BuildConfig.",
                epilog=BUILD_EPILOG)
    tokenizer = add_command_group(subparsers, "tokenizer", help="tokenizer tools (train a byte-level BPE)",
                                  description="Tokenizer tools.")
    add_command(tokenizer, "train", run_tokenizer_train, options=[TokenizerTrainOptions], bool_values=False,
                help="train a byte-level BPE on corpora",
                description="Train a byte-level BPE with HF tokenizers on the documents of INPUT (same input types as "
                            "'shardkit build') and save it as tokenizer.json, usable as 'shardkit build --tokenizer "
                            "FILE'. <|endoftext|> is added as the EOS token (id 0).",
                epilog="example:\n  shardkit tokenizer train corpus/*.jsonl.zst --vocab-size 32000 --output "
                       "tok/tokenizer.json")


def _configure_logging() -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def config_from_args(args: Namespace, config_class: type | None = None):
    """The configuration (`BuildConfig`, or `config_class` of convert and export) the parsed options describe
    (options not given keep the dataclass defaults)."""
    if config_class is None:
        from shardkit.tools.config import BuildConfig as config_class

    given = given_values(args, config_class)
    if "storage_options" in given:
        given["storage_options"] = parse_storage_options(given["storage_options"])
    return config_class(**given)


def run_build_command(args: Namespace) -> int:
    def build():
        from shardkit.tools.build import run_build

        metrics = MetricsOptions(**given_values(args, MetricsOptions))
        if metrics.metrics_port:
            from shardkit.metrics import start_metrics_server
            start_metrics_server(metrics.metrics_port, addr=metrics.metrics_address)
        config = config_from_args(args)
        return config, run_build(config)

    return run_pipeline_command("shardkit build", build)


def run_pipeline_command(tool: str, run) -> int:
    """Run one command of the build pipeline (`build`, `convert`): `run()` returns (config, BuildResult).
    Bad input and configuration errors are one line naming the command (exit 2 for a `ValueError`, the
    user's mistake; 1 for bad records under --on-error fail and storage errors); the summary goes to stderr."""
    _configure_logging()
    from shardkit.tools.build import BuildInputError, print_summary

    try:
        config, result = run()
    except BuildInputError as err:
        print(f"{tool}: bad input: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # the user's mistake: an option, or a source that is not what it claims
        print(f"{tool}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # FileExistsError is one
        print(f"{tool}: error: {err}", file=sys.stderr)
        return 1
    if result.status == "done":
        print(f"{tool}: {config.output} already holds this build "
              f"({result.manifest.num_samples:,} samples in {len(result.manifest.shards)} shards); nothing to do",
              file=sys.stderr)
        return 0
    print_summary(result.report, sys.stderr)
    return 0


def run_tokenizer_train(namespace: Namespace) -> int:
    _configure_logging()
    from shardkit.tools.tokenizer_training import train_from_inputs

    args = TokenizerTrainOptions(**given_values(namespace, TokenizerTrainOptions))
    try:
        info = train_from_inputs(list(args.inputs), vocab_size=args.vocab_size, output=args.output,
                                 text_field=args.text_field, txt_mode=args.txt_mode,
                                 min_frequency=args.min_frequency, max_documents=args.max_documents)
    except (ValueError, OSError) as err:
        print(f"shardkit tokenizer train: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {info['vocab_size']:,} tokens trained on {info['documents']:,} documents "
          f"({info['rejected']:,} rejected)", file=sys.stderr)
    return 0
