"""A source's own index (MDS and LitData `index.json`, a `save_to_disk` directory's `state.json`), read and
checked before anything is converted or written.

The index is the source's word, and the source may be damaged or hostile: its JSON must have the shape
the format documents (objects, lists, strings and counts where they belong, counts >= 0), every file it
names must stay inside the source directory (`shardkit.names.check_relative_name`, the check the
manifest's shard names pass), and every count must fit in the bytes of its file (so per-item work is
bounded by what the file can hold, never by a number the index declares). Each refusal is one
`ValueError` naming the index file, the entry and the field.
"""

from __future__ import annotations

import json
from typing import Any

from shardkit.errors import UnsafeNameError
from shardkit.names import check_relative_name

__all__ = ["IndexEntry", "items_held", "read_index_json", "read_json_object"]


def read_json_object(fs, path: str, *, name: str, what: str) -> dict:
    """The JSON object in `path` (named `name` in errors; `what` is what it should be, with its article).

    Raises:
        ValueError: not JSON, or JSON but not an object.
    """
    try:
        value = json.loads(fs.cat_file(path))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{name}: not {what} ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{name}: not {what} (a JSON object is expected, got {_kind(value)})")
    return value


def read_index_json(spec: str, storage_options, *, fields: tuple[str, ...], what: str):
    """(filesystem, dataset directory, display name of its index.json, the index) of an MDS or LitData SRC
    (the directory, or its index.json). `fields` must be present, else the index is refused naming it.
    `what` names the format with its article ("an MDS").

    Raises:
        FileNotFoundError: no index.json there. ValueError: it is not a JSON object or lacks a field.
    """
    from shardkit.storage import open_filesystem
    from shardkit.text.inputs import _display

    fs, path = open_filesystem(spec, storage_options)
    path = path[:-len("/index.json")] if path.endswith("/index.json") else path.rstrip("/")
    name = f"{path}/index.json"
    if not fs.exists(name):
        raise FileNotFoundError(f"SRC {spec}: no index.json ({what} dataset is a directory holding one)")
    shown = _display(fs, name)
    index = read_json_object(fs, name, name=shown, what=f"{what} index")
    missing = [f for f in fields if f not in index]
    if missing:
        raise ValueError(f"{shown}: not {what} index (no {', '.join(missing)})")
    return fs, path, shown, index


class IndexEntry:
    """Typed access to one object of an index: each getter checks its field's type and refuses it in one
    line naming the index file, the entry and the field ("shard 3: raw_data.bytes must be ...").

    Args:
        value: the object (refused when it is not one).
        where: the entry, e.g. "shard 3" ("" for the index itself).
        file: the index file's display name.
    """

    def __init__(self, value: Any, *, where: str, file: str, prefix: str | None = None):
        self.file = file
        self.prefix = prefix if prefix is not None else (f"{where}: " if where else "")
        if not isinstance(value, dict):
            self.refuse(f"{where} must be an object, got {_kind(value)}")
        self.value = value

    def refuse(self, problem: str):
        raise ValueError(f"{self.file}: {problem}")

    def _get(self, key: str, check, expected: str, *, optional: bool = False) -> Any:
        value = self.value.get(key)
        if not check(value) and not (optional and value is None):
            self.refuse(f"{self.prefix}{key} must be {expected}, got {_kind(value)}")
        return value

    def entry(self, key: str) -> IndexEntry:
        """The field `key`, an object (its fields are named `key.field`)."""
        value = self._get(key, lambda v: isinstance(v, dict), "an object")
        return IndexEntry(value, where=key, file=self.file, prefix=f"{self.prefix}{key}.")

    def list(self, key: str) -> list:
        return self._get(key, lambda v: isinstance(v, list), "a list")

    def text(self, key: str, *, optional: bool = False) -> str | None:
        return self._get(key, lambda v: isinstance(v, str), "a string", optional=optional)

    def count(self, key: str) -> int:
        """A non-negative integer (a bool is not one)."""
        value = self.value.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.refuse(f"{self.prefix}{key} must be an integer >= 0, got {value!r:.40}")
        return value

    def file_name(self, key: str) -> str:
        """A file name relative to the source directory, refused when it could leave it."""
        name = self.text(key)
        try:
            return check_relative_name(name, what=f"file name in {self.prefix}{key}")
        except UnsafeNameError as err:
            self.refuse(str(err))

    def hashes(self, key: str) -> dict[str, str]:
        """{algorithm: hex digest}; absent or null is none."""
        value = self._get(key, lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(d, str)
                                                                    for k, d in v.items()),
                          "an object of algorithm: hex digest", optional=True)
        return dict(value or {})


def items_held(nbytes: int) -> int:
    """The most items an MDS shard or LitData chunk of `nbytes` can hold: both begin with a u32 count and
    count + 1 u32 offsets, so the header alone needs 4 * (count + 2) bytes."""
    return max(0, (nbytes - 8) // 4)


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    shown = names.get(type(value), type(value).__name__)
    return shown if isinstance(value, (dict, list, type(None))) else f"{shown} {value!r:.40}"
