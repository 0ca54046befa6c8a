"""Configuration dataclasses, presets, config files and the generated command-line options."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardkit.cli import build_parser
from shardkit.loaders.config import LoaderConfig
from shardkit.train.config import (PRESETS, SECTIONS, CompileConfig, DataConfig, ModelConfig, PrecisionConfig,
                                   TrainConfig, TrainingConfig, config_from_dict, data_entries, describe_step,
                                   with_step_size)
from shardkit.train.options import parse_train_args


def test_presets_fill_the_model_and_explicit_values_win():
    config = config_from_dict({"preset": "gpt2-124m", "model": {"n_layer": 2}})
    assert (config.model.style, config.model.d_model, config.model.n_layer) == ("gpt2", 768, 2)
    assert config.optimizer.lr == 6e-4
    assert config_from_dict({"preset": "llama-1b"}).model.kv_heads == 8


@pytest.mark.parametrize("values, option", [
    ({"model": {"d_model": 30, "n_head": 4}}, "--d-model"),
    ({"model": {"n_head": 4, "n_kv_head": 3}}, "--n-kv-head"),
    ({"optimizer": {"lr": 0}}, "--lr"),
    ({"optimizer": {"warmup_steps": 50}, "steps": 10}, "--warmup-steps"),
    ({"parallelism": {"parallel": "fsdp", "comm_hook": "bf16"}}, "--comm-hook"),
    ({"checkpoint": {"keep": 0}}, "--keep"),
    ({"data": {"batch_size": 0}}, "--batch-size"),
    ({"data": {"shuffle_window": 0}}, "--shuffle-window"),
    ({"data": {"data_seed": -1}}, "--data-seed"),
    ({"data": {"partial_batches": "keep"}}, "--partial-batches"),
    ({"data": {"data": "/a:0.5 /b:0"}}, "/b:0"),
    ({"data": {"loader": {"bogus": 1}}}, "bogus"),
    ({"preset": "gpt5"}, "--preset"),
    ({"model": {"bogus": 1}}, "model.bogus"),
    ({"bogus": 1}, "bogus"),
])
def test_validation_names_the_option(values, option):
    with pytest.raises(ValueError, match=option.replace(".", r"\.")):
        config_from_dict(values)


def test_dataclasses_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig("gpt2")  # noqa: the positional form is refused
    with pytest.raises(AttributeError):
        TrainConfig().training.steps = 3


def test_every_section_is_a_frozen_keyword_only_dataclass_in_its_own_module():
    modules = set()
    for name, cls in SECTIONS.items():
        assert cls.__dataclass_params__.frozen and all(f.kw_only for f in dataclasses.fields(cls)), name
        assert isinstance(getattr(TrainConfig(), name), cls), name
        modules.add(cls.__module__)
    # one module per component (parallelism holds the mesh and DiLoCo's outer optimizer)
    assert len(modules) == len(SECTIONS) - 1 and all(m.startswith("shardkit.train.config.") for m in modules)


def test_the_former_flat_keywords_build_the_same_config():
    """`TrainConfig(steps=..., precision=..., compile=...)` was the keyword form before the loop sections:
    `TrainConfig.from_keywords` keeps it, without a preset, as the constructor."""
    sectioned = TrainConfig(training=TrainingConfig(steps=5, seed=3, skip_steps="4,2"),
                            mixed_precision=PrecisionConfig(precision="fp32"), compile=CompileConfig(compile=True),
                            data=DataConfig(data="/d"))
    flat = TrainConfig.from_keywords(steps=5, seed=3, skip_steps="4,2", precision="fp32", compile=True,
                                     data=DataConfig(data="/d"))
    assert flat == sectioned and flat.training.skip_steps == "2,4" and flat.compile.compile is True
    assert TrainConfig.from_keywords(compile=CompileConfig(compile=True), preset="tiny").compile.compile is True
    with pytest.raises(TypeError, match="unexpected keyword 'lr'"):
        TrainConfig.from_keywords(lr=1e-3)
    with pytest.raises(ValueError, match="--steps must be >= 1"):
        TrainConfig.from_keywords(steps=0)


def test_loop_options_at_the_top_level_of_a_file_or_an_older_config_json_still_load(tmp_path):
    """Config files and the run directories' config.json written before the loop sections hold `steps`,
    `precision`, `compile`, ... at the top level: they build the same config; the command line overrides them."""
    flat = {"steps": 50, "seed": 9, "precision": "fp32", "loss_scale": 65536.0, "compile": True,
            "activation_checkpointing": True, "model": {"n_layer": 3}}
    nested = {"training": {"steps": 50, "seed": 9}, "mixed_precision": {"precision": "fp32", "loss_scale": 65536.0},
              "compile": {"compile": True, "activation_checkpointing": True}, "model": {"n_layer": 3}}
    assert config_from_dict(flat) == config_from_dict(nested)
    assert config_from_dict(flat).training.steps == 50 and config_from_dict(flat).compile.activation_checkpointing
    written = config_from_dict(nested).to_dict()
    assert written["training"]["steps"] == 50 and "steps" not in written  # config.json: nested by section
    assert config_from_dict(written) == config_from_dict(nested)
    path = tmp_path / "old.toml"
    path.write_text('steps = 50\nprecision = "fp32"\n[optimizer]\nlr = 0.01\n')
    config = parse_train_args(["--config", str(path), "--steps", "60"])
    assert (config.training.steps, config.mixed_precision.precision, config.optimizer.lr) == (60, "fp32", 0.01)
    with pytest.raises(ValueError, match="steps is given twice, 5 at the top level and 6 in section training"):
        config_from_dict({"steps": 5, "training": {"steps": 6}})


def test_help_is_grouped_by_section_with_both_spellings(capsys):
    with pytest.raises(SystemExit):
        parse_train_args(["--help"])
    out = capsys.readouterr().out
    titles = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["options", "preset", *SECTIONS], titles
    assert "--steps INT, --training.steps INT" in out and "--precision STR, --mixed-precision.precision STR" in out
    config = parse_train_args(["--data", "/d", "--mixed-precision.precision", "fp16", "--loss-scale", "1024",
                               "--compile.compile", "--training.grad-accum", "3"])
    assert (config.mixed_precision.precision, config.mixed_precision.loss_scale) == ("fp16", 1024.0)
    assert config.compile.compile and config.training.grad_accum == 3


def test_command_line_short_and_sectioned_forms():
    config = parse_train_args(["--data", "/d", "--lr", "1e-3", "--model.n-layer", "3", "--grad-accum", "2",
                               "--compile", "--shuffle", "false", "--d-ff", "none", "--parallel", "fsdp"])
    assert config.data.data == "/d" and config.optimizer.lr == 1e-3 and config.model.n_layer == 3
    assert config.training.grad_accum == 2 and config.compile.compile is True and config.data.loader.shuffle is False
    assert config.model.d_ff is None and config.parallelism.parallel == "fsdp"


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_config_file_then_command_line(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"preset": "tiny", "steps": 50, "optimizer": {"lr": 0.01, "warmup_steps": 5},
                                    "model": {"n_layer": 3}}))
    else:
        path.write_text('preset = "tiny"\nsteps = 50\n[optimizer]\nlr = 0.01\nwarmup_steps = 5\n[model]\nn_layer = 3\n')
    config = parse_train_args(["--config", str(path), "--lr", "0.02"])
    assert (config.training.steps, config.optimizer.lr, config.optimizer.warmup_steps, config.model.n_layer) == (50, 0.02, 5, 3)


def test_bad_config_file_and_bad_value_exit_with_a_message(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nlearning_rate = 1\n")
    with pytest.raises(SystemExit):
        parse_train_args(["--config", str(bad)])
    assert "optimizer.learning_rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_train_args(["--steps", "many"])
    assert "expected int" in capsys.readouterr().err


def test_help_shows_field_docs(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "--optimizer.lr" in out and "--lr FLOAT" in out
    assert "peak learning rate" in out and "--document-mask" in out and "--config FILE" in out


def test_warmup_defaults_to_a_tenth_of_the_steps_at_most_100():
    assert config_from_dict({"steps": 30}).optimizer.warmup_steps == 3
    assert config_from_dict({"steps": 5000}).optimizer.warmup_steps == 100
    assert config_from_dict({"steps": 30, "optimizer": {"warmup_steps": 7}}).optimizer.warmup_steps == 7


def test_every_loader_option_is_a_trainer_option(capsys):
    config = parse_train_args(["--data", "/d", "--shuffle-window", "64", "--cache-limit", "1000000", "--data-seed", "5",
                               "--data.block-size", "16", "--seed", "7", "--partial-batches", "pad", "--prefetch", "false"])
    assert config.data.loader == LoaderConfig(shuffle_window=64, cache_limit=1_000_000, seed=5, block_size=16,
                                              partial_batches="pad", prefetch=False)
    assert config.training.seed == 7  # --seed seeds the weights; the order's seed is --data-seed
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(LoaderConfig):
        name = "data_seed" if f.name == "seed" else f.name
        assert f"--{name.replace('_', '-')} " in out, name
    assert "samples shuffled together within a partition" in out  # the field's own help text


def test_config_json_round_trips_the_nested_loader_section():
    config = parse_train_args(["--data", "/d", "--shuffle-window", "64", "--data-seed", "3"])
    again = config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.data.loader.seed == 3


def test_data_takes_several_weighted_entries():
    config = parse_train_args(["--data", "s3://bucket/web:0.7", "s3://bucket/code:0.3", "--steps", "5"])
    assert data_entries(config.data.data) == [("s3://bucket/web", 0.7), ("s3://bucket/code", 0.3)]
    assert data_entries("/a/b:2,/c:1e-1") == [("/a/b", 2.0), ("/c", 0.1)]
    # ':' inside a URL is not a weight; only a trailing :NUMBER after a path is.
    assert data_entries("s3://bucket/x") == [("s3://bucket/x", 1.0)]
    assert data_entries("http://host:9000") == [("http://host:9000", 1.0)]
    assert data_entries("http://host:9000/ds:3") == [("http://host:9000/ds", 3.0)]
    assert data_entries("/data/v2:final") == [("/data/v2:final", 1.0)]


def test_help_states_every_presets_values_from_the_table(monkeypatch, capsys):
    """`--lr` used to say 3e-4 while the default preset trains at 3e-3: the help of every option a preset
    sets names the default preset's value and the others', read from PRESETS (changed here on purpose)."""
    import re

    import shardkit.train.config as config_module

    monkeypatch.setitem(config_module.PRESETS, "tiny", {**config_module.PRESETS["tiny"], "optimizer": {"lr": 7e-3}})
    with pytest.raises(SystemExit):
        parse_train_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert re.search(r"--optimizer\.lr FLOAT peak learning rate \(default: 0\.007, set by --preset tiny; other "
                     r"presets: gpt2-124m 0\.0006, gpt2-350m 0\.0003, llama-1b 0\.0003\)", text), text
    for preset, table in config_module.PRESETS.items():
        described = " ".join(f"--{key.replace('_', '-')} {value}" for values in table.values() for key, value in values.items())
        assert f"{preset} = {described}" in text
    assert "RoPE base (llama style) (default: 10000.0; --preset llama-1b 500000.0)" in text


@pytest.mark.parametrize("argv, message", [
    (["--data", "/a:1e308 /b:1e308"], "--data weights 1e+308, 1e+308: their sum must be finite"),
    (["--data", "/a:1e-320,/b:1e300"], "each share of it above zero"),
    (["--data", "/a", "--n-layer", str(10**29)], "the model would have about 5.32e+33 parameters (--n-layer 1000"),
    (["--data", "/a", "--d-model", str(2**40), "--n-head", "1"], "more than 1e+13: check those sizes"),
    (["--data", "/a", "--make-vocab-size-divisible-by", str(2**40)], "--make-vocab-size-divisible-by must be in 1-"),
])
def test_absurd_weights_and_model_sizes_are_one_line_before_anything_runs(capsys, argv, message):
    from shardkit.cli import main

    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardkit train: error:") and message in err and "\n" not in err, err


def test_global_batch_tokens_derives_the_gradient_accumulation_or_says_what_does_not_divide():
    config = config_from_dict({"preset": "gpt2-124m", "global_batch_tokens": 524288})
    assert config.data.batch_size == 32 and config.training.grad_accum is None  # resolved once seq_len and dp are known
    resolved = with_step_size(config, seq_len=1024, dp_size=2)
    assert resolved.training.grad_accum == 8
    assert describe_step(resolved, seq_len=1024, dp_size=2) == (
        "one optimizer step holds 524,288 tokens: --batch-size 32 x seq_len 1024 x --grad-accum 8 micro-steps x 2 "
        "data-parallel rank(s)")
    with pytest.raises(ValueError, match="--global-batch-tokens 524288 is not a multiple of one micro-step's 98304 "
                                         "tokens .--batch-size 32 x seq_len 1024 x 3 data-parallel ranks."):
        with_step_size(config, seq_len=1024, dp_size=3)
    with pytest.raises(ValueError, match="is not a multiple"):  # less than one micro-step is no step
        with_step_size(dataclasses.replace(config, training=dataclasses.replace(config.training, global_batch_tokens=1024)),
                       seq_len=1024, dp_size=1)
    agreeing = dataclasses.replace(config, training=dataclasses.replace(config.training, grad_accum=8))
    assert with_step_size(agreeing, seq_len=1024, dp_size=2) == agreeing
    with pytest.raises(ValueError, match="--grad-accum 4 disagrees with --global-batch-tokens 524288, which needs 8"):
        with_step_size(dataclasses.replace(config, training=dataclasses.replace(config.training, grad_accum=4)),
                       seq_len=1024, dp_size=2)
    plain = config_from_dict({})
    assert plain.training.grad_accum == 1 and with_step_size(plain, seq_len=1024, dp_size=8) == plain
    with pytest.raises(ValueError, match="--global-batch-tokens must be >= 1"):
        config_from_dict({"global_batch_tokens": 0})
    # Each GPU preset names its micro-batch (docs/PARALLELISM.md, "How big a step is").
    assert {name: table.get("data", {}).get("batch_size") for name, table in PRESETS.items()} == {
        "tiny": None, "gpt2-124m": 32, "gpt2-350m": 16, "llama-1b": 8}
