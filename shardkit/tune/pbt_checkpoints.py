"""Where PBT members' checkpoints live: a root shared by every tuner of the population (`--checkpoint-root`).

Each member's round writes its checkpoint under `ROOT/member_MMM/round_RRR/step_SSSSSSSS`, and the next round
of any member, on any host, resumes from the name the study records: its own last checkpoint, or, after an
exploit, the source member's. A checkpoint is never modified after its round, so readers need no lock.

A local root (a directory, `file://`, or a shared filesystem mounted on every host) is written and read by
the trainer in place. Any other fsspec URL (`s3://...`) is staged: the trainer writes into the member's
local run directory, the tuner uploads the complete checkpoint (its completion marker last, so a reader never
takes a partial upload for a checkpoint), and a round that resumes from it downloads it first. Checkpoints
are always loaded by the trainer, with `weights_only` tensors and a restricted reader for DCP's metadata.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from shardkit.options import parse_storage_options
from shardkit.storage import Storage
from shardkit.train.checkpoint import MARKER_NAME, find_latest

logger = logging.getLogger(__name__)


class CheckpointRoot:
    """The shared checkpoint root of one population.

    Args:
        url: a directory or fsspec URL.
        storage_options: JSON of the fsspec options (credentials) for a remote root, as `--storage-options`.
    """

    def __init__(self, url: str, storage_options: str | None = None):
        self.storage = Storage(url, parse_storage_options(storage_options))

    @staticmethod
    def round_name(member: int, round_index: int) -> str:
        return f"member_{member:03d}/round_{round_index:03d}"

    def directory(self, member: int, round_index: int, run_dir: Path) -> Path:
        """The local directory the trainer saves the member's round into."""
        if self.storage.is_local:
            return Path(self.storage.path(self.round_name(member, round_index)))
        return run_dir / "checkpoints" / f"round_{round_index:03d}"

    def publish(self, member: int, round_index: int, directory: Path) -> str | None:
        """The name (relative to the root) of the round's last complete checkpoint in `directory`, uploaded
        first when the root is remote; None when the trainer saved none."""
        checkpoint = find_latest(directory)
        if checkpoint is None:
            return None
        name = f"{self.round_name(member, round_index)}/{checkpoint.name}"
        if not self.storage.is_local:
            files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
            # The marker goes last: a checkpoint without it is incomplete to every reader.
            for path in sorted(files, key=lambda p: p.name == MARKER_NAME):
                self.storage.write_bytes(f"{name}/{path.relative_to(checkpoint).as_posix()}", path.read_bytes())
        return name

    def local(self, name: str, run_dir: Path) -> Path:
        """A local directory holding checkpoint `name` (a name the study recorded), downloaded into
        `run_dir/incoming` when the root is remote."""
        if self.storage.is_local:
            return Path(self.storage.path(name))
        self.storage.path(name)  # validates the name: never a path outside the root
        target = run_dir / "incoming" / name
        if (target / MARKER_NAME).is_file():
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        # The checkpoint's own prefix: its listing stays one checkpoint's files however many the root holds.
        source = Storage(f"{self.storage.url.rstrip('/')}/{name}", self.storage.storage_options,
                         retry=self.storage.retry)
        names = source.list_names()
        if MARKER_NAME not in names:
            raise FileNotFoundError(f"PBT: checkpoint {self.storage.url_of(name)} is incomplete or missing "
                                    "(no completion marker); was --checkpoint-root changed between tuners?")
        for item in names:
            local = partial / item
            local.parent.mkdir(parents=True, exist_ok=True)
            source.download(item, str(local))
        os.replace(partial, target)
        logger.info("PBT: downloaded checkpoint %s", self.storage.url_of(name))
        return target
