"""Loader states saved by a released loader still load and resume exactly (`tests/state_fixtures.py` says how the
fixtures were made): built data with and without workers, a built mixture, a standalone dataset's state, raw text
with and without workers, and a mixture of raw and built streams."""

from __future__ import annotations

import itertools
import json

import pytest

from state_fixtures import AFTER, CASES, FIXTURES, data_root, rows

FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))


def test_every_case_has_a_fixture():
    assert sorted(path.stem for path in FIXTURE_FILES) == sorted(CASES)


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda path: path.stem)
def test_a_saved_state_resumes_exactly(path, tmp_path):
    fixture = json.loads(path.read_text())
    loader = CASES[fixture["case"]](data_root(), tmp_path / "cache")
    loader.load_state_dict(fixture["state"])
    got = rows(itertools.islice(iter(loader), AFTER))
    assert got == fixture["next"], f"{path.name}: the batches after the saved state differ from the recorded ones"
