"""A study continues only with the trainer options that started it, whichever shape they are given in: the
top-level spelling of the release before the trainer had sections (`steps`) and the sectioned one
(`training.steps`) are the same options; other values are refused, naming what differs."""

from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")

from shardkit.tune.study import check_fingerprint  # noqa: E402


def study():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name="s", storage=optuna.storages.InMemoryStorage())


@pytest.mark.parametrize("first, then", [
    ({"steps": 4, "lr": 0.1}, {"training": {"steps": 4}, "lr": 0.1}),
    ({"training": {"steps": 4}, "lr": 0.1}, {"steps": 4, "lr": 0.1}),
    ({"steps": 4}, {"steps": 4}),
], ids=["flat-then-sectioned", "sectioned-then-flat", "flat-twice"])
def test_the_same_options_in_either_shape_continue_the_study(first, then):
    started = study()
    check_fingerprint(started, {"trainer_options": first})
    check_fingerprint(started, {"trainer_options": then})  # no error


def test_other_values_are_refused_naming_the_section():
    started = study()
    check_fingerprint(started, {"trainer_options": {"steps": 4}})
    with pytest.raises(ValueError, match=r"another trainer options \(differs in: training\)"):
        check_fingerprint(started, {"trainer_options": {"training": {"steps": 5}}})
