"""`torchrun --nproc_per_node N -m shardkit.train --data URL [--config FILE] [--key value ...]`.

Parse, build, train, close. Every rank runs this; rank 0 prints and writes the run directory.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import sys

# The storage options (they may hold credentials) when not given as --storage-options: an environment is
# readable only by its own user, a command line by every local user (`shardkit tune` passes them so).
STORAGE_OPTIONS_ENV = "SHARDKIT_STORAGE_OPTIONS"


def main(argv: list[str] | None = None) -> int:
    """The trainer; with SHARDKIT_WARM_START=1 (under torchrun, or with a node-wide server), in a process forked
    from a warm-start server (`shardkit.train.warm`). Only the process's own command line (`argv` None) is handed
    to a server: a program that calls `main(argv)` keeps the trainer in its process (the launcher exits with the
    worker's code, which would end the caller)."""
    from shardkit.train import warm

    if argv is not None:
        return run_trainer(list(argv))
    code = warm.launch(sys.argv[1:]) if warm.wanted() else None
    return run_trainer(sys.argv[1:]) if code is None else code


def run_trainer(argv: list[str]) -> int:
    """Parse `argv` and run the trainer in this process."""
    # A rank that dies of a signal (SIGABRT from a C++ thread left joinable, SIGSEGV in an extension) prints every
    # Python thread's stack first, so torchrun's failure report says where; the stacks hold names and line numbers,
    # never argument values, so they bypass the credential redaction safely.
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    from shardkit.redaction import redacted_output
    from shardkit.wording import command_line
    from shardkit.train.options import parse_train_args

    # every rank's messages mask the credentials of the URLs given, and name --options, not keywords
    with redacted_output(*argv), command_line():
        return run(parse_train_args(argv))


def run(config) -> int:
    """Build, train and close a run of `config` (a `TrainConfig`); returns the exit code."""
    from shardkit.train.loop import build, close, train

    secret = os.environ.get(STORAGE_OPTIONS_ENV)
    if secret and config.data.storage_options is None:
        try:
            config = dataclasses.replace(config, data=dataclasses.replace(config.data, storage_options=secret))
        except ValueError as err:
            print(f"error: {STORAGE_OPTIONS_ENV}: {err}", file=sys.stderr)
            return 2
    rank = int(os.environ.get("RANK", "0"))
    # This is the application's entry point, so it may configure logging: rank 0 informs, others warn.
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    state = None
    try:
        state = build(config)
        return train(state)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # fp16's loss scale gave up (TooManyOverflows): not a user's mistake
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        close(state)


if __name__ == "__main__":
    sys.exit(main())
