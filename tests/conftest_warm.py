"""The suite's trainers start warm: one node-wide warm-start server per test process (`shardkit.train.warm`,
`SHARDKIT_WARM_START_SOCKET`), from which every `python -m shardkit.train` a test starts (torchrun's ranks, the
one-rank trials of `shardkit tune`) is forked with torch and the trainer already imported.

A trainer rank cost ~6 CPU-seconds here, ~4.5 of them the interpreter's start and its imports, and the suite
starts a few hundred of them: on 2 cores that is minutes of the 25 the suite may take (issue 46). The ranks are
still real processes of a real torchrun agent running the installed trainer; only their start differs, and
the tests that are about how a trainer starts run it cold (`cold_environment`): the documented commands (a new
user's machine has no server), the elastic and warm-start tests (a node's loss takes its own agent's server
with it). `SHARDKIT_TEST_COLD=1` runs the whole suite cold.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from shardkit.train import warm


def cold_environment(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the suite's node-wide server: a trainer started with it imports everything itself (and a
    torchrun agent given SHARDKIT_WARM_START=1 explicitly gets its own per-agent server)."""
    return {key: value for key, value in env.items() if key not in (warm.ENABLE_VARIABLE, warm.SOCKET_VARIABLE)}


@pytest.fixture(scope="session", autouse=True)
def warm_trainers(tmp_path_factory):
    """Start this test process's server now (it imports while the first tests run) and name it in the
    environment every process a test starts inherits; stop it when the session ends."""
    if os.environ.get("SHARDKIT_TEST_COLD", "") == "1":
        yield None
        return
    directory = tmp_path_factory.mktemp("warm-start")
    directory.chmod(0o700)
    path = directory / "trainer.sock"
    os.environ[warm.ENABLE_VARIABLE] = "1"
    os.environ[warm.SOCKET_VARIABLE] = str(path)
    server = warm.start_server(path, warm.NO_AGENT)
    try:
        yield path
    finally:
        for variable in (warm.ENABLE_VARIABLE, warm.SOCKET_VARIABLE):
            os.environ.pop(variable, None)
        server.terminate()
        server.wait()
