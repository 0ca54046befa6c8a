"""`TextRecipe`: how text becomes samples, one dataclass for the build and for the raw-text loader.

The tokenizer, the context length, the packing and its parameters, where a record holds its text, what one
document of a .txt file is, the special ids and the document limit decide the samples a corpus gives.
`shardkit build` writes shards with them (`shardkit.tools.config.BuildConfig` takes these fields, their help,
defaults and parsing, as its options) and the raw-text loader tokenizes on the fly with them
(`shardkit.loaders.sources.raw.corpus.RawTextSettings` is a recipe plus how the loader cuts the corpus), so both spell
and check each field the same way.

Allowed values come from the registries of the code that implements them (`PACKING_MODES`, `TXT_MODES`),
imported on use so that `shardkit --help` stays light.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardkit.options import option

__all__ = ["TextRecipe", "check_count", "check_recipe", "parse_special_id", "recipe_fields", "recipe_option", "registry"]


def registry(module: str, name: str) -> Callable[[], tuple[str, ...]]:
    """The allowed values of an option: the names in `module.name` (a tuple or a dict), imported on use."""

    def names() -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(module), name))

    names.__qualname__ = f"{module}.{name}"
    return names


def parse_special_id(text: str) -> int | str | None:
    """"auto", "none" or an integer id (checked against the vocabulary once the tokenizer is loaded)."""
    lowered = text.strip().lower()
    if lowered == "none":
        return None
    if lowered == "auto":
        return "auto"
    try:
        return int(lowered)
    except ValueError:
        raise ValueError(f"expected an integer id, 'auto' or 'none', got {text!r}") from None


@dataclass(frozen=True, kw_only=True)
class TextRecipe:
    """How documents become samples (every field decides the samples' tokens).

    Values are kept as given, never normalised ("none" stays "none"): the build record and the raw corpus's
    fingerprint are made of them, and a saved state or checkpoint is bound to those.
    """

    tokenizer: str = option(
        help="'byte' (UTF-8 bytes), a tokenizer.json or HF tokenizer directory, a .tiktoken file, tiktoken:NAME "
             "(e.g. tiktoken:cl100k_base; honours TIKTOKEN_CACHE_DIR) or a sentencepiece .model file",
        metavar="SPEC")
    seq_len: int = option(help="training context length; packed samples hold N+1 tokens (input and shifted "
                               "target). With --pack none, the longest sample is N+1 tokens. Example: --seq-len 2048",
                          metavar="N")
    pack: str = option(
        "concat", "'concat': join documents with EOS and cut windows (the last partial window is padded and "
        "reported); 'bestfit': best-fit-decreasing packing of whole documents, splitting only documents longer "
        "than a window (padding fraction and split count are reported); 'none': one document per sample, split "
        "at N+1 tokens", choices=registry("shardkit.text.packing", "PACKING_MODES"), metavar="MODE")
    text_field: str = option("text", "JSON key (JSONL) or column (Parquet) that holds the text", metavar="NAME")
    txt_mode: str = option("file", "what one document of a .txt file is: 'file' (the whole file) or 'paragraph' "
                                   "(text separated by one or more blank lines)",
                           choices=registry("shardkit.text.inputs", "TXT_MODES"), metavar="MODE")
    eos_id: int | str | None = option(
        "auto", "token id placed after every document: 'auto' (the tokenizer's EOS, e.g. <|endoftext|>), an "
        "integer, or 'none'", parse=parse_special_id, metavar="ID|auto|none")
    bos_id: int | str | None = option(
        None, "token id placed before every document: 'none', 'auto' (the tokenizer's BOS) or an integer",
        parse=parse_special_id, metavar="ID|auto|none", cli_default="none")
    max_doc_chars: int = option(10_000_000, "documents with more characters are rejected as enormous", metavar="N")
    bestfit_buffer: int = option(2048, "with --pack bestfit: documents sorted and placed together (bounds memory)",
                                 metavar="DOCS")
    bestfit_open: int = option(512, "with --pack bestfit: partly filled windows kept open between buffers (the "
                                    "fullest are closed, padded, when there are more)", metavar="WINDOWS")

    def __post_init__(self) -> None:
        check_recipe({name: getattr(self, name) for name in recipe_fields()})


def recipe_fields() -> dict[str, dataclasses.Field]:
    """`TextRecipe`'s fields by name, in order."""
    return {f.name: f for f in dataclasses.fields(TextRecipe)}


# Least value of each count (bestfit may close every open window after each buffer).
_LEAST = {"seq_len": 1, "max_doc_chars": 1, "bestfit_buffer": 1, "bestfit_open": 0}


def check_recipe(values: Mapping[str, Any], *, name: Callable[[str], str] = str) -> None:
    """Refuse a recipe's bad value, naming its field as `name(field)` spells it (a command names its option).

    Raises:
        ValueError: the first bad field: a spec or text field that is no text, a choice outside its registry,
            a count that is no integer or under its least value, a special id that is neither 'auto', 'none'
            nor a token id.
    """
    for field in ("tokenizer", "text_field"):
        if not isinstance(values[field], str) or not values[field]:
            raise ValueError(f"{name(field)} must be a non-empty string, got {values[field]!r}")
    for field, least in _LEAST.items():
        check_count(name(field), values[field], least)
    for field in ("pack", "txt_mode"):
        allowed = recipe_fields()[field].metadata["choices"]()
        if values[field] not in allowed:
            raise ValueError(f"{name(field)} must be one of {', '.join(allowed)}, got {values[field]!r}")
    for field in ("eos_id", "bos_id"):
        if not _is_special_id(values[field]):
            raise ValueError(f"{name(field)} must be an integer id >= 0, 'auto' or 'none', got {values[field]!r}")


def check_count(label: str, value: Any, least: int = 1) -> None:
    """Refuse anything but an integer (not a bool) of at least `least`, naming it `label`.

    Raises:
        ValueError: "LABEL must be a positive integer, got VALUE" (or "must be >= LEAST").
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        wanted = "a positive integer" if least == 1 else f">= {least}"
        raise ValueError(f"{label} must be {wanted}, got {value!r}")


def _is_special_id(value: Any) -> bool:
    """What `shardkit.text.tokenizers.with_special_ids` reads as an id, before the vocabulary is known."""
    if value is None or value in ("auto", "none"):
        return True
    if isinstance(value, str):
        return value.strip().isdigit()
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def recipe_option(name: str, **changes: Any) -> Any:
    """A configuration field that is `TextRecipe`'s field `name` (default, help, parsing, choices), with `changes`
    to its metadata (a command's own flags, what its owner records about it)."""
    original = recipe_fields()[name]
    return option(original.default, **{**original.metadata, **changes})
