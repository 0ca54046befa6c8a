"""PBT tuners claiming members' rounds at the same moment, on one study: each round is claimed once (the
study's lock: a lock file beside SQLite, PostgreSQL's advisory lock), whichever process asks."""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

from postgres_server import new_database, postgres  # noqa: F401  (postgres: the server fixture)

POPULATION, PROCESSES = 8, 3


def _claim_all(url: str, study_name: str, output: str, barrier, results) -> None:
    """One tuner: open the study, wait for the others, then claim rounds until none is free."""
    import optuna

    from shardkit.tune.config import TuneConfig
    from shardkit.tune.pbt import PopulationRun, population_fingerprint
    from shardkit.tune.space import parse_space
    from shardkit.tune.storage import open_storage
    from shardkit.tune.study import check_fingerprint

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    config = TuneConfig(sampler="pbt", population=POPULATION, perturb_every=1, storage=url)
    params, values = parse_space(["lr=loguniform:1e-3:1e-2"]), {"steps": 1}
    study = optuna.create_study(study_name=study_name, storage=open_storage(url, heartbeat_s=30),
                                direction="minimize", load_if_exists=True)
    check_fingerprint(study, population_fingerprint(config, params, values))
    run = PopulationRun(config=config, params=params, base_values=values, output=Path(output),
                        study=study, storage_url=url)
    barrier.wait()
    claimed = []
    while not isinstance(claim := run.claim(), str) and claim is not None:
        claimed.append((claim.member, claim.round_index))
    results.put(claimed)


def _claim_at_once(url: str, study_name: str, folder: Path) -> list[list[tuple[int, int]]]:
    """PROCESSES tuners started together on a new study `study_name`: the rounds each one claimed."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(PROCESSES), context.Queue()
    tuners = [context.Process(target=_claim_all, args=(url, study_name, str(folder / f"host-{i}"), barrier, results))
              for i in range(PROCESSES)]
    for tuner in tuners:
        tuner.start()
    claimed = [results.get(timeout=120) for _ in tuners]
    for tuner in tuners:
        tuner.join(timeout=30)
    assert [t.exitcode for t in tuners] == [0] * PROCESSES
    return claimed


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_rounds_claimed_at_once_by_several_tuners_are_each_claimed_once(database, tmp_path, request):
    url = (new_database(request.getfixturevalue("postgres"), "claims") if database == "postgresql"
           else f"sqlite:///{tmp_path / 'study.db'}")
    # On a loaded machine one tuner may claim every round before the others are scheduled past the barrier (once
    # in a full run): that attempt tested no contention, so a new study is tried; every attempt's claims must be
    # exactly once, whichever.
    for attempt in range(3):
        claimed = _claim_at_once(url, f"claims-{attempt}", tmp_path / f"attempt-{attempt}")
        every = Counter(unit for claims in claimed for unit in claims)
        assert sorted(every) == [(m, 0) for m in range(POPULATION)], every
        assert set(every.values()) == {1}, f"rounds claimed twice: {[u for u, n in every.items() if n > 1]}"
        if sum(bool(claims) for claims in claimed) >= 2:
            break
    assert sum(bool(claims) for claims in claimed) >= 2, claimed  # the tuners did claim side by side
