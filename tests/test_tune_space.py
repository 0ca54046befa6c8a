"""The search-space grammar, PBT's explore and exploit steps, and the TOML writer (pure functions)."""

from __future__ import annotations

import math
import random
import tomllib

import pytest

from shardkit.train.config import config_from_dict
from shardkit.tune import tomlfile
from shardkit.tune.pbt_plan import exploit_and_explore
from shardkit.tune.space import apply, check_against_trainer, grid, parse_param, parse_space, perturb, sample

SPACE = ("lr=loguniform:1e-4:1e-2", "dropout=uniform:0:0.2", "optimizer.warmup_steps=int:0:200",
         "schedule=choice:cosine,wsd", "tie_embeddings=choice:true,false", "n_layer=int:1:3")


def test_parse_space_kinds_sections_and_typed_choices():
    lr, dropout, warmup, schedule, tie, layers = parse_space(SPACE)
    assert (lr.kind, lr.low, lr.high, lr.section) == ("loguniform", 1e-4, 1e-2, "optimizer")
    assert (dropout.section, warmup.section, warmup.name) == ("model", "optimizer", "warmup_steps")
    assert schedule.choices == ("cosine", "wsd") and tie.choices == (True, False)
    assert apply({"steps": 10}, (lr, layers), {"lr": 1e-3, "n_layer": 2}) == {
        "training": {"steps": 10}, "optimizer": {"lr": 1e-3}, "model": {"n_layer": 2}}


@pytest.mark.parametrize("spec, message", [
    ("lr", "expected NAME=KIND:ARGS"),
    ("lr=gaussian:0:1", "expected NAME=KIND:ARGS"),
    ("lr=uniform:1", "uniform takes LOW:HIGH"),
    ("lr=uniform:a:1", "'a' is not a number"),
    ("lr=uniform:1:1", "LOW must be smaller than HIGH"),
    ("lr=loguniform:0:1", "loguniform needs LOW > 0"),
    ("n_layer=uniform:1:4", "takes integers: use int:LOW:HIGH"),
    ("n_layer=int:1.5:4", "int bounds must be integers"),
    ("schedule=uniform:0:1", "use choice:A,B"),
    ("n_layer=choice:2,x", "choice 'x' is not a valid int"),
    ("n_layer=choice:2,2", "listed twice"),
    ("model.lr=uniform:0:1", "unknown trainer option 'model.lr'"),
    ("depth=int:1:4", "unknown trainer option 'depth'"),
    ("run_dir=choice:a,b", "set by the tuner"),
])
def test_malformed_space_names_the_spec(spec, message):
    with pytest.raises(ValueError, match="--space") as err:
        parse_space([spec])
    assert message in str(err.value)


def test_space_given_twice_and_values_the_trainer_refuses():
    with pytest.raises(ValueError, match="lr given more than once"):
        parse_space(["lr=uniform:0.1:1", "optimizer.lr=uniform:0.1:1"])
    with pytest.raises(ValueError, match="--warmup-steps .* must be smaller than --steps"):
        check_against_trainer(parse_space(["warmup_steps=int:0:200"]), {"steps": 100})
    check_against_trainer(parse_space(SPACE), {"steps": 1000})  # every edge is a valid trainer config


def test_sample_and_perturb_stay_inside_the_space():
    params = parse_space(SPACE)
    rng = random.Random(0)
    for _ in range(300):
        point = sample(params, rng)
        moved = perturb(point, params, rng)
        for param in params:
            assert param.contains(point[param.name]) and param.contains(moved[param.name]), param.spec
            if param.kind in ("loguniform", "uniform") and 0 < point[param.name]:
                ratio = moved[param.name] / point[param.name]
                assert math.isclose(ratio, 0.8) or math.isclose(ratio, 1.2) or moved[param.name] in (param.low, param.high)
        config_from_dict(apply({"steps": 1000}, params, moved))
    # An integer always moves by at least one step when its factor would round back to it.
    warmup = parse_space(["warmup_steps=int:0:10"])
    assert {perturb({"warmup_steps": 2}, warmup, random.Random(seed))["warmup_steps"] for seed in range(20)} == {1, 3}


def test_grid_values():
    values = grid(parse_space(["lr=loguniform:1e-4:1e-2", "warmup_steps=int:0:2", "n_layer=int:1:100",
                               "schedule=choice:wsd,cosine"]), 3)
    assert values["lr"] == pytest.approx([1e-4, 1e-3, 1e-2]) and 1e-4 <= min(values["lr"]) and max(values["lr"]) <= 1e-2
    assert values["warmup_steps"] == [0, 1, 2] and values["n_layer"] == [1, 50, 100]  # rounded 50.5 -> 50
    assert values["schedule"] == ["wsd", "cosine"]


def test_exploit_copies_a_top_member_into_each_bottom_member():
    space = parse_space(["lr=loguniform:1e-4:1e-1"])
    scores = {0: 3.0, 1: 1.0, 2: 2.0, 3: math.inf, 4: 1.5}
    params = {m: {"lr": 1e-3 * (m + 1)} for m in scores}
    decisions = exploit_and_explore(scores, params, space, quantile=0.4, rng=random.Random(1))
    assert set(decisions) == {0, 3}  # the two worst (a failed member counts as worst)
    for member, (source, new) in decisions.items():
        assert source in (1, 4)
        assert new["lr"] == pytest.approx(params[source]["lr"] * 0.8) or new["lr"] == pytest.approx(params[source]["lr"] * 1.2)


def test_toml_writer_round_trips_exactly(tmp_path):
    values = {"steps": 7, "seed": -3, "compile": False, "preset": 'ti"ny\\',
              "optimizer": {"lr": 0.007819616463345034, "eps": 1e-08, "min_lr_ratio": 1.0, "warmup_steps": None},
              "model": {"dropout": 5e-324}, "logging": {}}
    path = tomlfile.write(tmp_path / "x.toml", values, header="line one\nline two")
    loaded = tomllib.loads(path.read_text())
    assert loaded == {"steps": 7, "seed": -3, "compile": False, "preset": 'ti"ny\\',
                      "optimizer": {"lr": 0.007819616463345034, "eps": 1e-08, "min_lr_ratio": 1.0},
                      "model": {"dropout": 5e-324}}
    assert path.read_text().startswith("# line one\n# line two\n")


def test_toml_writer_writes_any_string_as_valid_toml(tmp_path):
    strange = {"logging": {"run_dir": "/tmp/runs/\U0001F600-\u00e9\u4e2d-\x7f\x00\x1b\"\\\n\t\r-\ufffd"}}
    path = tomlfile.write(tmp_path / "x.toml", strange)
    assert tomllib.loads(path.read_text(encoding="utf-8")) == strange  # what the trainer's --config reads
    with pytest.raises(ValueError, match="not UTF-8 text"):  # a path with undecodable bytes (surrogateescape)
        tomlfile.write(tmp_path / "y.toml", {"run_dir": b"/tmp/\xff".decode("utf-8", "surrogateescape")})


def test_loader_options_can_be_searched_and_section_names_and_bad_booleans_are_refused():
    window = parse_param("shuffle_window=int:1:8")
    seed = parse_param("data_seed=int:1:3")
    base = {"data": {"data": "/somewhere"}}
    check_against_trainer((window, seed), base)
    config = config_from_dict(apply(base, (window, seed), {"shuffle_window": 4, "data_seed": 7}))
    assert (config.data.loader.shuffle_window, config.data.loader.seed) == (4, 7)
    for spec, message in (("loader=uniform:0:1", "unknown trainer option 'loader'"),
                          ("optimizer=uniform:0:1", "unknown trainer option 'optimizer'"),
                          ("compile=choice:true,maybe", "choice 'maybe' is not a valid bool")):
        with pytest.raises(ValueError, match=message):
            check_against_trainer((parse_param(spec),), base)
