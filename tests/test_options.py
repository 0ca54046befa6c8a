"""The one option machinery (`shardkit.options`): kebab-case names with snake_case aliases on every
command, one size parser and one size formatter."""

from __future__ import annotations

import argparse
import json

import pytest

from shardkit.cli import build_parser, main
from shardkit.options import OptionParser, format_size, parse_size
from shardkit.train.options import add_train_arguments, parse_train_args


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser: `shardkit X [Y]` and `python -m shardkit.train`."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}")

    walk(build_parser(), "shardkit")
    train = OptionParser(prog="python -m shardkit.train")
    add_train_arguments(train)
    found["python -m shardkit.train"] = train
    return found


def test_every_option_of_every_command_is_kebab_case():
    commands = _commands()
    assert {"shardkit build", "shardkit inspect", "shardkit verify", "shardkit cat", "shardkit trace",
            "shardkit train", "shardkit tune", "shardkit plot", "shardkit demo", "shardkit tokenizer train",
            "python -m shardkit.train"} <= set(commands)
    for command, parser in commands.items():
        for action in parser._actions:
            for name in action.option_strings:
                assert "_" not in name, f"{command}: option {name} is not kebab-case"


def test_help_lists_kebab_case_names_only(capsys):
    for argv in (["train", "--help"], ["build", "--help"], ["tune", "--help"], ["trace", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        out = capsys.readouterr().out
        assert "--eval-every" in out or argv[0] in ("build", "trace")
        # torchrun's own --nproc_per_node (in the description) is not a shardkit option
        options = [word for word in out.split() if word.startswith("--") and "nproc_per_node" not in word]
        assert options and not [o for o in options if "_" in o.split("=")[0].split(".")[-1]], argv


def test_snake_case_alias_of_every_trainer_option_gives_the_same_config():
    kebab = parse_train_args(["--data", "/d", "--eval-every", "5", "--batch-size", "3", "--cache-limit", "64MB",
                              "--optimizer.min-lr-ratio", "0.2", "--tie-embeddings", "false", "--data-seed=4"])
    snake = parse_train_args(["--data", "/d", "--eval_every", "5", "--batch_size", "3", "--cache_limit", "64MB",  # respell: keep
                              "--optimizer.min_lr_ratio", "0.2", "--tie_embeddings", "false", "--data_seed=4"])  # respell: keep
    assert kebab == snake
    assert kebab.training.eval_every == 5 and kebab.data.loader.cache_limit == 64 * 10**6 and kebab.data.loader.seed == 4
    assert kebab.optimizer.min_lr_ratio == 0.2 and kebab.model.tie_embeddings is False


def test_snake_case_alias_on_the_build_and_the_negative_flags():
    from shardkit.cli.build import config_from_args

    argv = ["build", "in.jsonl", "--output", "o", "--tokenizer", "byte", "--seq_len", "8",  # respell: keep
            "--shard_size", "1.5KiB", "--no_progress", "--on_error", "fail"]  # respell: keep
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.seq_len, config.shard_size, config.progress, config.on_error) == (8, 1536, False, "fail")
    assert parse_train_args(["--data", "/d", "--no-tensorboard"]).logging.tensorboard is False


def test_values_after_double_dash_are_not_respelled():
    parser = OptionParser()
    parser.add_argument("--some-flag", action="store_true")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--some_flag", "--", "--keep_me"])  # respell: keep
    assert args.some_flag and args.rest == ["--keep_me"]  # respell: keep


def test_errors_name_the_kebab_case_option(capsys):
    with pytest.raises(SystemExit):
        parse_train_args(["--data", "/d", "--batch_size", "0"])  # respell: keep
    err = capsys.readouterr().err
    assert "--batch-size must be >= 1" in err and "batch_size" not in err
    with pytest.raises(SystemExit):
        parse_train_args(["--data", "/d", "--cache-limit", "lots"])
    err = capsys.readouterr().err
    assert "--cache-limit" in err and "cannot read 'lots' as a size" in err
    assert main(["build", "x.jsonl", "--output", "o", "--tokenizer", "byte", "--seq-len", "0"]) == 2
    assert "--seq-len must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [
    ("64MB", 64 * 10**6), ("64mb", 64 * 10**6), ("1.5GiB", 3 * 2**29), ("64M", 64 * 2**20), ("2k", 2048),
    ("1000", 1000), (" 3 KB ", 3000), ("1TB", 10**12), ("1T", 2**40), (".5KiB", 512), (4096, 4096),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "1.2.3MB", "64 megabytes", "-5", "0", "0.1", True])
def test_parse_size_refuses_naming_the_option(text):
    with pytest.raises(ValueError, match="^--cache-limit"):
        parse_size(text, option="--cache-limit")


def test_format_size_round_trips_through_parse_size():
    assert format_size(812) == "812 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 2**29, exact=True) == "1.5 GiB (1,610,612,736 B)"
    for n in (1, 1023, 1024, 10**6, 3 * 2**29, 5 * 2**40):
        text = format_size(n).replace(" ", "").replace(",", "")
        assert abs(parse_size(text) - n) <= 0.05 * n


def test_loader_config_takes_a_size_text():
    from shardkit.loaders.config import LoaderConfig

    assert LoaderConfig(cache_limit="1.5GiB").cache_limit == 3 * 2**29
    with pytest.raises(ValueError, match="cache_limit"):
        LoaderConfig(cache_limit="big")


def test_space_names_a_trainer_option_by_either_spelling():
    from shardkit.tune.space import parse_param

    assert parse_param("warmup-steps=int:0:5") == parse_param("warmup_steps=int:0:5")
    assert parse_param("optimizer.min-lr-ratio=uniform:0:1") == parse_param("optimizer.min_lr_ratio=uniform:0:1")  # respell: keep


STORAGE_FLAGS = ["-o", "endpoint_url=http://127.0.0.1:9", "--storage-options", '{"anon": true, "retries": 3}',
                 "--storage-option", "retries=5", "--storage_options", 'client_kwargs={"region_name": "eu"}']  # respell: keep
STORAGE_WANTED = {"endpoint_url": "http://127.0.0.1:9", "anon": True, "retries": 5, "client_kwargs": {"region_name": "eu"}}


@pytest.mark.parametrize("argv, read", [
    (["build", "in.jsonl", "--output", "o", "--tokenizer", "byte", "--seq-len", "8"], "build"),
    (["convert", "src", "--from", "megatron", "--output", "o", "--tokenizer", "byte", "--seq-len", "8"], "convert"),
    (["inspect", "ds"], "InspectOptions"), (["verify", "ds"], "VerifyOptions"), (["cat", "ds", "-i", "0"], "CatOptions"),
    (["trace", "run", "--step", "1"], "TraceConfig"), (["train", "--data", "/d"], "train"),
    (["tune", "--data", "/d", "--space", "lr=loguniform:1e-4:1e-2"], "train"),
])
def test_storage_options_take_both_forms_under_every_name_on_every_command(argv, read):
    """KEY=VALUE and JSON objects, repeated, as -o, --storage-option or --storage-options (and its snake_case
    alias): one parser (`parse_storage_options`) reads them the same on every command; later keys win."""
    from shardkit.cli import build as build_cli, dataset, trace
    from shardkit.options import given_values, parse_storage_options
    from shardkit.tools.convert.config import ConvertConfig
    from shardkit.train.options import config_from_args as train_config

    args = build_parser().parse_args([*argv, *STORAGE_FLAGS])
    if read == "build":
        options = build_cli.config_from_args(args).storage_options
    elif read == "convert":
        options = build_cli.config_from_args(args, ConvertConfig).storage_options
    elif read == "train":
        options = parse_storage_options(getattr(args, "data.storage_options"))
        if argv[0] == "train":
            assert parse_storage_options(train_config(args).data.storage_options) == STORAGE_WANTED
    else:
        cls = getattr(dataset, read, None) or getattr(trace, read)
        options = parse_storage_options(given_values(args, cls)["storage_options"])
    assert options == STORAGE_WANTED
    # python -m shardkit.train (torchrun's entry) and its environment variable read them the same way
    assert parse_storage_options(parse_train_args(["--data", "/d", *STORAGE_FLAGS]).data.storage_options) == STORAGE_WANTED


def test_a_bad_storage_option_is_one_line_naming_the_option_never_its_value(capsys, monkeypatch):
    for argv in (["inspect", "ds", "-o", "TOPSECRETVALUE"], ["train", "--data", "/d", "--storage-options", "{TOPSECRET"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "TOPSECRET" not in err, err
        assert "argument --storage-option/--storage-options/-o: the value is neither KEY=VALUE nor a JSON object" in err \
            or "the value is not a JSON object" in err, err
    from shardkit.train.__main__ import STORAGE_OPTIONS_ENV, run
    from shardkit.train.config import TrainConfig, DataConfig

    monkeypatch.setenv(STORAGE_OPTIONS_ENV, "TOPSECRETVALUE")
    assert run(TrainConfig(data=DataConfig(data="/d"))) == 2
    err = capsys.readouterr().err
    assert "TOPSECRET" not in err and f"{STORAGE_OPTIONS_ENV}: --storage-options is neither KEY=VALUE" in err, err


def test_tune_hands_its_trials_the_storage_options_as_one_json_object(tmp_path, monkeypatch):
    """Whatever form they were given in (a --config table, KEY=VALUE, the environment), the trials' environment
    gets one JSON object, which the trainer reads back."""
    from shardkit.cli.tune import _values
    from shardkit.train.__main__ import STORAGE_OPTIONS_ENV
    from shardkit.options import parse_storage_options

    monkeypatch.delenv(STORAGE_OPTIONS_ENV, raising=False)
    config = tmp_path / "base.toml"
    config.write_text('[data]\nstorage_options = {anon = true, endpoint_url = "http://127.0.0.1:9"}\n')
    for argv in (["--config", str(config)], ["-o", "anon=true", "-o", "endpoint_url=http://127.0.0.1:9"]):
        args = build_parser().parse_args(["tune", "--data", "/d", "--space", "lr=loguniform:1e-4:1e-2", *argv])
        values, secret = _values(args, {"space"})
        assert json.loads(secret) == {"anon": True, "endpoint_url": "http://127.0.0.1:9"}
        assert "storage_options" not in values.get("data", {})
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, "anon=false")
    args = build_parser().parse_args(["tune", "--data", "/d", "--space", "lr=loguniform:1e-4:1e-2"])
    assert parse_storage_options(_values(args, {"space"})[1]) == {"anon": False}
