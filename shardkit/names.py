"""Validation of relative names that come from untrusted places (manifests, tar members).

A name is accepted only when joining it to a prefix can never leave that prefix: no absolute
paths, no `..`, no empty or `.` components, no backslashes, drive letters, URL schemes or NUL.
"""

from __future__ import annotations

import re

from shardkit.errors import UnsafeNameError

_DRIVE = re.compile(r"^[A-Za-z]:")


def check_relative_name(name: object, *, what: str = "name") -> str:
    """Return `name` unchanged if it is a safe relative path, else raise `UnsafeNameError`."""
    if not isinstance(name, str) or not name:
        raise UnsafeNameError(f"{what} must be a non-empty string, got {name!r}")
    problem = None
    if "\x00" in name:
        problem = "contains a NUL byte"
    elif "\\" in name:
        problem = "contains a backslash"
    elif name.startswith("/"):
        problem = "is an absolute path"
    elif _DRIVE.match(name) or "://" in name:
        problem = "names a drive or a URL scheme"
    else:
        parts = name.split("/")
        if any(part in ("", ".", "..") for part in parts):
            problem = "has an empty, '.' or '..' component"
    if problem:
        raise UnsafeNameError(f"unsafe {what} {name!r}: it {problem}; names must stay inside their prefix")
    return name
