"""The `shardkit` command line: one entry point, subcommands contributed by each part.

Each provider module exposes `register(subparsers)` and keeps its top-level imports light (the option
machine of `shardkit.options` and its own option dataclasses): heavy modules load inside the command's function, so `shardkit --help` and
`shardkit inspect` start fast.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from shardkit import __version__
from shardkit.options import OptionParser, add_subcommands, command_parser
from shardkit.redaction import redacted_output

# Dataset commands (inspect, verify, cat), lineage (trace), the build side (build, tokenizer), the trainer (train, plot),
# and the end-to-end demo.
COMMAND_PROVIDERS = (
    "shardkit.cli.dataset",
    "shardkit.cli.trace",
    "shardkit.cli.build",
    "shardkit.cli.convert",
    "shardkit.cli.train",
    "shardkit.cli.tune",
    "shardkit.cli.demo",
)


def build_parser() -> OptionParser:
    parser = command_parser(
        prog="shardkit", version=f"shardkit {__version__}",
        description="Build tokenized shard datasets from raw corpora, inspect and verify them, "
                    "and train GPT-style models on them.",
        epilog="Run 'shardkit COMMAND --help' for the options of one command. Options are spelled in kebab-case "
               "(--cache-limit); the snake_case spelling (--cache_limit) is accepted as an alias.",  # respell: keep
    )
    subparsers = add_subcommands(parser)
    for module_name in COMMAND_PROVIDERS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:  # a real missing dependency inside the module: show it
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything printed, by shardkit or by a library it calls, masks the credentials of the URLs given.
    with redacted_output(*argv):
        parser = build_parser()
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        try:
            return int(args.func(args) or 0)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
