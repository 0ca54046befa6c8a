"""`shardkit build` and `shardkit tokenizer train`: argument parsing only (heavy imports happen inside)."""

from __future__ import annotations

import argparse
import sys

from shardkit.cli.dataset import parse_storage_options

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


def _add_build(subparsers) -> None:
    from shardkit.options import add_dataclass_options
    from shardkit.tools.config import BuildConfig

    p = subparsers.add_parser(
        "build", help="tokenize and pack corpora into shards + a manifest",
        description="Tokenize raw corpora, pack the tokens into fixed-length samples and write zstd-compressed "
                    "shards and a manifest (shardkit.json) that the loaders stream. Every option is a field of "
                    "shardkit.tools.config.BuildConfig.",
        epilog=BUILD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Plain flags (`--overwrite`, `--no-progress`): a `--flag [BOOL]` would swallow a following INPUT.
    add_dataclass_options(p, BuildConfig, bool_values=False)
    # Not a BuildConfig field: where metrics are served changes nothing in the output or its fingerprint.
    p.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics while the build runs (0: off)")
    p.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics endpoint listens on (default: 127.0.0.1, this machine only; 0.0.0.0 "
                        "for every interface, see docs/OBSERVABILITY.md)")
    p.set_defaults(func=run_build_command)


def _add_tokenizer(subparsers) -> None:
    p = subparsers.add_parser("tokenizer", help="tokenizer tools (train a byte-level BPE)",
                              description="Tokenizer tools.")
    sub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    train = sub.add_parser(
        "train", help="train a byte-level BPE on corpora",
        description="Train a byte-level BPE with HF tokenizers on the documents of INPUT (same input types as "
                    "'shardkit build') and save it as tokenizer.json, usable as 'shardkit build --tokenizer FILE'. "
                    "<|endoftext|> is added as the EOS token (id 0).",
        epilog="example:\n  shardkit tokenizer train corpus/*.jsonl.zst --vocab-size 32000 --output tok/tokenizer.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories, globs or fsspec URLs")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="vocabulary size including the 256 byte symbols and specials, e.g. 32000")
    train.add_argument("--output", required=True, metavar="FILE", help="tokenizer.json to write")
    train.add_argument("--text-field", default="text", metavar="NAME", help="JSON key / Parquet column. Default: text")
    train.add_argument("--txt-mode", choices=("file", "paragraph"), default="file",
                       help="a .txt document is the whole file or each paragraph. Default: file")
    train.add_argument("--min-frequency", type=int, default=2, metavar="N",
                       help="pairs seen fewer times are not merged. Default: 2")
    train.add_argument("--max-documents", type=int, default=None, metavar="N",
                       help="train on the first N accepted documents only. Default: all")
    train.set_defaults(func=run_tokenizer_train)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def register(subparsers) -> None:
    _add_build(subparsers)
    _add_tokenizer(subparsers)


def _configure_logging() -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def config_from_args(args: argparse.Namespace):
    """The `BuildConfig` the parsed options describe (options not given keep the dataclass defaults)."""
    from shardkit.options import given_values
    from shardkit.tools.config import BuildConfig

    given = given_values(args, BuildConfig)
    if "storage_options" in given:
        given["storage_options"] = parse_storage_options(given["storage_options"])
    return BuildConfig(**given)


def run_build_command(args: argparse.Namespace) -> int:
    def build():
        from shardkit.tools.build import run_build

        if args.metrics_port:
            from shardkit.metrics import start_metrics_server
            start_metrics_server(args.metrics_port, addr=args.metrics_address)
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


def run_tokenizer_train(args: argparse.Namespace) -> int:
    _configure_logging()
    from shardkit.tools.tokenizer_training import train_from_inputs

    try:
        info = train_from_inputs(args.inputs, vocab_size=args.vocab_size, output=args.output,
                                 text_field=args.text_field, txt_mode=args.txt_mode,
                                 min_frequency=args.min_frequency, max_documents=args.max_documents)
    except (ValueError, OSError) as err:
        print(f"shardkit tokenizer train: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {info['vocab_size']:,} tokens trained on {info['documents']:,} documents "
          f"({info['rejected']:,} rejected)", file=sys.stderr)
    return 0
