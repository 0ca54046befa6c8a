"""A private PostgreSQL server for the tests: initdb into a temporary directory, listen on 127.0.0.1 only.

Uses the Debian `postgresql` package's binaries (`.ci/run` installs it); PostgreSQL refuses to run as
root, so as root the server runs as the `postgres` system user. Trust authentication on loopback only:
the server is private to the test and gone with it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import free_port


def binaries() -> Path | None:
    """The directory of `initdb` and `pg_ctl`, newest version first; None where PostgreSQL is absent."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    """`start()` a fresh cluster on a free loopback port; `url(database)` is its SQLAlchemy URL."""

    def __init__(self, port: int):
        self.bin = binaries()
        if self.bin is None:
            raise FileNotFoundError("PostgreSQL's initdb is not installed (apt-get install postgresql)")
        self.port = port
        self.directory = Path(tempfile.mkdtemp(prefix="shardkit-pg-"))
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)  # KeyError where the package did not create the user
            os.chown(self.directory, entry.pw_uid, entry.pw_gid)

    def _run(self, *command: str) -> None:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        subprocess.run([*prefix, *command], check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> None:
        data = self.directory / "data"
        self._run(str(self.bin / "initdb"), "-D", str(data), "-A", "trust", "-U", "shardkit", "--no-sync")
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.directory} -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(self.directory / "log"),
                  "-w", "start")
        deadline = time.monotonic() + 30
        while subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"PostgreSQL did not accept connections on port {self.port}")
            time.sleep(0.2)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://shardkit@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.directory / "data"), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL server for the test module (skips where PostgreSQL or psycopg2 is absent)."""
    pytest.importorskip("psycopg2", reason="psycopg2-binary is needed for the PostgreSQL tests ([dev])")
    if binaries() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run installs it)")
    server = PostgresServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def new_database(server: PostgresServer, name: str) -> str:
    """Create database `name` on `server`; its SQLAlchemy URL."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(server.url(), isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return server.url(name)
