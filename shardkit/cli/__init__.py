"""The `shardkit` command line, apart from the core: `main.py` dispatches, one module per group of commands.

`dataset.py` (inspect, verify, cat), `build.py` (build, tokenizer train), `train.py` (train, plot), `demo.py`.
Each keeps its top-level imports light; the heavy modules load inside the command that needs them.
"""

from shardkit.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
