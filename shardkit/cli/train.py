"""`shardkit train` (one process; use torchrun for several) and `shardkit plot RUN_DIR`.

Light imports only: torch loads when a command runs.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from shardkit.train.options import add_train_arguments

    train = subparsers.add_parser(
        "train", help="pre-train a GPT-style model on a shardkit dataset (one process)",
        usage="shardkit train --data URL [--config FILE] [--OPTION VALUE ...]",
        description="Pre-train a GPT-style model on a shardkit dataset in this process. For several "
                    "processes or GPUs run 'torchrun --nproc_per_node N -m shardkit.train' with the same options.")
    add_train_arguments(train)
    train.set_defaults(func=_train)

    plot = subparsers.add_parser("plot", help="plot a run's loss and throughput curves to a PNG",
                                 description="Read RUN_DIR/metrics.jsonl and write RUN_DIR/curves.png "
                                             "(training and eval loss, tokens/s per step).")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (holds metrics.jsonl)")
    plot.add_argument("--output", "-o", default=None, help="PNG path (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_plot)


def _train(args: argparse.Namespace) -> int:
    import sys

    from shardkit.train.__main__ import run
    from shardkit.train.options import config_from_args

    try:
        config = config_from_args(args)
    except (ValueError, OSError) as err:
        print(f"shardkit train: error: {err}", file=sys.stderr)
        return 2
    return run(config)


def _plot(args: argparse.Namespace) -> int:
    import sys

    from shardkit.train.plot import plot_run

    try:
        path = plot_run(args.run_dir, output=args.output)
    except (OSError, ValueError) as err:
        print(f"shardkit plot: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
