"""Write the trainer's nested option values as a `--config` TOML file (the standard library only reads TOML)."""

from __future__ import annotations

import errno
import math
import shutil
from pathlib import Path
from typing import Any

from shardkit.storage import write_file_atomic


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        # repr is the shortest text that reads back as the same double; TOML floats need a '.' or exponent.
        text = repr(value)
        return text if any(c in text for c in ".e") else text + ".0"
    if isinstance(value, str):
        return _string(value)
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} to TOML")


def _string(value: str) -> str:
    """A TOML basic string: characters as they are (UTF-8), but quotes, backslashes and the control
    characters TOML forbids escaped. (JSON's ASCII escapes write a character outside the BMP as a
    surrogate pair, which TOML refuses.)"""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise ValueError(f"{value!r} holds bytes that are not UTF-8 text (a surrogate): it cannot be written to "
                         "TOML; rename the path")
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in value) + '"'


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def dumps(values: dict[str, Any], *, header: str = "") -> str:
    """Top-level keys first, then one [section] per nested dict; None values are left out (the default)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"{key} = {_value(v)}" for key, v in values.items() if not isinstance(v, dict) and v is not None]
    for section, table in values.items():
        if isinstance(table, dict):
            items = [f"{key} = {_value(v)}" for key, v in table.items() if v is not None]
            if items:
                lines += ["", f"[{section}]", *items]
    return "\n".join(lines) + "\n"


def write(path: Path, values: dict[str, Any], *, header: str = "") -> Path:
    """Write atomically (a reader never sees half a file)."""
    return write_text(path, dumps(values, header=header))


def write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` atomically: a reader (or a crash, or a full disk) never leaves half a file
    there, and concurrent writers (tuners sharing a study) each replace it whole.

    Raises:
        OSError: the write failed; on a full disk one line naming the directory and the bytes needed.
    """
    data = text.encode("utf-8")
    try:
        write_file_atomic(str(path), data)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(path.parent).free
            raise OSError(err.errno, f"no space left in {path.parent} to write {path.name}: it needs {len(data):,} "
                                     f"bytes, {free:,} are free") from None
        raise
    return path
