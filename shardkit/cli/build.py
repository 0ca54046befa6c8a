"""`shardkit build` and `shardkit tokenizer train`: argument parsing only (heavy imports happen inside)."""

from __future__ import annotations

import argparse
import sys

from shardkit.cli.dataset import STORAGE_OPTION_HELP, parse_storage_options

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
    p = subparsers.add_parser(
        "build", help="tokenize and pack corpora into shards + a manifest",
        description="Tokenize raw corpora, pack the tokens into fixed-length samples and write zstd-compressed "
                    "shards and a manifest (shardkit.json) that the loaders stream.",
        epilog=BUILD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, directories (searched recursively), globs or fsspec URLs (s3://...). Recognised by "
                        "name: .jsonl, .jsonl.gz, .jsonl.zst (one JSON object per line), .parquet, .txt. "
                        "Example: 'corpus/*.jsonl.zst'")
    p.add_argument("--output", required=True, metavar="URL",
                   help="dataset prefix to write: a local directory or any fsspec URL, e.g. s3://bucket/datasets/web")
    p.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   dest="storage_option", help=STORAGE_OPTION_HELP.replace("the dataset's filesystem",
                                                                           "the inputs' and the output's filesystems"))
    p.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="'byte' (UTF-8 bytes), a tokenizer.json or HF tokenizer directory, a .tiktoken file, "
                        "tiktoken:NAME (e.g. tiktoken:cl100k_base; honours TIKTOKEN_CACHE_DIR) or a sentencepiece "
                        ".model file")
    p.add_argument("--seq-len", type=int, required=True, metavar="N",
                   help="training context length; packed samples hold N+1 tokens (input and shifted target). "
                        "With --pack none, the longest sample is N+1 tokens. Example: --seq-len 2048")
    p.add_argument("--format", dest="shard_format", choices=("tar", "arrow"), default="arrow",
                   help="shard format: 'arrow' (Arrow IPC with zstd buffers: compact, ~1.5x smaller than raw "
                        "tokens, fastest to decode) or 'tar' (per-sample zstd .npy members, readable by "
                        "webdataset and tar; 512-byte headers per member make it larger). Default: arrow")
    p.add_argument("--pack", dest="packing", choices=("concat", "bestfit", "none"), default="concat",
                   help="'concat': join documents with EOS and cut windows (the last partial window is padded and "
                        "reported); 'bestfit': best-fit-decreasing packing of whole documents, splitting only "
                        "documents longer than a window (padding fraction and split count are reported); 'none': "
                        "one document per sample, split at N+1 tokens. Default: concat")
    p.add_argument("--shard-size", default="64MB", metavar="SIZE",
                   help="uncompressed payload per shard: 64MB (decimal KB/MB/GB), 256MiB (binary KiB/MiB/GiB) or "
                        "bytes. Default: 64MB")
    p.add_argument("--compression", default="zstd", metavar="zstd[:LEVEL]",
                   help="shard compression: zstd with an optional level 1-22, e.g. zstd:9. Default: zstd (level 3)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="parallel tokenizer processes (or Ray tasks in flight). Default: the cores available to "
                        "this process. The output does not depend on it")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="'local': worker processes on this machine; 'ray': Ray tasks (see --ray-address). "
                        "Same output either way. Default: local")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="Ray cluster to run on with --executor ray, e.g. 'auto' or ray://head:10001. "
                        "Default: start a local Ray instance with --workers CPUs")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSON key (JSONL) or column (Parquet) that holds the text. Default: text")
    p.add_argument("--txt-mode", choices=("file", "paragraph"), default="file",
                   help="what one document of a .txt file is: 'file' (the whole file) or 'paragraph' (text "
                        "separated by one or more blank lines). Default: file")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="bad input (malformed JSON, missing or non-string text, invalid UTF-8, empty or enormous "
                        "documents, unreadable or truncated files): 'skip' counts it and lists examples in the "
                        "report and summary; 'fail' stops with the file and line and exits non-zero. Default: skip")
    p.add_argument("--max-doc-chars", type=int, default=10_000_000, metavar="N",
                   help="documents with more characters are rejected as enormous. Default: 10000000")
    p.add_argument("--eos-id", default="auto", metavar="ID|auto|none",
                   help="token id placed after every document: 'auto' (the tokenizer's EOS, e.g. <|endoftext|>), "
                        "an integer, or 'none'. Default: auto")
    p.add_argument("--bos-id", default="none", metavar="ID|auto|none",
                   help="token id placed before every document: 'none', 'auto' (the tokenizer's BOS) or an "
                        "integer. Default: none")
    p.add_argument("--bestfit-buffer", type=int, default=2048, metavar="DOCS",
                   help="with --pack bestfit: documents sorted and placed together (bounds memory). Default: 2048")
    p.add_argument("--overwrite", action="store_true",
                   help="replace another build's shards, manifest and state in --output (otherwise refused). "
                        "Rerunning the same command never needs it: it resumes or does nothing")
    p.add_argument("--unit-size", default="1MiB", metavar="SIZE",
                   help="input bytes per work unit handed to a worker (resumption restarts at most one unit). "
                        "Default: 1MiB")
    p.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    p.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics while the build runs (0: off)")
    p.add_argument("--report-examples", type=int, default=20, metavar="N",
                   help="rejected documents listed by file and line in the report. Default: 20")
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


def run_build_command(args: argparse.Namespace) -> int:
    _configure_logging()
    from shardkit.tools.build import BuildConfig, BuildInputError, parse_compression, parse_size, print_summary, run_build

    try:
        if args.metrics_port:
            from shardkit.metrics import start_metrics_server
            start_metrics_server(args.metrics_port)
        config = BuildConfig(
            inputs=tuple(args.inputs), output=args.output, tokenizer=args.tokenizer, seq_len=args.seq_len,
            shard_format=args.shard_format, packing=args.packing, shard_size=parse_size(args.shard_size),
            compression_level=parse_compression(args.compression), text_field=args.text_field,
            txt_mode=args.txt_mode, on_error=args.on_error, eos_id=args.eos_id, bos_id=args.bos_id,
            max_doc_chars=args.max_doc_chars, bestfit_buffer=args.bestfit_buffer, workers=args.workers,
            executor=args.executor, ray_address=args.ray_address, overwrite=args.overwrite,
            unit_bytes=parse_size(args.unit_size, option="--unit-size"), max_examples=args.report_examples,
            progress=not args.no_progress, storage_options=parse_storage_options(args.storage_option))
        result = run_build(config)
    except BuildInputError as err:
        print(f"shardkit build: bad input: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:  # FileExistsError is an OSError
        print(f"shardkit build: error: {err}", file=sys.stderr)
        return 1
    if result.status == "done":
        print(f"shardkit build: {args.output} already holds this build "
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
