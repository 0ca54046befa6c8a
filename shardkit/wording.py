"""Errors in the caller's language: the same option is `--seq-len` on a command line and `seq_len=` in Python (core:
the text layer words its errors with it, the CLI and the trainer mark their processes).

The text layer is shared by `shardkit build` (a command) and the raw-text `StreamingDataset` (a Python API), and its
messages name the option to change. They say it the Python way unless a command line runs: the CLI marks its
process, and the processes it starts inherit the mark (`SHARDKIT_WORDING=cli`), so a build's worker words its
errors as the command does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

WORDING_ENV = "SHARDKIT_WORDING"


def on_command_line() -> bool:
    return os.environ.get(WORDING_ENV) == "cli"


def option(name: str) -> str:
    """`--seq-len` on a command line, `seq_len=` in Python (`name` in Python's spelling)."""
    return f"--{name.replace('_', '-')}" if on_command_line() else f"{name}="


def setting(name: str, value: object) -> str:
    """An option set to `value`: `--lanes 32` on a command line, `lanes=32` in Python."""
    return f"{option(name)} {value}" if on_command_line() else f"{option(name)}{value!r}"


def inputs_name() -> str:
    """What the inputs are called: the command's INPUT arguments, the dataset's `inputs`."""
    return "INPUT" if on_command_line() else "inputs"


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Word errors for a command line while the block runs (the CLI's entry point), and in what it starts."""
    before = os.environ.get(WORDING_ENV)
    os.environ[WORDING_ENV] = "cli"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WORDING_ENV, None)
        else:
            os.environ[WORDING_ENV] = before
