"""One trainer run as a subprocess: launch it, follow its evaluations as they are written, stop it early.

A trial is a real `python -m shardkit.train` (one rank) or `python -m torch.distributed.run -m
shardkit.train` (K ranks) with its own run directory, started with this interpreter so that the same
environment is used. Its options go in `RUN_DIR/trial.toml` (passed as `--config`), except
`--storage-options`, which may hold credentials: it is never written to disk nor put on the command line
(which every local user can read in /proc/PID/cmdline), but passed in the trainer's environment
(`SHARDKIT_STORAGE_OPTIONS`, readable only by the same user). The trainer appends
a record per step and `{"step": S, "eval_loss": X}` at every `--eval-every` to `RUN_DIR/metrics.jsonl`;
the runner reads the file as it grows and hands each record to a callback, which may stop the run
(pruning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.tune import tomlfile

logger = logging.getLogger(__name__)

CONFIG_NAME = "trial.toml"
LOG_NAME = "trial.log"
OWNER_NAME = "trainer.json"  # the trainer process now running in the run directory (host, pid, start time)
STOP_GRACE_S = 30.0  # after SIGTERM the trainer finishes its step and saves; then SIGKILL


class MetricsPorts:
    """Metrics ports for trials that run at once: with `--metrics-port P`, the k-th trial running serves
    its ranks on P + k * nproc + local rank, so no two trainers ask for one port.

    Raises:
        ValueError: the last port would pass 65535 (naming the options to change).
    """

    def __init__(self, base: int, *, slots: int, nproc: int):
        last = base + slots * nproc - 1
        if base and last > 65535:
            raise ValueError(f"--metrics-port {base} leaves no room for {slots} trial(s) at once of {nproc} rank(s) "
                             f"each (ports up to {last}); lower --metrics-port below {65536 - slots * nproc + 1} "
                             "or --parallel-trials")
        self.base, self.nproc = base, nproc
        self._free = list(range(slots))
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self):
        """The first port of a free slot for one trial (0 when metrics are off), free again afterwards."""
        if not self.base:
            yield 0
            return
        with self._lock:
            slot = self._free.pop(0)
        try:
            yield self.base + slot * self.nproc
        finally:
            with self._lock:
                self._free.append(slot)
                self._free.sort()


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What to run: nested trainer option values (run_dir included), ranks, the secret option, and the
    metrics ports of the trials running at once."""

    run_dir: Path
    values: dict[str, Any]
    nproc: int = 1
    storage_options: str | None = None
    ports: MetricsPorts | None = None


@dataclass(kw_only=True)
class Outcome:
    """How a run ended. `stopped`: the runner terminated it (pruned, or the tuner is stopping)."""

    returncode: int
    records: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False
    seconds: float = 0.0
    log: Path | None = None

    def tail(self, lines: int = 5) -> str:
        """The end of the trial's log, for error messages."""
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def command(config_path: Path, *, nproc: int) -> list[str]:
    """The trainer command line: torchrun only when it adds ranks."""
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                    "-m", "shardkit.train"]
    else:
        launcher = [sys.executable, "-m", "shardkit.train"]
    return [*launcher, "--config", str(config_path)]


def environment(storage_options: str | None) -> dict[str, str]:
    """The trainer's environment: this one, with the storage options (credentials) as the trainer reads them."""
    from shardkit.train.__main__ import STORAGE_OPTIONS_ENV

    env = dict(os.environ)
    env.pop(STORAGE_OPTIONS_ENV, None)
    if storage_options:
        env[STORAGE_OPTIONS_ENV] = storage_options
    return env


class MetricsFollower:
    """Reads the records appended to a metrics.jsonl since the last call (complete lines only). A trainer
    that resumes in a run directory replaces the file (keeping the records up to its checkpoint's step):
    the follower then reads the new file from its start."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.identity: tuple[int, int] | None = None

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                status = os.fstat(handle.fileno())
                if (status.st_dev, status.st_ino) != self.identity or status.st_size < self.offset:
                    self.identity, self.offset = (status.st_dev, status.st_ino), 0
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _terminate(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        logger.warning("trainer %d ignored SIGTERM for %.0fs: killing it", process.pid, STOP_GRACE_S)
        process.kill()
        process.wait()


def run_trainer(launch: Launch, *, on_record: Callable[[dict[str, Any]], bool] | None = None,
                stop: threading.Event | None = None, tick: Callable[[], None] | None = None,
                poll_s: float = 0.2) -> Outcome:
    """Run the trainer to its end, or until `on_record(record)` returns True or `stop` is set.

    Args:
        launch: what to run.
        on_record: called for each metrics record in order as it appears; True stops the run.
        stop: set by another thread to stop the run (the tuner is shutting down).
        tick: called every poll (the tuner's heartbeat).
    """
    with launch.ports.take() if launch.ports else contextlib.nullcontext(0) as port:
        if port:
            launch = dataclasses.replace(launch, values={**launch.values, "logging": {
                **launch.values.get("logging", {}), "metrics_port": port}})
        return _run(launch, on_record=on_record, stop=stop, tick=tick, poll_s=poll_s)


def _wait_for_earlier_trainer(run_dir: Path, stop: threading.Event | None, poll_s: float) -> None:
    """Wait while a trainer an earlier tuner started in `run_dir` still runs (a tuner SIGKILLed leaves its
    trainers running): two trainers must never write one run directory's checkpoints and logs at once."""
    from shardkit.tune.storage import owner_alive

    try:
        record = json.loads((run_dir / OWNER_NAME).read_text())
    except (OSError, ValueError):
        return
    if not isinstance(record, dict) or not owner_alive(record):
        return
    logger.warning("%s: waiting for trainer pid %s, started there by an earlier tuner, to finish first", run_dir,
                   record.get("pid"))
    while owner_alive(record) and not (stop is not None and stop.is_set()):
        time.sleep(poll_s)


def _run(launch: Launch, *, on_record: Callable[[dict[str, Any]], bool] | None, stop: threading.Event | None,
         tick: Callable[[], None] | None, poll_s: float) -> Outcome:
    from shardkit.tune.storage import owner

    launch.run_dir.mkdir(parents=True, exist_ok=True)
    _wait_for_earlier_trainer(launch.run_dir, stop, poll_s)
    config_path = tomlfile.write(launch.run_dir / CONFIG_NAME, launch.values,
                                 header="trainer options of this trial, written by shardkit tune")
    log_path = launch.run_dir / LOG_NAME
    follower = MetricsFollower(launch.run_dir / "metrics.jsonl")
    outcome = Outcome(returncode=0, log=log_path)
    started = time.monotonic()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command(config_path, nproc=launch.nproc), env=environment(launch.storage_options),
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            tomlfile.write_text(launch.run_dir / OWNER_NAME, json.dumps(owner(process.pid)))
            while True:
                finished = process.poll() is not None  # read the file once more after the process ended
                for record in follower.new_records():
                    if outcome.stopped:
                        break
                    outcome.records.append(record)
                    if on_record is not None and on_record(record):
                        outcome.stopped = True
                        _terminate(process)
                if stop is not None and stop.is_set() and not finished:
                    outcome.stopped = True
                    _terminate(process)
                if finished or process.poll() is not None and outcome.stopped:
                    break
                if tick is not None:
                    tick()
                time.sleep(poll_s)
        finally:
            _terminate(process)  # also on an exception in this thread: never leave a trainer behind
    outcome.returncode = process.returncode
    outcome.seconds = time.monotonic() - started
    return outcome
