"""The storage writer that DCP's checkpoint writer process (`--async-save`, the process writer) writes with.

It is handed to that process with each save, so this module stays small: the process imports it."""

from __future__ import annotations

import logging
import multiprocessing

from torch.distributed.checkpoint.filesystem import FileSystemWriter


class WriterProcessFileSystemWriter(FileSystemWriter):
    """DCP's file writer, which first quiets DCP's writer process: that process logs three INFO lines per save
    to the trainer's stderr (DCP sets its root logger to INFO); its warnings and errors still show."""

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if multiprocessing.parent_process() is not None:  # in DCP's writer process, never in a trainer
            logging.getLogger().setLevel(logging.WARNING)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
