"""The study's home: Optuna's RDB storage (SQLite by default, any SQLAlchemy URL), and recovery of
trials whose tuner died.

A trial in state RUNNING whose tuner is gone would hold its place forever. Each trial records its
owner (host, pid, process start time). A rerun on the same host marks the RUNNING trials of dead
tuners FAIL at once; trials of other machines are judged by Optuna's heartbeat (the owner records one
every `--heartbeat-s`; silence for 4x that marks the trial FAIL). Either way the failed trial's
parameters are enqueued again, so an interrupted trial is retried with the same values.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import inspect
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GRACE_FACTOR = 4
PBT_MEMBER = "pbt_member"  # the user attribute that makes a trial one PBT member's round


def redact(url: str) -> str:
    """The URL with every secret it may hold hidden, whatever its shape (for messages and logs): the
    user-info's password (up to the last '@', which a password may contain), every query parameter's
    value (`?password=...`), and anything after the scheme of a string that is no URL at all."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return f"{url.split(':', 1)[0]}:***" if ":" in url else "***"
    authority_end = min((i for i in (rest.find("?"), len(rest)) if i >= 0))
    at = rest.rfind("@", 0, authority_end)
    if at >= 0:
        user = rest[:at].split(":", 1)[0] if ":" in rest[:at] else ""
        rest = f"{user}:***@{rest[at + 1:]}" if user else f"***@{rest[at + 1:]}"
    path, question, query = rest.partition("?")
    if question:
        query = "&".join(f"{pair.split('=', 1)[0]}=***" if "=" in pair else "***" for pair in query.split("&"))
    return f"{scheme}://{path}{question}{query}"


def scrub(text: str, url: str) -> str:
    """`text` (e.g. a database driver's error message) with `url` and each secret piece of it hidden."""
    text = text.replace(url, redact(url))
    for secret in _secret_pieces(url):
        text = text.replace(secret, "***")
    return text


def _secret_pieces(url: str) -> list[str]:
    """The substrings of `url` that `redact` hides (the longest first), at least 3 characters long."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        pieces = [url.split(":", 1)[1]] if ":" in url else [url]
    else:
        at = rest.rfind("@", 0, rest.find("?") if "?" in rest else len(rest))
        pieces = [rest[:at].split(":", 1)[-1]] if at >= 0 else []
        pieces += [pair.split("=", 1)[-1] for pair in rest.partition("?")[2].split("&")]
    return sorted((p for p in pieces if len(p) >= 3), key=len, reverse=True)


def storage_full(err: BaseException, url: str) -> OSError | None:
    """One line when `err` (Optuna's, SQLAlchemy's or the driver's, any depth of causes) says the study
    database could not grow because its disk is full; None for any other error."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    if not any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in str(e)
               or "No space left" in str(e) for e in seen):
        return None
    where = ""
    if url.startswith("sqlite:///"):
        directory = Path(url[len("sqlite:///"):]).parent
        try:
            where = f" in {directory} ({shutil.disk_usage(directory).free:,} bytes free)"
        except OSError:
            where = f" in {directory}"
    return OSError(errno.ENOSPC, f"no space left for the study database {redact(url)}{where}: free space and rerun "
                                 "the same command (the trials it interrupted are retried)")


def default_url(output: Path) -> str:
    return f"sqlite:///{output.resolve() / 'study.db'}"


def open_storage(url: str, *, heartbeat_s: int):
    """An `optuna.storages.RDBStorage` for `url`.

    Raises:
        OSError: the database cannot be reached or opened, or its driver is not installed (one line,
            password hidden).
    """
    import optuna

    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Parallel trials write from several threads: wait for SQLite's lock instead of failing.
        engine_kwargs["connect_args"] = {"timeout": 60}
    # Optuna 4.9 renamed the stale-trial callback; older releases know only the first name.
    callback = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in
                inspect.signature(optuna.storages.RDBStorage).parameters else "failed_trial_callback")
    try:
        with study_lock(url):
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_s,
                                              grace_period=GRACE_FACTOR * heartbeat_s, **{callback: retry_failed})
    except ModuleNotFoundError as err:
        raise OSError(f"cannot open --storage {redact(url)}: its database driver is not installed "
                      f"({err}); install it, e.g. pip install psycopg2-binary or pymysql") from None
    except Exception as err:  # SQLAlchemy's errors (unreachable server, bad URL) share no builtin base
        reason = scrub(str(getattr(err, "orig", None) or err).strip().splitlines()[0], url)
        raise OSError(f"cannot open --storage {redact(url)}: {reason}") from None


# The lock that PostgreSQL's and MySQL's tuners take while one of them creates the study's tables.
_SERVER_LOCKS = {"postgresql": ("SELECT pg_advisory_lock(751902)", "SELECT pg_advisory_unlock(751902)"),
                 "mysql": ("SELECT GET_LOCK('shardkit-tune', 600)", "SELECT RELEASE_LOCK('shardkit-tune')")}


@contextlib.contextmanager
def study_lock(url: str):
    """One tuner at a time holds a study database's lock: while it creates the tables (tuners started together
    on a new study would otherwise race on CREATE TABLE: SQLite "UNIQUE constraint failed: alembic_version";
    PostgreSQL "duplicate key value violates unique constraint pg_type_typname_nsp_index", since its CREATE
    TABLE is not serialised either), and while a PBT tuner claims a member's round (`shardkit.tune.pbt`). A
    SQLite file is locked beside it, a server database with its own lock (PostgreSQL's advisory lock, MySQL's
    GET_LOCK), so tuners on several hosts exclude each other."""
    dialect = url.split(":", 1)[0].split("+", 1)[0]
    if dialect in _SERVER_LOCKS:
        import sqlalchemy

        lock, unlock = _SERVER_LOCKS[dialect]
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        try:
            with engine.connect() as connection:
                connection.execute(sqlalchemy.text(lock))
                try:
                    yield
                finally:
                    connection.execute(sqlalchemy.text(unlock))
        finally:
            engine.dispose()
        return
    path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else ""
    if not path or not Path(path).parent.is_dir():
        yield
        return
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is not mistaken for it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner(pid: int | None = None) -> dict[str, Any]:
    """Who runs a trial (this process, or process `pid`): recorded so that a later tuner can tell whether
    it is still alive."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid)}


def owner_alive(record: dict[str, Any]) -> bool:
    """Whether the process `record` names runs on this host still (another host's: not known, False)."""
    return _owner_dead(record) is False


def _owner_dead(record: dict[str, Any]) -> bool | None:
    """True/False for an owner on this host; None for another host (the heartbeat decides)."""
    if record.get("host") != socket.gethostname():
        return None
    pid = int(record.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    start = _start_time(pid)
    if _state(pid) == "Z":  # exited, not yet reaped by its parent: it writes nothing more
        return True
    return record.get("start") is not None and start is not None and start != record["start"]


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, Z, ...; Linux), None when unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def retry_failed(study, trial) -> None:
    """Enqueue a failed trial's parameters again (also Optuna's callback for heartbeat-stale trials). A PBT
    member's round is not enqueued: its failed trial leaves the round unclaimed, and the population claims it
    again with the hyperparameters and checkpoint the population's plan gives it (`shardkit.tune.pbt`)."""
    if PBT_MEMBER in trial.user_attrs:
        logger.info("PBT trial %d (member %s) was interrupted: marked failed, its round is claimed again",
                    trial.number, trial.user_attrs[PBT_MEMBER])
        return
    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number}, skip_if_exists=False)
    logger.info("trial %d was interrupted: marked failed, its parameters are queued again", trial.number)


def recover_interrupted(study, *, grace_s: float) -> list[int]:
    """Mark RUNNING trials of dead tuners FAIL and queue their parameters again; returns their numbers."""
    import optuna
    from optuna.trial import TrialState

    optuna.storages.fail_stale_trials(study)  # other machines' trials, by heartbeat (calls retry_failed)
    recovered = []
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        record = trial.user_attrs.get("tuner")
        if record is None:  # the tuner died between asking for the trial and recording itself
            dead = trial.datetime_start is not None and (now - trial.datetime_start).total_seconds() > grace_s
        else:
            dead = bool(_owner_dead(record))
        if not dead:
            continue
        try:  # a finished trial takes no attributes: mark it first, then fail it
            study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
            study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
        except RuntimeError:  # another tuner recovered it first (UpdateFinishedTrialError)
            continue
        retry_failed(study, trial)
        recovered.append(trial.number)
    return recovered
