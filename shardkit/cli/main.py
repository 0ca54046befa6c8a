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
from shardkit.wording import command_line

# Each provider module and the commands it registers: dataset commands (inspect, verify, cat), lineage (trace),
# the build side (build, tokenizer; convert, export), the trainer (train, plot), the tuner, the end-to-end demo, the data service.
# A command line that names a command registers its provider alone: the trainer's and the tuner's options import
# their configurations (~40 ms), which `shardkit build` and `convert` never use; `--help`, `--version` and a
# mistyped command register them all.
COMMAND_PROVIDERS = {
    "shardkit.cli.dataset": ("inspect", "verify", "cat"),
    "shardkit.cli.trace": ("trace",),
    "shardkit.cli.build": ("build", "tokenizer"),
    "shardkit.cli.convert": ("convert", "export"),
    "shardkit.cli.train": ("train", "plot"),
    "shardkit.cli.tune": ("tune",),
    "shardkit.cli.demo": ("demo",),
    "shardkit.cli.serve": ("serve",),
}


def build_parser(argv: Sequence[str] = ()) -> OptionParser:
    """The `shardkit` parser; with the command line it will parse (`argv`), only the parser of the command it
    names (the top-level parser's own options, `--help` and `--version`, take no value, so the command is the
    first word that is not an option)."""
    parser = command_parser(
        prog="shardkit", version=f"shardkit {__version__}",
        description="Build tokenized shard datasets from raw corpora, inspect and verify them, "
                    "and train GPT-style models on them.",
        epilog="Run 'shardkit COMMAND --help' for the options of one command. Options are spelled in kebab-case "
               "(--cache-limit); the snake_case spelling (--cache_limit) is accepted as an alias.",  # respell: keep
    )
    subparsers = add_subcommands(parser)
    command = next((word for word in argv if not word.startswith("-")), None)
    providers = [name for name, commands in COMMAND_PROVIDERS.items() if command in commands] or COMMAND_PROVIDERS
    for module_name in providers:
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
    with redacted_output(*argv), command_line():  # errors name --options, not keywords
        parser = build_parser(argv)
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
