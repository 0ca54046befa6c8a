"""`shardkit train` (one process; use torchrun for several) and `shardkit plot RUN_DIR`.

Light imports only: torch loads when a command runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardkit.options import Namespace, add_command, given_values, option


@dataclass(frozen=True, kw_only=True)
class PlotOptions:
    run_dir: str = option(help="a training run directory (holds metrics.jsonl)", positional=True, metavar="RUN_DIR")
    output: str | None = option(None, "PNG path", flags=("--output", "-o"), cli_default="RUN_DIR/curves.png")


def register(subparsers: Any) -> None:
    from shardkit.train.options import add_train_arguments

    train = add_command(subparsers, "train", _train,
                        help="pre-train a GPT-style model on a shardkit dataset (one process)",
                        usage="shardkit train --data URL [--config FILE] [--OPTION VALUE ...]",
                        description="Pre-train a GPT-style model on a shardkit dataset in this process. For several "
                                    "processes or GPUs run 'torchrun --nproc_per_node N -m shardkit.train' with the "
                                    "same options.")
    add_train_arguments(train)
    add_command(subparsers, "plot", _plot, options=[PlotOptions],
                help="plot a run's loss and throughput curves to a PNG",
                description="Read RUN_DIR/metrics.jsonl and write RUN_DIR/curves.png (training and eval loss, "
                            "tokens/s per step).")


def _train(args: Namespace) -> int:
    import sys

    from shardkit.train.__main__ import run
    from shardkit.train.options import config_from_args

    try:
        config = config_from_args(args)
    except (ValueError, OSError) as err:
        print(f"shardkit train: error: {err}", file=sys.stderr)
        return 2
    return run(config)


def _plot(namespace: Namespace) -> int:
    import sys

    from shardkit.train.plot import plot_run

    args = PlotOptions(**given_values(namespace, PlotOptions))
    try:
        path = plot_run(args.run_dir, output=args.output)
    except (OSError, ValueError) as err:
        print(f"shardkit plot: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
