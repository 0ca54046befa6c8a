"""obstore's module in this process, and a fresh copy of it in a child forked after its parent started obstore.

obstore (0.12.1) runs every request, synchronous or async, on one tokio runtime per loaded copy of its extension:
a static started at the first request. fork() copies the static but not the runtime's threads, so in a forked
child every request hangs, through a store the parent made and one the child makes alike (tried: a HEAD, a GET
and a ranged GET, sync and async, all hang; none fails). A shared library loaded again from another file has
statics of its own, so a child runs obstore's extension loaded once more: before its first fork the parent
copies the extension's file into an anonymous memory file (a memfd, once per process, its pages shared by every
child) and loads that copy without ever running it (10-20 ms, once), and a child that reads an object store makes
its stores with the copy it inherited loaded and not started. Its runtime then starts in the child, which
prepares a copy for its own children in turn.

Where no copy can be made (no memfd: not Linux; the copy failed), `usable_here()` says so and the caller reads
through fsspec, as every process did before obstore.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
from types import ModuleType

logger = logging.getLogger(__name__)

_runtime_pid: int | None = None  # the process whose runtime (of `_module`) has started; None: not yet
_module: ModuleType | None = None  # obstore's extension as this process uses it (None: not imported yet)
_kinds_used: set[str] = set()  # the kinds of store ("s3", "gcs", ...) `_runtime_pid` made requests to
_copy_for_children: tuple[int, int] | None = None  # (the process that made it, the memfd) of a fresh extension
_failed_pid: int | None = None  # the process where loading a fresh copy failed (it reads through fsspec)
_spare: tuple[int, ModuleType | None] | None = None  # (the process that loaded it, the copy for its children)
# The store classes' names in obstore's extension, by kind of store.
STORE_CLASSES = {"s3": "S3Store", "gcs": "GCSStore", "azure": "AzureStore", "http": "HTTPStore"}


def obstore_module() -> ModuleType:
    """obstore's extension (`obstore._obstore`: `get`, `head`, `_store.S3Store`, ...) usable in this process: the
    one imported here, or, in a child forked after its parent started obstore, a fresh copy (its own runtime).
    Raises RuntimeError where neither can run here (`usable_here()` is False)."""
    global _module
    if not usable_here():
        raise RuntimeError("obstore's runtime started in the parent process and no fresh copy can be loaded here")
    if _module is None:
        import obstore._obstore

        _module = obstore._obstore
    return _module


def note_request(kind: str) -> None:
    """A request to a store of `kind` is about to run: the runtime of `obstore_module()` now runs in this process."""
    global _runtime_pid
    _runtime_pid = _runtime_pid or os.getpid()
    _kinds_used.add(kind)


def ran_here(kind: str) -> bool:
    """Whether this process has made an obstore request to a store of `kind` ("s3", "gcs", ...)."""
    return _runtime_pid == os.getpid() and kind in _kinds_used


def usable_here() -> bool:
    """Whether obstore can run in this process: its runtime started nowhere or here, or, in a child forked after
    its parent started it, a fresh copy of the extension is now loaded (`_fresh_copy`; tried once a process)."""
    global _module, _runtime_pid, _failed_pid
    if _runtime_pid in (None, os.getpid()):
        return True
    if _failed_pid == os.getpid():
        return False
    fresh = _fresh_copy()
    if fresh is None:
        _failed_pid = os.getpid()
        return False
    _module, _runtime_pid = fresh, None  # its runtime starts at this process's first request
    _kinds_used.clear()
    return True


def prepare_children() -> bool:
    """Before a fork: where obstore's runtime runs in this process, copy its extension into a memfd that children
    load a runtime of their own from (once per process). Whether a child can use obstore."""
    global _copy_for_children
    if _runtime_pid != os.getpid():
        return True  # nothing started here: a child imports obstore as this process would
    if _copy_for_children is not None and _copy_for_children[0] == os.getpid():
        return True
    if not hasattr(os, "memfd_create") or _module is None:
        return False
    try:
        memfd = os.memfd_create("shardkit-obstore", os.MFD_CLOEXEC)  # fork() children keep it, exec() drops it
        with open(_module.__file__, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            sent = 0
            while sent < size:  # the kernel copies (page cache to memfd), no Python buffer
                sent += os.sendfile(memfd, source.fileno(), sent, size - sent)
    except OSError as err:
        logger.debug("no copy of obstore's extension for forked children (%s): they read through fsspec", err)
        return False
    _copy_for_children = (os.getpid(), memfd)
    _load_spare(memfd)
    return True


def _load_spare(memfd: int) -> None:
    """Load the copy for children here, once, never to run it here: every child forked from now on inherits it
    loaded, its runtime not started, instead of each loading its own at its first request (10-20 ms alone, 50 ms
    or more while the DataLoader's workers all start at once on a busy machine, on the way to each first batch)."""
    global _spare
    _spare = (os.getpid(), _load_copy(f"/proc/self/fd/{memfd}"))


def _fresh_copy() -> ModuleType | None:
    """obstore's extension loaded again from the memfd of the process whose runtime this one inherited (another
    file: its own statics, its own runtime; no process of this line has run that copy), or None where it made
    none: the copy that process loaded for its children (`_load_spare`), else loaded here."""
    if _copy_for_children is None or _copy_for_children[0] != _runtime_pid:
        return None
    if _spare is not None and _spare[0] == _runtime_pid and _spare[1] is not None:
        return _spare[1]
    return _load_copy(f"/proc/self/fd/{_copy_for_children[1]}")


def _load_copy(path: str) -> ModuleType | None:
    """obstore's extension loaded from the file `path`, or None. `sys.modules` keeps the modules it had (loading
    the copy replaces `obstore.exceptions` and `obstore._store`): only shardkit's stores use the copy."""
    loader = importlib.machinery.ExtensionFileLoader("obstore._obstore", path)
    spec = importlib.util.spec_from_file_location("obstore._obstore", path, loader=loader)
    inherited = {name: module for name, module in sys.modules.items() if name.startswith("obstore")}
    try:
        fresh = importlib.util.module_from_spec(spec)
        loader.exec_module(fresh)
    except Exception as err:  # noqa: BLE001 - the caller falls back to fsspec
        logger.debug("could not load a fresh copy of obstore's extension (%s): reading through fsspec", err)
        return None
    finally:
        sys.modules.update(inherited)
    return fresh


os.register_at_fork(before=prepare_children)
