"""The public API documents itself: every name `shardkit` exports (and `shardkit.loaders`) has a Google-style
docstring naming each of its fields or arguments, and its public methods have docstrings."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

import shardkit
import shardkit.loaders

# Methods whose docstrings are written where their module is being rewritten (name -> why not here).
PENDING: dict[str, str] = {}  # methods allowed without a docstring for now: none


def _exported(module) -> list[str]:
    return [name for name in module.__all__ if not name.startswith("__")]


def _arguments(obj) -> list[str]:
    """The fields of a dataclass, else the arguments of a function or of a class's constructor."""
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj) if f.init]
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.name != "self" and not p.name.startswith("_")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _described(doc: str) -> set[str]:
    """Names an `Args:`/`Attributes:` entry describes: `name: ...`, `name (type): ...` or `a, b, c: ...`."""
    names = set()
    for match in re.finditer(r"^\s+([A-Za-z_][\w, ]*?)(?: \([^)]*\))?: ", doc, re.M):
        names.update(part.strip() for part in match.group(1).split(","))
    return names


@pytest.mark.parametrize("name", _exported(shardkit))
def test_every_export_documents_its_arguments_and_methods(name):
    obj = getattr(shardkit, name)
    doc = inspect.getdoc(obj) or ""
    assert len(doc.split()) >= 5, f"shardkit.{name} has no real docstring"
    arguments = _arguments(obj)
    if arguments:
        section = "Attributes:" if dataclasses.is_dataclass(obj) else "Args:"
        assert section in doc or "Args:" in doc, f"shardkit.{name}: no {section} section"
        missing = [a for a in arguments if a not in _described(doc)]
        assert not missing, f"shardkit.{name}'s docstring does not describe {missing}"
    if inspect.isclass(obj):
        for method, value in vars(obj).items():
            if method.startswith("_") or f"{name}.{method}" in PENDING:
                continue
            function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if callable(function):
                assert inspect.getdoc(function), f"shardkit.{name}.{method} has no docstring"


def test_loader_config_fields_are_in_help():
    text = inspect.getdoc(shardkit.LoaderConfig)
    for f in dataclasses.fields(shardkit.LoaderConfig):
        assert f"{f.name}: {f.metadata['help'][:30]}" in " ".join(text.split()), f.name


def test_corrupt_shard_error_keeps_shard_and_reason():
    err = shardkit.CorruptShardError("shard-000001.arrow", "sha256 differs")
    assert (err.shard, err.reason) == ("shard-000001.arrow", "sha256 differs") and isinstance(err, ValueError)
    assert "shard:" in inspect.getdoc(shardkit.CorruptShardError).split("Attributes:")[1]


def test_the_loaders_package_exports_the_loaders_public_names():
    assert {"StreamingDataset", "StreamingDataLoader", "LoaderConfig", "Stream", "Schedule"} <= set(
        shardkit.loaders.__all__)
    for name in _exported(shardkit.loaders):
        assert getattr(shardkit.loaders, name) is not None
        if name in shardkit.__all__:
            assert getattr(shardkit.loaders, name) is getattr(shardkit, name)
    assert dir(shardkit.loaders) == sorted(shardkit.loaders.__all__)
