"""The storage writer and planner that DCP's checkpoint writer process (`--async-save`, the process writer)
writes with.

They are handed to that process with each save, so this module stays small: the process imports it."""

from __future__ import annotations

import io
import logging
import multiprocessing
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItemType

# The one key of a state staged by `checkpoint_staging.FlatStager`: its buffers, layout and non-tensor values.
FLAT_STATE_KEY = "__shardkit_flat_state__"


class WriterProcessFileSystemWriter(FileSystemWriter):
    """DCP's file writer, which first quiets DCP's writer process: that process logs three INFO lines per save
    to the trainer's stderr (DCP sets its root logger to INFO); its warnings and errors still show."""

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if multiprocessing.parent_process() is not None:  # in DCP's writer process, never in a trainer
            logging.getLogger().setLevel(logging.WARNING)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


def expand_flat_state(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict a `FlatStager` staged: nested dicts again, each tensor a view of its dtype's buffer.
    A state not staged that way is returned as it is."""
    flat = state.get(FLAT_STATE_KEY)
    if flat is None:
        return state
    expanded: dict[str, Any] = {}
    buffers = flat["buffers"]
    for path, dtype, offset, shape in flat["layout"]:
        count = int(torch.Size(shape).numel())
        _set(expanded, path, buffers[dtype][offset:offset + count].view(shape))
    for path, value in flat["values"]:
        _set(expanded, path, value)
    return expanded


def _set(state: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        state = state.setdefault(key, {})
    state[path[-1]] = value


class ExpandingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which first expands a state staged by `FlatStager` (in the writer process):
    the checkpoint holds the same entries as a synchronous save of the state."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(expand_flat_state(state_dict), storage_meta, is_coordinator)

    def transform_object(self, write_item, object: Any):
        """A non-tensor entry (an optimizer setting of each parameter, a JSON text) serialized in torch's legacy
        format: for values of a few bytes it costs ~20 us against ~130 us for the zip format DCP uses, and a
        save holds hundreds of them (each parameter's copy of its group's settings). `torch.load` reads both
        formats, with `weights_only=True` as every checkpoint load here."""
        if write_item.type == WriteItemType.BYTE_IO:
            data = io.BytesIO()
            torch.save(object, data, _use_new_zipfile_serialization=False)
            return data
        return super().transform_object(write_item, object)
