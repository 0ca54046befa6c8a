"""The study's home: Optuna's RDB storage (SQLite by default, any SQLAlchemy URL), and recovery of
trials whose tuner died.

A trial in state RUNNING whose tuner is gone would hold its place forever. Each trial records its
owner (host, pid, process start time). A rerun on the same host marks the RUNNING trials of dead
tuners FAIL at once; trials of other machines are judged by Optuna's heartbeat (the owner records one
every `--heartbeat-s`; silence for 4x that marks the trial FAIL). Either way the failed trial's
parameters are enqueued again, so an interrupted trial is retried with the same values.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import socket
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GRACE_FACTOR = 4


def redact(url: str) -> str:
    """The URL with its password hidden (for messages and logs)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL holds no recognisable password field: show only its scheme
        return url.split("://", 1)[0] + "://..."


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
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_s,
                                          grace_period=GRACE_FACTOR * heartbeat_s, **{callback: retry_failed})
    except ModuleNotFoundError as err:
        raise OSError(f"cannot open --storage {redact(url)}: its database driver is not installed "
                      f"({err}); install it, e.g. pip install psycopg2-binary or pymysql") from None
    except Exception as err:  # SQLAlchemy's errors (unreachable server, bad URL) share no builtin base
        reason = str(getattr(err, "orig", None) or err).strip().splitlines()[0]
        raise OSError(f"cannot open --storage {redact(url)}: {reason}") from None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is not mistaken for it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner() -> dict[str, Any]:
    """Who runs a trial: recorded in the trial so that a later tuner can tell whether it is still alive."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


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
    return record.get("start") is not None and start is not None and start != record["start"]


def retry_failed(study, trial) -> None:
    """Enqueue a failed trial's parameters again (also Optuna's callback for heartbeat-stale trials)."""
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
