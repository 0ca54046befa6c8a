"""`BuildConfig` generates `shardkit build`'s options and the build record (issue #9 item 3)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from shardkit.cli import build_parser
from shardkit.cli.build import config_from_args
from shardkit.manifest import SHARD_FORMATS
from shardkit.text.inputs import TXT_MODES
from shardkit.text.packing import PACKING_MODES
from shardkit.tools.build import run_build
from shardkit.tools.config import BuildConfig, build_record, flag, recorded_fields, resume_key
from shardkit.tools.executors import EXECUTORS

REPO = Path(__file__).resolve().parents[1]


def build_action(option: str):
    parser = build_parser()
    build = parser._subparsers._group_actions[0].choices["build"]
    return next(a for a in build._actions if option in a.option_strings or a.dest == option)


def parse(*argv: str) -> BuildConfig:
    return config_from_args(build_parser().parse_args(["build", *argv]))


def test_every_field_is_an_option_with_its_help():
    for f in dataclasses.fields(BuildConfig):
        action = build_action(f.name if f.metadata["positional"] else flag(f) if f.type != "bool" or not f.default
                              else f"--no-{f.name.replace('_', '-')}")
        assert f.metadata["help"] and f.metadata["help"].split(";")[0][:30] in action.help.replace("do not ", ""), f.name


def test_command_line_gives_the_dataclass_config():
    config = parse("a.jsonl", "dir/", "--output", "out", "--tokenizer", "byte", "--seq-len", "128",
                   "--pack", "bestfit", "--bestfit-buffer", "64", "--bestfit-open", "7", "--format", "tar",
                   "--shard-size", "2MiB", "--compression", "zstd:9", "--unit-size", "64KiB", "--eos-id", "none",
                   "--bos-id", "auto", "--workers", "3", "--report-examples", "5", "--no-progress", "--overwrite",
                   "-o", "anon=true", "--txt-mode", "paragraph", "--on-error", "fail", "--max-doc-chars", "99")
    assert config == BuildConfig(inputs=("a.jsonl", "dir/"), output="out", tokenizer="byte", seq_len=128,
                                 packing="bestfit", bestfit_buffer=64, bestfit_open=7, shard_format="tar",
                                 shard_size=2 * 2**20, compression_level=9, unit_bytes=64 * 1024, eos_id=None,
                                 bos_id="auto", workers=3, max_examples=5, progress=False, overwrite=True,
                                 txt_mode="paragraph", on_error="fail", max_doc_chars=99,
                                 storage_options={"anon": True})
    # Options not given keep the dataclass's defaults: one source of truth.
    assert parse("a.jsonl", "--output", "o", "--tokenizer", "byte", "--seq-len", "8") == BuildConfig(
        inputs=("a.jsonl",), output="o", tokenizer="byte", seq_len=8)


def test_choices_come_from_the_registries_of_the_code():
    for option, registry in (("--pack", PACKING_MODES), ("--format", SHARD_FORMATS), ("--txt-mode", TXT_MODES),
                             ("--executor", EXECUTORS)):
        assert tuple(build_action(option).choices) == tuple(registry), option
    with pytest.raises(ValueError, match="--pack must be one of concat, bestfit, none"):
        BuildConfig(inputs=("a",), output="o", tokenizer="byte", seq_len=8, packing="zigzag")


def test_bad_option_values_name_the_option(capsys):
    with pytest.raises(SystemExit):
        parse("a.jsonl", "--output", "o", "--tokenizer", "byte", "--seq-len", "8", "--shard-size", "lots")
    assert "argument --shard-size: cannot read 'lots' as a size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--bestfit-open must be >= 0"):
        BuildConfig(inputs=("a",), output="o", tokenizer="byte", seq_len=8, bestfit_open=-1)


def test_the_build_record_is_the_fields_marked_as_deciding_the_output(tmp_path):
    base = BuildConfig(inputs=("a.jsonl",), output="o", tokenizer="byte", seq_len=8, packing="bestfit")
    record = build_record(base, {})
    marked = {f.name for f in dataclasses.fields(BuildConfig) if f.metadata["records"] == "output"}
    assert set(record) == marked | {"tool"}
    changed = {"inputs": ("b.jsonl",), "tokenizer": "tiktoken:gpt2", "seq_len": 9, "shard_format": "tar",
               "packing": "concat", "shard_size": 7, "compression_level": 9, "text_field": "body",
               "txt_mode": "paragraph", "eos_id": None, "bos_id": "auto", "max_doc_chars": 5, "bestfit_buffer": 3,
               "bestfit_open": 2}
    assert set(changed) == marked  # every marked field is exercised below
    for name, value in changed.items():
        assert build_record(dataclasses.replace(base, **{name: value}), {}) != record, name
    # How a build runs never changes its record (so a rerun with more workers resumes / is done).
    for name, value in {"workers": 3, "executor": "ray", "overwrite": True, "progress": False, "max_examples": 1,
                        "on_error": "fail", "ray_address": "auto", "unit_bytes": 77, "output": "elsewhere"}.items():
        assert build_record(dataclasses.replace(base, **{name: value}), {}) == record, name
    # bestfit's settings decide the output only with --pack bestfit.
    concat = dataclasses.replace(base, packing="concat")
    assert build_record(dataclasses.replace(concat, bestfit_open=3), {}) == build_record(concat, {})
    assert recorded_fields(base, "resume") == ["unit_bytes"] and resume_key(base) == "unit_bytes=1048576"


def test_the_manifest_records_exactly_the_marked_fields(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 10}) + "\n" for i in range(50)))
    config = BuildConfig(inputs=(str(corpus),), output=str(tmp_path / "out"), tokenizer="byte", seq_len=31,
                         workers=1, progress=False)
    manifest = run_build(config).manifest
    assert set(manifest.build) == set(recorded_fields(config, "output")) | {"tool", "fingerprint", "documents"}
    assert manifest.build["inputs"] == [{"url": str(corpus), "bytes": corpus.stat().st_size,
                                         "sha256": __import__("hashlib").sha256(corpus.read_bytes()).hexdigest()}]
    assert manifest.build["eos_id"] == 256  # "auto", resolved


def test_the_build_reads_as_named_steps_without_nonlocal_state():
    tree = ast.parse((REPO / "tools/build.py").read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Nonlocal)]
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"prepare", "emit", "snapshot", "finish", "run_build"} <= names
    assert not any(isinstance(node, ast.FunctionDef) and node.name == "_run" for node in tree.body)
