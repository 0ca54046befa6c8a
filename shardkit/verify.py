"""Re-check a dataset against its manifest: every shard's size, SHA-256, structure and counts.

`verify_shard` answers one shard with a reason string (or None when it is good); `verify_dataset`
runs it over all shards in a thread pool (reading, hashing and zstd release the GIL) and returns the
problems in manifest order, so a caller can list *every* bad shard, not just the first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats.fetch import read_shard
from shardkit.formats.reader import ShardReader
from shardkit.formats.sample import ShardArrays
from shardkit.manifest import Manifest, ShardInfo
from shardkit.storage import Storage, atomic_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardProblem:
    """A shard that failed verification and why."""

    shard: str
    reason: str


def check_contents(arrays: ShardArrays, shard: ShardInfo, manifest: Manifest) -> None:
    """Check what the hash cannot: decoded values agree with the manifest's promises (token ids within the
    vocabulary are checked on every decode, by `check_decoded`, for the loader as well).

    Raises:
        CorruptShardError: a sample of the wrong length, or a provenance source id that names no input.
    """
    lengths = np.diff(arrays.sample_offsets)
    if lengths.size:
        if manifest.sample_length is not None and np.any(lengths != manifest.sample_length):
            i = int(np.flatnonzero(lengths != manifest.sample_length)[0])
            raise CorruptShardError(shard.name, f"sample {i} holds {int(lengths[i])} tokens; seq_len {manifest.seq_len} "
                                                f"with packing {manifest.packing!r} needs {manifest.sample_length}")
        if manifest.max_sample_tokens is not None and int(lengths.max()) > manifest.max_sample_tokens:
            i = int(np.argmax(lengths))
            raise CorruptShardError(shard.name, f"sample {i} holds {int(lengths[i])} tokens, more than "
                                                f"max_sample_tokens {manifest.max_sample_tokens}")
    if arrays.has_doc_boundaries and manifest.sources and arrays.doc_source.size:
        top = int(arrays.doc_source.max())
        if top >= len(manifest.sources):
            raise CorruptShardError(shard.name, f"doc_source {top} names no input (the manifest lists "
                                                f"{len(manifest.sources)} sources)")


def verify_shard(storage: Storage, manifest: Manifest, shard: ShardInfo) -> str | None:
    """Re-read one shard and check it; returns None when good, else the reason it is bad.

    The read is the loader's own (`read_shard`): bytes that fail the manifest's size or SHA-256 are
    read once more, so one bad transfer is not reported as a corrupt shard.
    """
    try:
        reader = read_shard(storage, shard, decode=lambda data: ShardReader.from_bytes(
            data, shard=shard, manifest=manifest, verify=False))
        check_contents(reader.arrays, shard, manifest)
    except FileNotFoundError:
        return f"missing: {storage.url_of(shard.name)} does not exist"
    except CorruptShardError as err:
        return err.reason
    except OSError as err:  # StorageError after retries: the message names the URL and the cause
        return f"unreadable: {err}"
    return None


def verify_dataset(storage: Storage, manifest: Manifest, *, jobs: int = 1,
                   on_shard_checked: Callable[[ShardInfo, str | None], None] | None = None) -> list[ShardProblem]:
    """Verify every shard of `manifest`; returns the problems in manifest order (empty when all good).

    Args:
        storage: the dataset prefix.
        manifest: its manifest.
        jobs: shards checked at once (threads).
        on_shard_checked: called after each shard with its reason (None when good), e.g. to advance a
            progress bar. Called from the caller's thread.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    reasons: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(verify_shard, storage, manifest, shard): shard for shard in manifest.shards}
        # Report in completion order (the progress bar moves steadily), collect in manifest order.
        for future in as_completed(futures):
            shard = futures[future]
            reason = future.result()
            if reason is not None:
                reasons[shard.name] = reason
                logger.debug("shard %s is bad: %s", shard.name, reason)
            if on_shard_checked is not None:
                on_shard_checked(shard, reason)
    return [ShardProblem(s.name, reasons[s.name]) for s in manifest.shards if s.name in reasons]


# -- quarantine lists -----------------------------------------------------------------------------

QUARANTINE_KIND = "shardkit.quarantine"
QUARANTINE_VERSION = 1


def write_quarantine_list(path: str, storage: Storage, manifest: Manifest, problems: list[ShardProblem]) -> None:
    """Write the bad shards as a quarantine list that a loader takes up front (`quarantine_list=`).

    Shards are named by manifest name *and* SHA-256, so a list never applies to a rebuilt shard of the
    same name, and by URL for people reading it. The file is replaced atomically.
    """
    import json

    by_name = {shard.name: shard for shard in manifest.shards}
    shards = [{"name": p.shard, "sha256": by_name[p.shard].sha256, "samples": by_name[p.shard].samples,
               "url": storage.url_of(p.shard),
               "reason": p.reason} for p in problems]
    document = {"kind": QUARANTINE_KIND, "version": QUARANTINE_VERSION, "dataset": storage.display_url,
                "shards": shards}
    with atomic_path(path) as temporary, open(temporary, "x") as fh:
        json.dump(document, fh, indent=1)
        fh.write("\n")


def read_quarantine_list(path: str) -> list[tuple[str, str]]:
    """(shard name, SHA-256) of each shard a quarantine list names.

    Raises:
        ValueError: the file is missing, not JSON, or not a quarantine list (the message names it).
    """
    import json

    try:
        with open(path) as fh:
            document = json.load(fh)
    except OSError as err:
        raise ValueError(f"quarantine_list {path}: cannot read it ({err.strerror or err})") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"quarantine_list {path}: not JSON (line {err.lineno}: {err.msg}); write it with "
                         "`shardkit verify URL --quarantine-list FILE`") from err
    if not isinstance(document, dict) or document.get("kind") != QUARANTINE_KIND:
        raise ValueError(f"quarantine_list {path}: not a shardkit quarantine list (kind must be {QUARANTINE_KIND!r})")
    if document.get("version") != QUARANTINE_VERSION:
        raise ValueError(f"quarantine_list {path}: version {document.get('version')!r} is not supported "
                         f"(this shardkit reads version {QUARANTINE_VERSION})")
    entries = document.get("shards")
    if not isinstance(entries, list):
        raise ValueError(f"quarantine_list {path}: 'shards' must be a list")
    named = []
    for number, entry in enumerate(entries, start=1):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("sha256"), str)):
            raise ValueError(f"quarantine_list {path}: shard entry {number} lacks a 'name' and 'sha256' string")
        named.append((entry["name"], entry["sha256"]))
    return named
