"""`TextRecipe` (issue 42 item 4): one dataclass says how text becomes samples, for `shardkit build` and for the
raw-text loader; one spelling for each field (`--pack` / `pack=`, the build's `packing` kept); checks that name the
field (or the build's option); the fingerprints that checkpoints and loader states are bound to unchanged."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardkit.cli import build_parser
from shardkit.cli.build import TokenizerTrainOptions, config_from_args
from shardkit.loaders.sources.raw.corpus import RawCorpus, RawTextSettings
from shardkit.text.recipe import TextRecipe, recipe_fields
from shardkit.tools import state as build_state
from shardkit.tools.config import BuildConfig, build_record

BUILD = dict(inputs=("a.jsonl",), output="o")
# Build fields named as the recipe names them, except the one the build records under its manifest's name.
BUILD_NAME = {"pack": "packing"}

BAD_VALUES = [
    ("tokenizer", "", "must be a non-empty string"),
    ("tokenizer", None, "must be a non-empty string"),
    ("seq_len", 0, "must be a positive integer, got 0"),
    ("seq_len", True, "must be a positive integer, got True"),
    ("seq_len", 2.5, "must be a positive integer, got 2.5"),
    ("pack", "zigzag", "must be one of concat, bestfit, none, got 'zigzag'"),
    ("text_field", "", "must be a non-empty string"),
    ("txt_mode", "line", "must be one of file, paragraph, got 'line'"),
    ("eos_id", -1, "must be an integer id >= 0, 'auto' or 'none', got -1"),
    ("eos_id", "eos", "must be an integer id >= 0, 'auto' or 'none', got 'eos'"),
    ("bos_id", True, "must be an integer id >= 0, 'auto' or 'none', got True"),
    ("max_doc_chars", 0, "must be a positive integer, got 0"),
    ("bestfit_buffer", 0, "must be a positive integer, got 0"),
    ("bestfit_open", -1, "must be >= 0, got -1"),
]


def recipe(**changes) -> dict:
    return {"tokenizer": "byte", "seq_len": 8, **changes}


@pytest.mark.parametrize("field, value, message", BAD_VALUES)
def test_a_bad_field_is_refused_by_its_name(field, value, message):
    for cls in (TextRecipe, RawTextSettings):
        with pytest.raises(ValueError, match=f"^{field} {message}"):
            cls(**recipe(**{field: value}))
    # The build's config names the option to change.
    with pytest.raises(ValueError, match=f"^--{field.replace('_', '-')} {message}"):
        BuildConfig(**BUILD, **recipe(**{BUILD_NAME.get(field, field): value}))


@pytest.mark.parametrize("field", ["unit_bytes", "lanes"])
def test_the_raw_settings_check_their_own_fields_by_name(field):
    with pytest.raises(ValueError, match=f"^{field} must be a positive integer, got 0"):
        RawTextSettings(**recipe(**{field: 0}))


@pytest.mark.parametrize("value", ["auto", "none", None, 0, 50256, "7"])
def test_special_ids_take_what_the_tokenizer_layer_reads(value):
    assert TextRecipe(**recipe(eos_id=value, bos_id=value)).eos_id == value  # kept as given: fingerprints hold it


def test_the_build_takes_pack_and_its_old_spelling_alike():
    def parse(*argv: str) -> BuildConfig:
        return config_from_args(build_parser().parse_args(["build", "a.jsonl", "--output", "o", "--tokenizer",
                                                           "byte", "--seq-len", "8", *argv]))

    expected = BuildConfig(**BUILD, **recipe(packing="bestfit"))
    assert parse("--pack", "bestfit") == parse("--packing", "bestfit") == expected
    assert BuildConfig(**BUILD, **recipe(pack="bestfit")) == expected
    assert expected.pack == expected.packing == expected.recipe.pack == "bestfit"
    assert dataclasses.replace(expected, pack="none").packing == "none"
    assert dataclasses.replace(expected, packing="none").pack == "none"
    assert build_record(BuildConfig(**BUILD, **recipe(pack="bestfit")), {}) == build_record(expected, {})


def test_the_build_and_the_raw_settings_share_the_one_recipe():
    assert issubclass(RawTextSettings, TextRecipe)
    build_fields = {f.name: f for f in dataclasses.fields(BuildConfig)}
    for name, field in recipe_fields().items():
        build_field = build_fields[BUILD_NAME.get(name, name)]
        assert build_field.default == field.default, name
        for key in ("help", "choices", "parse", "metavar", "cli_default"):
            assert build_field.metadata[key] == field.metadata[key], (name, key)
        assert build_field.metadata["records"] == "output", name  # each one decides the shards' bytes
    # The tokenizer trainer reads documents as the build does.
    train_fields = {f.name: f for f in dataclasses.fields(TokenizerTrainOptions)}
    for name in ("text_field", "txt_mode"):
        assert train_fields[name].metadata == recipe_fields()[name].metadata and train_fields[name].default == \
            recipe_fields()[name].default
    config = BuildConfig(**BUILD, **recipe(packing="bestfit", eos_id=None, bestfit_open=3, txt_mode="paragraph"))
    assert isinstance(config.recipe, TextRecipe)
    raw = RawTextSettings(**dataclasses.asdict(config.recipe), unit_bytes=4096, lanes=3)
    assert {name: getattr(raw, name) for name in recipe_fields()} == dataclasses.asdict(config.recipe)


def test_the_build_fingerprint_of_a_fixed_configuration_is_unchanged():
    # Computed with the code before TextRecipe (commit 85c0a02): a checkpoint or manifest written then still
    # resumes or is found done.
    config = BuildConfig(**BUILD, tokenizer="byte", seq_len=128, packing="bestfit", bestfit_buffer=64,
                         bestfit_open=7, max_doc_chars=5000)
    resolved = {"inputs": [{"url": "a.jsonl", "bytes": 10, "sha256": "0" * 64}], "eos_id": 256, "bos_id": None}
    assert build_state.fingerprint(build_record(config, resolved)) == \
        "db11db6c0fc7945279a661a7b47e34d3082889d2c6f0c227db608d01456c48f7"


def test_the_raw_corpus_fingerprint_holds_the_same_settings(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 9}) + "\n" for i in range(60)))
    values = dict(tokenizer="byte", seq_len=31, pack="bestfit", text_field="text", txt_mode="file", unit_bytes=512,
                  lanes=3, eos_id="auto", bos_id=None, max_doc_chars=10_000_000, bestfit_buffer=64, bestfit_open=7)
    settings = RawTextSettings(**values)
    # The corpus fingerprint (what loader states are bound to) holds asdict(settings): the same 12 names and values
    # as RawTextSettings had on its own, so saved states still load.
    assert dataclasses.asdict(settings) == values
    from_build = RawTextSettings(**dataclasses.asdict(BuildConfig(**BUILD, **recipe(
        seq_len=31, packing="bestfit", bestfit_buffer=64, bestfit_open=7)).recipe), unit_bytes=512, lanes=3)
    assert RawCorpus([str(corpus)], from_build).fingerprint == RawCorpus([str(corpus)], settings).fingerprint
