"""The loader state as a JSON file inside a framework's own checkpoint directory (transformers' `checkpoint-N`,
accelerate's `save_state` folders): written once, atomically, read by every rank; never pickled."""

from __future__ import annotations

import json
import os
from typing import Any

from shardkit.storage import write_file_atomic

LOADER_STATE_FILE = "shardkit_loader.json"


def save_loader_state(loader: Any, folder: str, *, write: bool) -> None:
    """Write `loader.state_dict()` into `folder` where `write` (the state is global: identical on every rank, so
    one process writes it). Every rank calls it: a raw-text loader's state gathers every rank's lane cursors."""
    state = loader.state_dict()
    if write:
        write_file_atomic(os.path.join(folder, LOADER_STATE_FILE), json.dumps(state).encode())


def load_loader_state(loader: Any, folder: str, *, saved_by: str) -> None:
    """Restore `loader` from the state file in `folder`.

    Raises:
        ValueError: `folder` holds no state file (saved without `saved_by`, or its save was cut short).
    """
    path = os.path.join(folder, LOADER_STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{folder} has no {LOADER_STATE_FILE}: it was not saved by {saved_by} (or its save was "
                         "cut short); resume from an earlier checkpoint")
    with open(path) as f:
        loader.load_state_dict(json.load(f))
