"""Build state in the output: the resume checkpoint, and the check that the output is ours to write.

The checkpoint `_build/checkpoint.npz` is rewritten (atomically) after every shard. It holds the
build's fingerprint, the shards written so far, and the state at the start of the work unit that
was being packed when the last shard was finished: unit position, packer state, counters and
samples emitted before that unit. Resuming restores that state, re-tokenizes from that unit (at
most one unit of repeated work) and drops the samples that are already in written shards; packing
is deterministic, so the regenerated stream is the one an uninterrupted build produces.
Arrays are stored with numpy's npz format and read with `allow_pickle=False`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import asdict
from typing import Any

import numpy as np

from shardkit.manifest import MANIFEST_NAME, RESERVED_NAMES, Manifest, ManifestError, ShardInfo, load_manifest
from shardkit.storage import TEMPORARY_MARK, Storage

logger = logging.getLogger(__name__)

STATE_DIR = "_build"
CHECKPOINT_NAME = f"{STATE_DIR}/checkpoint.npz"
REPORT_NAME = "build_report.json"
CHECKPOINT_VERSION = 1
_SHARD_PREFIX = "shard-"
_HINT = "pass --overwrite to replace it, or choose another --output"  # ends every refusal of the output


def fingerprint(build: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of everything that decides the output."""
    return hashlib.sha256(json.dumps(build, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_checkpoint(storage: Storage, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Write the checkpoint atomically: JSON metadata plus named arrays in one npz."""
    if "__meta__" in arrays:
        raise ValueError("array name __meta__ is reserved")
    buffer = io.BytesIO()
    payload = {"__meta__": np.frombuffer(json.dumps({**meta, "version": CHECKPOINT_VERSION}).encode(), dtype=np.uint8)}
    payload.update({f"a_{k}": np.ascontiguousarray(v) for k, v in arrays.items()})
    np.savez(buffer, **payload)
    storage.write_bytes(CHECKPOINT_NAME, buffer.getvalue())


def load_checkpoint(storage: Storage) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """The checkpoint's (metadata, arrays), or None when there is none or it is unreadable."""
    if not storage.exists(CHECKPOINT_NAME):
        return None
    try:
        with np.load(io.BytesIO(storage.read_bytes(CHECKPOINT_NAME)), allow_pickle=False) as data:
            meta = json.loads(bytes(data["__meta__"]).decode())
            arrays = {k[2:]: data[k] for k in data.files if k.startswith("a_")}
    except (ValueError, KeyError, OSError) as err:
        logger.warning("ignoring unreadable checkpoint %s: %s", storage.url_of(CHECKPOINT_NAME), err)
        return None
    if meta.get("version") != CHECKPOINT_VERSION:
        return None
    return meta, arrays


def shards_from_meta(meta: dict[str, Any]) -> list[ShardInfo]:
    return [ShardInfo(**s) for s in meta["shards"]]


def shards_to_meta(shards: list[ShardInfo]) -> list[dict[str, Any]]:
    return [asdict(s) for s in shards]


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two build records, naming each changed, added or removed input file."""
    keys = sorted(set(old) | set(new))
    differ = [k for k in keys if old.get(k) != new.get(k) and k not in ("fingerprint", "documents", "inputs")]
    before = {f.get("url"): f for f in old.get("inputs") or () if isinstance(f, dict)}
    after = {f.get("url"): f for f in new.get("inputs") or () if isinstance(f, dict)}
    for url, file in after.items():
        if url not in before:
            differ.append(f"input {url} added")
        elif before[url] != file:
            if before[url].get("bytes") != file.get("bytes"):
                differ.append(f"input {url} changed (size)")
            elif before[url].get("sha256") is None:
                differ.append(f"input {url} (recorded without a content hash, by an older shardkit)")
            else:
                differ.append(f"input {url} changed (content)")
    differ += [f"input {url} removed" for url in before if url not in after]
    if not differ and [f.get("url") for f in old.get("inputs") or ()] != [f.get("url") for f in new.get("inputs") or ()]:
        differ.append("order of the inputs")
    return differ


def _ours(name: str, shards: set[str] | None = None) -> bool:
    """Whether shardkit wrote `name`: the manifest and its companions, the report, the build state, and the shards
    named in `shards` (what the previous run recorded; None: any `shard-*` name, for the leftovers of this run)."""
    # RESERVED_NAMES: the manifest and what `write_manifest` writes beside it (the binary index, the shards' block
    # indexes), which an --overwrite removes with it.
    if name in (*RESERVED_NAMES, REPORT_NAME) or name.startswith(f"{STATE_DIR}/"):
        return True
    return name in shards if shards is not None else (name.startswith(_SHARD_PREFIX) and "/" not in name)


def _recorded_shards(storage: Storage, links: set[str]) -> set[str]:
    """The shards the previous run's records name: its manifest's and its checkpoint's (a run stopped before
    its manifest). `--overwrite` removes these (and their temporaries) and nothing else: a user's
    `shard-notes.csv` in the output is not ours to delete. Records behind a link are not read."""
    names: set[str] = set()
    try:
        if MANIFEST_NAME not in links:
            names.update(shard.name for shard in load_manifest(storage).shards)
    except (ManifestError, OSError):
        pass  # no manifest (or not one shardkit can read): it names nothing
    checkpoint = load_checkpoint(storage) if STATE_DIR not in links and CHECKPOINT_NAME not in links else None
    if checkpoint is not None:
        names.update(shard.get("name") for shard in checkpoint[0].get("shards") or ()
                     if isinstance(shard, dict) and isinstance(shard.get("name"), str))
    return names


def _links(storage: Storage) -> set[str]:
    """Entries of a local output that are symbolic links (walked without following them).

    Deleting `_build/x` where `_build` links elsewhere would delete a file outside the output, so the
    output is walked here with links left unfollowed, whatever the filesystem layer's listing does.
    """
    if not storage.is_local or not os.path.isdir(storage.root):
        return set()
    found = set()
    for directory, subdirectories, files in os.walk(storage.root, followlinks=False):
        for entry in (*subdirectories, *files):
            path = os.path.join(directory, entry)
            if os.path.islink(path):
                found.add(os.path.relpath(path, storage.root).replace(os.sep, "/"))
    return found


def prepare_output(storage: Storage, build: dict[str, Any], *, overwrite: bool, extra_key: str) -> str:
    """Decide what to do with the output: "fresh", "resume" or "done".

    Args:
        storage: the output prefix.
        build: this build's configuration (with its "fingerprint").
        overwrite: replace whatever build is there.
        extra_key: must also match for a checkpoint to be resumed (unit size).

    Raises:
        FileExistsError: the output holds another build's data or foreign files and not `overwrite`.
    """
    links = _links(storage)
    names = storage.list_names()
    if overwrite:
        _clear_for_overwrite(storage, links, names)
        return "fresh"
    ours = sorted(link for link in links if _ours(link) or link == STATE_DIR)
    if ours:
        raise FileExistsError(f"--output {storage.url}: {ours[0]} is a symbolic link; shardkit never reads "
                              f"or writes through links out of its output ({_HINT})")
    if not names:
        return "fresh"
    if MANIFEST_NAME in names:
        return _against_manifest(storage, build)
    return _against_checkpoint(storage, build, extra_key, names)


def _clear_for_overwrite(storage: Storage, links: set[str], names: list[str]) -> None:
    """Remove what the previous run recorded (and its temporaries and state), keeping files shardkit did not write."""
    recorded = _recorded_shards(storage, links)
    ours = lambda name: _ours(name, recorded) or _ours(name.split(TEMPORARY_MARK, 1)[0], recorded)  # noqa: E731
    for link in links:  # the link itself goes, never what it points at
        if ours(link) or link == STATE_DIR:
            os.unlink(storage.path(link))
    names = [n for n in names if not any(n == link or n.startswith(f"{link}/") for link in links)]
    foreign = [n for n in names if not ours(n)]
    for name in names:
        if ours(name):
            storage.delete(name)
    if foreign:
        logger.warning("--overwrite kept %d files shardkit did not write in %s (e.g. %s)",
                       len(foreign), storage.url, foreign[0])


def _against_manifest(storage: Storage, build: dict[str, Any]) -> str:
    """"done" when the published manifest is this build's; otherwise refused, saying what differs."""
    try:
        existing: Manifest | None = load_manifest(storage)
    except ManifestError:
        existing = None
    if existing is not None and existing.build.get("fingerprint") == build["fingerprint"]:
        # A run killed between publishing its manifest and clearing its state leaves the checkpoint
        # (and perhaps temporaries) beside a finished build: this run clears them.
        clear_state(storage)
        return "done"
    differ = _differences(existing.build, build) if existing is not None else ["(unreadable manifest)"]
    raise FileExistsError(f"--output {storage.url} already holds a dataset built with a different configuration "
                          f"(differs in: {', '.join(differ) or 'tokenizer or inputs'}); {_HINT}")


def _against_checkpoint(storage: Storage, build: dict[str, Any], extra_key: str, names: list[str]) -> str:
    """"resume" when the checkpoint is this build's; otherwise refused, saying what differs or what is there."""
    checkpoint = load_checkpoint(storage)
    if checkpoint is not None:
        meta = checkpoint[0]
        if meta.get("fingerprint") == build["fingerprint"] and meta.get("extra_key") == extra_key:
            return "resume"
        differ = _differences(meta.get("build", {}), build) or ["unit size"]
        raise FileExistsError(f"--output {storage.url} holds an unfinished build with a different configuration "
                              f"(differs in: {', '.join(differ)}); {_HINT}")
    raise FileExistsError(f"--output {storage.url} is not empty ({len(names)} files, e.g. {names[0]}) and holds no "
                          f"shardkit build to resume; {_HINT}")


def clear_state(storage: Storage) -> None:
    """Remove the checkpoint once the manifest is published."""
    storage.delete(CHECKPOINT_NAME)
    for name in storage.list_names():
        # Left by writes a kill interrupted: Storage.write_bytes writes NAME.tmp-<hex>, then renames.
        if TEMPORARY_MARK in name and _ours(name.rsplit(TEMPORARY_MARK, 1)[0]):
            storage.delete(name)
    if storage.is_local:
        try:
            os.rmdir(storage.path(STATE_DIR))
        except OSError:
            pass
