"""Goodput under node losses: the share of wall time spent on steps that count, and what each failure costs.

A scripted job with the elastic recipe of docs/PARALLELISM.md: two simulated nodes on this machine
(tests/elastic_nodes.py: one `torchrun --nnodes 1:2 --rdzv-backend c10d` agent each, own node cache, CPU and
gloo) train the tiny model on a small built dataset with `--resume auto`. Node b's whole process tree is
SIGKILLed halfway between two checkpoints (the expected point of a random failure), node a re-forms alone,
node b starts again and the job scales back up; `--losses N` cycles. Every second of wall time is then put
in one place, from timestamps the agents and rank 0 log (the agents run with LOGLEVEL=INFO, which makes
torchrun log its steps with the time; the trainer logs its start-up milestones):

    detection        kill -> the surviving agent sees its worker group FAILED (a return: the node is
                     started -> the agent sees it waiting; training goes on meanwhile, so it is not lost)
    stop             -> the agent's new rendezvous round begins (a return: from the end of the last step,
                     so the checkpoint the stopped workers save on SIGTERM and their exit)
    rendezvous       -> the agents' round is complete
    start            -> the new workers log their first line (process start and `import torch`)
    process group    -> rank 0 joined the process group (every rank has started)
    loader           -> the training data is ready (manifest, node cache), plus checkpoint loaded -> loader
                     state restored, plus the first step's wait for its batch
    model            -> the model is built and wrapped (DDP/FSDP) with its optimizer
    checkpoint       -> the checkpoint is loaded (resharded to the new world size)
    other            loader restored -> the first step starts (run directory, sample logs, barrier)
    redone           the last complete checkpoint -> the kill: steps trained again

Goodput is the compute time of the steps that count (each step of the final metrics.jsonl, its step time
less its data wait) over the wall time from node a's start to the job's exit. Exactness is checked on
every run: per the trainer's sample-id logs, every step 1..--steps once and no sample id twice in the
epoch; the ids consumed are the first ones of the epoch's order (the one of an uninterrupted reader with
the job's 2 partitions), so none is missing.

    python benchmarks/bench_goodput.py --runs 3 [--losses 2] [--rdzv-conf keep_alive_interval=1,...] [--warm-start both]
        [--json bench_out/bench_goodput.json] [-- TRAINER OPTIONS, e.g. --async-save]
    python benchmarks/bench_goodput.py --save-cost --runs 3 --steps 300 [--modes process-dcp-staging process]
    python benchmarks/bench_goodput.py --save-cost --runs 3 --steps 300 --modes process-before process --baseline DIR
    python benchmarks/bench_goodput.py --runs 1 --warm-start on --steps 4400 --first-loss-after 2000 -- --async-save

`--save-cost` measures the checkpoint term alone: one process trains without checkpoints, with a synchronous
save every 10 steps and with a background one (`--async-save`) written by a thread of the trainer or by DCP's
writer process (`--async-writer`), the latter also staged by DCP's own stager (`process-dcp-staging`,
SHARDKIT_CHECKPOINT_STAGING=dcp: the code before `FlatStager`) or run from other code (`process-before`: the
directory `--baseline` first on PYTHONPATH, e.g. a `git archive` of main), interleaved (`--modes` picks some); per
mode the loop's time over steps N/5..N, the time each save holds the loop (as the trainer logs it, wall and CPU, and
its share of 10 steps of the run without checkpoints), what the two steps after a save take beyond the others (the
work a save leaves to threads shares the GIL with them), the median step time, the CPU seconds of the trainer
and its writer, and the one-time wait for the writer process to start (left out, as are the saves written
synchronously while it starts: on a real job it starts while the model is built and the first interval trains).

The two nodes share this machine's 2 cores: worker start-up (`import torch`) is slower than on real nodes,
and a SIGKILLed process's sockets close at once, so detection here is the fast case (docs/GOODPUT.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_elastic import _events as trainer_lines  # noqa: E402
from conftest import free_port  # noqa: E402
from elastic_nodes import Node, last_step, metric_records, store_listening, wait_for, world_changes  # noqa: E402
from train_runs import sample_ids, write_byte_dataset  # noqa: E402

SAMPLES, SEQ_LEN, PER_SHARD, BATCH = 4000, 32, 100, 4  # one epoch holds every step of a run (more for long runs)
PHASES = ("detection", "stop", "rendezvous", "start", "process_group", "loader", "model", "checkpoint", "other",
          "redone")
# torchrun's agent logs its steps (worker group failed, rendezvous round, workers started) at INFO in glog's
# format, month and day without the year, when LOGLEVEL=INFO.
# Rank 0's lines on a save: what it held the loop (wall, CPU), and completing a background save at a sync point.
HELD = re.compile(r"the save held the loop ([\d.]+)s \(([\d.]+)s of CPU\)")
COMPLETED = re.compile(r"completed \(background save\) after ([\d.]+)s")
AGENT_LINE = re.compile(r"^I(\d\d\d\d \d\d:\d\d:\d\d\.\d{6}) +\d+ \S+\] (.*)$", re.M)


def agent_lines(log: str, year: int) -> list[tuple[float, str]]:
    """(time, message) of the INFO lines of the torchrun agent in a node's log."""
    return [(datetime.strptime(f"{year}{stamp}", "%Y%m%d %H:%M:%S.%f").timestamp(), text)
            for stamp, text in AGENT_LINE.findall(log)]


def first_after(lines: list[tuple[float, str]], after: float, pattern: str) -> tuple[float, re.Match]:
    """The first line at or after `after` that matches `pattern`, with its match."""
    for at, text in lines:
        match = re.search(pattern, text)
        if at >= after and match:
            return at, match
    raise ValueError(f"no log line matching {pattern!r} after {after:.3f}")


class TunedNode(Node):
    """A simulated node whose agents take more rendezvous options (`--rdzv-conf`), e.g. a shorter keep-alive,
    started by shardkit's torchrun (`shardkit.train.elastic`, which starts the warm-start server with the agent
    when SHARDKIT_WARM_START=1)."""

    def __init__(self, *args, rdzv_conf: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.rdzv_conf = rdzv_conf

    def command(self) -> list[str]:
        command = super().command()
        command[command.index("torch.distributed.run")] = "shardkit.train.elastic"
        if self.rdzv_conf:
            at = command.index("--rdzv-conf") + 1
            command[at] = f"{command[at]},{self.rdzv_conf}"
        return command


def last_step_at(run_dir: Path, *, world_size: int) -> int:
    """The last step logged so far that `world_size` ranks trained (a record's rate over its rate per device)."""
    return max((r["step"] for r in metric_records(run_dir)
                if "loss" in r and round(r["tokens_per_s"] / r["tokens_per_s_per_device"]) == world_size), default=0)


def event_phases(kind: str, at: float, agent: list, trainer: list, steps: dict[int, dict]) -> dict[str, float]:
    """Split the training time a loss or a return cost into PHASES (seconds), from the logs' timestamps.

    `agent`: the surviving node's agent lines; `trainer`: rank 0's lines of both nodes, by time; `steps`:
    the final step records by step."""
    seen, _ = first_after(agent, at, "Worker group FAILED" if kind == "loss" else r"Detected \d+ new nodes")
    round_at, _ = first_after(agent, seen, "Rendezvous'ing worker group")
    formed, _ = first_after(agent, round_at, "Rendezvous complete for workers")
    setting_up, _ = first_after(trainer, formed, "setting up the run")
    joined, _ = first_after(trainer, setting_up, r"rank \d+/\d+ (joined the \w+ process group|runs alone)")
    data_ready, _ = first_after(trainer, joined, "training data ready")
    wrapped, _ = first_after(trainer, data_ready, "model built and wrapped")
    loaded, resumed = first_after(trainer, wrapped, r"resumed from .* at step (\d+)")
    restored, _ = first_after(trainer, loaded, "loader state restored")
    resumed_step = int(resumed.group(1))
    first = steps[resumed_step + 1]
    step_started = first["time"] - first["step_time_s"]
    first_batch = first["data_wait_fraction"] * first["step_time_s"]
    if kind == "loss":
        saved = max(t for t, text in trainer
                    if t < at and re.search(rf"checkpoint step {resumed_step} (saved|completed)", text))
        stop_from, redone = seen, at - saved
    else:  # the stopped workers trained on to a sync point: what counts as lost starts after their last step
        stop_from, redone = steps[resumed_step]["time"], 0.0
    return {"detection": seen - at, "stop": round_at - stop_from, "rendezvous": formed - round_at,
            "start": setting_up - formed, "process_group": joined - setting_up,
            "loader": (data_ready - joined) + (restored - loaded) + first_batch, "model": wrapped - data_ready,
            "checkpoint": loaded - wrapped, "other": step_started - restored, "redone": redone}


def lost(kind: str, phases: dict[str, float]) -> float:
    """Seconds of training an event cost: a return's detection runs while the job trains on."""
    return sum(value for phase, value in phases.items() if not (kind == "return" and phase == "detection"))


def scripted_job(workdir: Path, *, data: str, steps: int, losses: int, checkpoint_every: int,
                 extra: list[str], rdzv_conf: str = "", warm_start: bool = False, timeout: float = 180,
                 first_loss_after: int = 0) -> dict:
    """Train on two nodes; `losses` times: SIGKILL node b halfway between two checkpoints (the first not before
    step `first_loss_after`), let node a train alone for a few steps, start node b again. Returns the nodes, run
    directory, events and wall times."""
    run_dir = workdir / "run"
    train_args = ["--data", data, "--steps", str(steps), "--batch-size", str(BATCH), "--warmup-steps", "2",
                  "--checkpoint-every", str(checkpoint_every), "--keep", "3", "--log-sample-ids", "--log-every", "5",
                  "--device", "cpu", "--run-dir", str(run_dir), "--resume", "auto", *extra]
    port = free_port()
    nodes = [TunedNode(name, workdir=workdir, rdzv_port=port, train_args=train_args, storage_options=None,
                       max_restarts=losses + 1, rdzv_conf=rdzv_conf,
                       env={"LOGLEVEL": "INFO", "SHARDKIT_WARM_START": "1" if warm_start else "0"})
             for name in ("a", "b")]
    node_a, node_b = nodes
    logs = lambda: node_a.log() + node_b.log()  # noqa: E731
    events = []
    try:
        started = time.time()
        node_a.start()  # first: its agent hosts the c10d store (losing it would end the job)
        wait_for(lambda: store_listening(port), timeout=60, what="node a's agent to host the store", nodes=nodes)
        node_b.start()
        changes = lambda change: world_changes(logs()).count(change)  # noqa: E731
        for _ in range(losses):
            # Halfway between the next two checkpoints: what a failure at a random moment loses on average.
            target = (max(last_step(run_dir), first_loss_after) // checkpoint_every + 1) * checkpoint_every \
                + checkpoint_every // 2
            wait_for(lambda: last_step_at(run_dir, world_size=2) >= target, timeout=timeout + 0.5 * target,
                     what=f"two-node training to step {target}", nodes=nodes)
            seen = changes((2, 1)), changes((1, 2))
            events.append(("loss", node_b.kill()))
            wait_for(lambda: changes((2, 1)) > seen[0], timeout=timeout,
                     what="node a to re-form alone (2 -> 1)", nodes=nodes)
            alone_from = last_step(run_dir)
            wait_for(lambda: last_step(run_dir) >= alone_from + 10, timeout=timeout, what="training on one node",
                     nodes=nodes)
            if last_step(run_dir) >= steps - 40:
                raise RuntimeError(f"the run is too short for {losses} losses and returns: raise --steps")
            node_b.start()
            events.append(("return", time.time()))
            wait_for(lambda: changes((1, 2)) > seen[1], timeout=timeout,
                     what="the returning node to join (1 -> 2)", nodes=nodes)
        codes = {node.name: node.wait(timeout=2 * timeout + 0.5 * steps) for node in nodes}
        ended = time.time()
        if any(codes.values()):
            raise RuntimeError(f"exit codes {codes}:\n{logs()[-6000:]}")
    finally:
        for node in nodes:
            node.stop()
    return {"nodes": nodes, "run_dir": run_dir, "events": events, "started": started, "ended": ended}


def check_exact(run_dir: Path, data: str, workdir: Path, steps: int) -> dict[str, int]:
    """Every step once, no sample id twice in the epoch, and none skipped of the epoch's order."""
    from shardkit import StreamingDataLoader, StreamingDataset

    by_step = sample_ids(run_dir)
    ids = [i for step in sorted(by_step) for i in by_step[step]]
    # The order keeps the partitions the job started with (one per rank of the first step).
    partitions = len(by_step[1]) // BATCH
    reference = iter(StreamingDataLoader(StreamingDataset(data, cache_dir=workdir / "cache-ref",
                                                          num_partitions=partitions), batch_size=BATCH))
    expected: set[int] = set()
    while len(expected) < len(ids):
        expected.update(next(reference)["sample_id"].tolist())
    problems = {"steps_missing_or_extra": len(set(range(1, steps + 1)) ^ set(by_step)),
                "ids_twice": len(ids) - len(set(ids)), "ids_skipped": len(expected - set(ids))}
    if any(problems.values()):
        raise AssertionError(f"the run was not exact: {problems}")
    return {"steps": len(by_step), "ids": len(ids), **problems}


def run_once(workdir: Path, *, steps: int, losses: int, checkpoint_every: int, extra: list[str],
             rdzv_conf: str = "", warm_start: bool = False, first_loss_after: int = 0) -> dict:
    data = str(workdir / "data")
    # One epoch holds every step (the exactness check counts within one epoch): two ranks take 2 x BATCH a step.
    samples = max(SAMPLES, -(-int(steps * 2 * BATCH * 1.1) // PER_SHARD) * PER_SHARD)
    write_byte_dataset(data, num_samples=samples, seq_len=SEQ_LEN, samples_per_shard=PER_SHARD)
    job = scripted_job(workdir, data=data, steps=steps, losses=losses, checkpoint_every=checkpoint_every,
                       extra=extra, rdzv_conf=rdzv_conf, warm_start=warm_start, first_loss_after=first_loss_after)
    node_a, node_b = job["nodes"]
    records = [r for r in metric_records(job["run_dir"]) if "loss" in r]
    steps_by_number = {r["step"]: r for r in records}
    trainer = sorted(trainer_lines(node_a.log()) + trainer_lines(node_b.log()))
    agent = agent_lines(node_a.log(), datetime.fromtimestamp(job["started"]).year)
    events = [{"kind": kind, "at": at, **event_phases(kind, at, agent, trainer, steps_by_number)}
              for kind, at in job["events"]]
    for event in events:
        event["lost"] = lost(event["kind"], {p: event[p] for p in PHASES})
    wall = job["ended"] - job["started"]
    compute = sum(r["step_time_s"] * (1 - r["data_wait_fraction"]) for r in records)
    first = steps_by_number[1]
    saves = [float(m.group(1)) for _, text in trainer for m in [re.search(r"saved to .* in ([\d.]+)s", text)] if m]
    startup = first["time"] - first["step_time_s"] - job["started"]
    # Rank 0's time between two steps, after checkpoint steps (the sync point and the save) and after the others;
    # gaps of a second or more are a loss's or a return's (counted in their events).
    gaps = {"checkpoint": 0.0, "other": 0.0}
    ordered = [steps_by_number[step] for step in sorted(steps_by_number)]
    for previous, record in zip(ordered, ordered[1:]):
        gap = record["time"] - record["step_time_s"] - previous["time"]
        if record["step"] == previous["step"] + 1 and 0 <= gap < 1.0:
            gaps["checkpoint" if previous["step"] % checkpoint_every == 0 else "other"] += gap
    held = [(float(m.group(1)), float(m.group(2))) for _, text in trainer for m in [HELD.search(text)] if m]
    completed = [float(m.group(1)) for _, text in trainer for m in [COMPLETED.search(text)] if m]
    return {"wall_s": wall, "compute_s": compute, "goodput": compute / wall,
            # the job's first start-up is no failure's cost: goodput over the wall time after it, too
            "goodput_after_startup": compute / (wall - startup), "startup_s": startup,
            "data_wait_s": sum(r["step_time_s"] * r["data_wait_fraction"] for r in records),
            "finish_s": job["ended"] - steps_by_number[steps]["time"],
            "lost_s": sum(e["lost"] for e in events), "saves": len(saves), "save_s": sum(saves),
            "median_step_s": statistics.median(r["step_time_s"] for r in records),
            "between_steps_after_checkpoints_s": gaps["checkpoint"], "between_other_steps_s": gaps["other"],
            # rank 0's background saves: the loop held per save (wall, CPU), and completing one at a sync point
            "held_per_save_ms": 1000 * statistics.median(w for w, _ in held) if held else None,
            "held_cpu_per_save_ms": 1000 * statistics.median(c for _, c in held) if held else None,
            "completed_per_save_ms": 1000 * statistics.median(completed) if completed else None,
            "events": events, "exact": check_exact(job["run_dir"], data, workdir, steps), "warm_start": warm_start,
            "forked_workers": sum(log.count("forked from the warm-start server") for log in (node_a.log(), node_b.log())),
            "load_average": os.getloadavg()[1]}  # this machine is shared: the 5-minute load, for context


def medians(runs: list[dict]) -> dict:
    """Per event kind, the median of each phase over every event of every run; the run totals' medians."""
    table = {}
    for kind in ("loss", "return"):
        found = [e for r in runs for e in r["events"] if e["kind"] == kind]
        table[kind] = {phase: statistics.median(e[phase] for e in found) for phase in (*PHASES, "lost")}
    totals = ("wall_s", "compute_s", "goodput", "goodput_after_startup", "startup_s", "finish_s", "lost_s", "save_s",
              "median_step_s", "data_wait_s", "between_steps_after_checkpoints_s", "between_other_steps_s")
    return {"events": table, "totals": {name: statistics.median(r[name] for r in runs) for name in totals}}


def print_table(table: dict, runs: int, title: str = "") -> None:
    print(f"\n{title}seconds per event, median over the events of {runs} run(s)")
    print(f"{'event':8}" + "".join(f"{p:>14}" for p in (*PHASES, "lost")))
    for kind, row in table["events"].items():
        print(f"{kind:8}" + "".join(f"{row[p]:14.2f}" for p in (*PHASES, "lost")))
    t = table["totals"]
    print(f"\ngoodput {100 * t['goodput']:.1f}% ({100 * t['goodput_after_startup']:.1f}% of the wall time after the "
          f"job's first start-up): {t['compute_s']:.1f} s of step compute in {t['wall_s']:.1f} s wall "
          f"(start-up {t['startup_s']:.1f} s, lost to events {t['lost_s']:.1f} s, checkpoint saves {t['save_s']:.1f} s, "
          f"final save and exit {t['finish_s']:.1f} s, steps' data wait {t['data_wait_s']:.1f} s; "
          f"median step {1000 * t['median_step_s']:.1f} ms; between steps: {t['between_steps_after_checkpoints_s']:.1f} s "
          f"after checkpoint steps, {t['between_other_steps_s']:.1f} s after the others)")


# The checkpoint's cost in the loop, one process (no torchrun): the same run without checkpoints, with a
# synchronous save every 10 steps, and with a background save every 10 steps written by a thread or by DCP's
# writer process (--save-cost). Every mode runs DDP over a group of one: DCP's writer process needs a group.
SAVE_MODES = {"none": ["--checkpoint-every", "0"], "sync": ["--checkpoint-every", "10"],
              "thread": ["--checkpoint-every", "10", "--async-save", "--async-writer", "thread"],
              "process-dcp-staging": ["--checkpoint-every", "10", "--async-save", "--async-writer", "process"],
              "process": ["--checkpoint-every", "10", "--async-save", "--async-writer", "process"],
              "process-before": ["--checkpoint-every", "10", "--async-save", "--async-writer", "process"]}
# The modes staged by DCP's own stager (the code before `FlatStager`), for comparison in the same run.
DCP_STAGING = {"process-dcp-staging"}
# A save's whole time in the loop (loader state, state dict, staging, or the whole synchronous write) and a
# background save's completion at a later sync point.
IN_LOOP = re.compile(r"(?:the save held the loop|completed \(background save\) after) ([\d.]+)s")
STARTING_SAVE = re.compile(r"checkpoint step (\d+) saved to .* \(synchronously: the background writer process")
WRITER_WAIT = re.compile(r"writer process started; the loop waited ([\d.]+)s")


def save_cost_once(workdir: Path, data: str, mode: str, *, steps: int, baseline: str | None = None
                   ) -> dict[str, float]:
    """Train `steps` steps in one process with checkpoints per `mode`; the loop's time over steps N/5..N."""
    run_dir = workdir / f"save-{mode}"
    staging = {"SHARDKIT_CHECKPOINT_STAGING": "dcp" if mode in DCP_STAGING else "flat"}
    if mode == "process-before":  # `process` with the code of --baseline (e.g. a `git archive` of main)
        staging["PYTHONPATH"] = os.pathsep.join(filter(None, [baseline, os.environ.get("PYTHONPATH")]))
    cpu_before = _children_cpu_s()
    stderr = subprocess.run(
        [sys.executable, "-m", "shardkit.train", "--data", data, "--steps", str(steps), "--batch-size", str(BATCH),
         "--warmup-steps", "2", "--log-every", "10", "--device", "cpu", "--run-dir", str(run_dir), "--resume", "none",
         "--cache-dir", str(workdir / "cache"), "--parallel", "ddp", *SAVE_MODES[mode]],
        # cwd: `python -m` puts the working directory first on sys.path, before PYTHONPATH (a checkout's shardkit
        # would shadow --baseline's)
        env={**os.environ, "OMP_NUM_THREADS": "1", **staging}, cwd=workdir, capture_output=True, text=True,
        check=True).stderr
    cpu_s = _children_cpu_s() - cpu_before  # the trainer's and its writer process's CPU time, start-up included
    records = {r["step"]: r for r in metric_records(run_dir) if "loss" in r}
    # From step N/5 on: the writer process's start (a new interpreter importing torch, seconds of CPU) competes
    # with the first steps for the cores; a real job's minutes between saves hide it.
    first = max(10, steps // 50 * 10)
    start, end = records[first]["time"], records[steps]["time"]
    lines = [(at, text) for at, text in trainer_lines(stderr) if start <= at <= end]
    # Saves written synchronously while the writer process was still starting (its one-time start, see
    # `Checkpointer.save`) are counted apart: a real job's minutes between saves hide that start.
    starting = {int(m.group(1)) for _, text in lines for m in [STARTING_SAVE.search(text)] if m}
    lines = [(at, text) for at, text in lines
             if not any(f"checkpoint step {step}:" in text or f"checkpoint step {step} " in text for step in starting)]
    writer_wait = sum(float(m.group(1)) for _, text in trainer_lines(stderr) for m in [WRITER_WAIT.search(text)] if m)
    # What a save's work left in threads costs the next two steps (they share the GIL with it): their step time
    # beyond the median of the other steps (a run without checkpoints shows this measure's own bias).
    times = {step: records[step]["step_time_s"] for step in range(first + 1, steps + 1)}
    others = statistics.median(t for step, t in times.items() if step % 10 not in (1, 2))
    after = sum(statistics.median(t for step, t in times.items() if step % 10 == k) - others for k in (1, 2))
    # The whole cost, robust to the machine's load spikes: the median wall time of a 10-step interval (the end of
    # a checkpoint step to the end of the next one: the save, its completion, the threads' share), against the
    # same intervals of the run without checkpoints.
    ends = [step for step in range(first, steps + 1, 10)]
    interval = statistics.median(records[b]["time"] - records[a]["time"] for a, b in zip(ends, ends[1:]))
    return {"loop_s": end - start, "saves": sum("the save held the loop" in text for _, text in lines),
            # less the one-time wait for the writer process's start, reported on its own
            "in_loop_s": sum(float(m.group(1)) for _, text in lines for m in [IN_LOOP.search(text)] if m)
            - sum(float(m.group(1)) for _, text in lines for m in [WRITER_WAIT.search(text)] if m),
            "held_cpu_s": sum(float(m.group(2)) for _, text in lines for m in [HELD.search(text)] if m),
            "writer_start_wait_s": writer_wait, "cpu_s": cpu_s, "saves_while_writer_starts": len(starting),
            "next_steps_excess_s": after, "interval_s": interval,
            # the typical save, without the ones that waited for the previous save's writing
            "held_median_s": statistics.median([float(m.group(1)) for _, text in lines for m in [HELD.search(text)] if m]
                                               or [0.0]),
            "median_step_s": statistics.median(records[step]["step_time_s"] for step in range(first + 1, steps + 1))}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def save_cost(runs: int, *, steps: int, modes: tuple[str, ...] = tuple(SAVE_MODES), baseline: str | None = None
              ) -> dict:
    """Each mode `runs` times, interleaved (the machine's load drifts); per mode the medians, and the loop's
    overhead against the run without checkpoints of the same round."""
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-save-cost-") as tmp:
        data = str(Path(tmp) / "data")
        write_byte_dataset(data, num_samples=SAMPLES, seq_len=SEQ_LEN, samples_per_shard=PER_SHARD)
        for _ in range(runs):
            rounds.append({mode: save_cost_once(Path(tmp), data, mode, steps=steps, baseline=baseline)
                           for mode in ("none", *modes)})
    table = {}
    for mode in ("none", *modes):
        rows = [r[mode] for r in rounds]
        table[mode] = {"loop_s": statistics.median(r["loop_s"] for r in rows),
                       "in_loop_s_per_save": statistics.median(r["in_loop_s"] / max(1, r["saves"]) for r in rows),
                       "median_step_s": statistics.median(r["median_step_s"] for r in rows),
                       "writer_start_wait_s": statistics.median(r["writer_start_wait_s"] for r in rows),
                       "cpu_s": statistics.median(r["cpu_s"] for r in rows),
                       "saves_while_writer_starts": statistics.median(r["saves_while_writer_starts"] for r in rows),
                       # What the goal measures: the loop held per save over the 10 steps between saves
                       # (steps of this round's run without checkpoints), steady against the machine's load.
                       "held_overhead": statistics.median(r[mode]["in_loop_s"] / max(1, r[mode]["saves"])
                                                          / (10 * r["none"]["median_step_s"]) for r in rounds),
                       "held_cpu_overhead": statistics.median(r[mode]["held_cpu_s"] / max(1, r[mode]["saves"])
                                                              / (10 * r["none"]["median_step_s"]) for r in rounds),
                       "held_cpu_ms_per_save": statistics.median(1000 * r["held_cpu_s"] / max(1, r["saves"])
                                                                 for r in rows),
                       "next_steps_excess_ms": statistics.median(1000 * r["next_steps_excess_s"] for r in rows),
                       "held_median_ms": statistics.median(1000 * r["held_median_s"] for r in rows),
                       "interval_ms": statistics.median(1000 * r["interval_s"] for r in rows),
                       # per round against that round's run without checkpoints, then the median
                       "interval_excess_ms": statistics.median(1000 * (r[mode]["interval_s"] - r["none"]["interval_s"])
                                                               for r in rounds),
                       "overhead": statistics.median((r[mode]["loop_s"] - r[mode]["writer_start_wait_s"])
                                                     / r["none"]["loop_s"] - 1 for r in rounds)}
    print(f"\ncheckpoint cost in the loop, one process, {steps} steps, a save every 10 (none: no save): "
          f"median of {runs} interleaved rounds")
    print(f"{'mode':20}{'loop s':>8}{'ms per save':>13}{'median held ms':>16}{'held / 10 steps':>17}{'CPU ms per save':>17}"
          f"{'CPU / 10 steps':>16}{'next 2 steps +ms':>18}{'10 steps ms':>13}{'+ms vs none':>13}"
          f"{'median step ms':>16}{'writer start s':>16}"
          f"{'loop overhead':>15}{'CPU s':>8}")
    for mode, row in table.items():
        print(f"{mode:20}{row['loop_s']:8.2f}{1000 * row['in_loop_s_per_save']:13.1f}{row['held_median_ms']:16.2f}{100 * row['held_overhead']:16.2f}%"
              f"{row['held_cpu_ms_per_save']:17.1f}{100 * row['held_cpu_overhead']:15.2f}%"
              f"{row['next_steps_excess_ms']:18.2f}{row['interval_ms']:13.1f}{row['interval_excess_ms']:13.1f}"
              f"{1000 * row['median_step_s']:16.1f}{row['writer_start_wait_s']:16.2f}{100 * row['overhead']:14.1f}%"
              f"{row['cpu_s']:8.1f}")
    return {"rounds": rounds, "median": table}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--losses", type=int, default=1, help="node losses (each followed by the node's return)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--first-loss-after", type=int, default=0, metavar="STEP",
                        help="the first node loss not before this step (e.g. mid-way through a long job)")
    parser.add_argument("--rdzv-conf", default="", help="more rendezvous options for both agents, e.g. "
                        "keep_alive_interval=1,keep_alive_max_attempt=2 (after last_call_timeout=1,join_timeout=120)")
    parser.add_argument("--warm-start", choices=("off", "on", "both"), default="off",
                        help="SHARDKIT_WARM_START for the nodes (restarted workers forked from a node's server); "
                             "both: --runs runs of each, alternated (off, on, off, ...), a table for each")
    parser.add_argument("--save-cost", action="store_true",
                        help="instead of the elastic job: the loop's time without checkpoints, with synchronous and "
                             "with background saves every 10 steps (one process)")
    parser.add_argument("--modes", nargs="+", choices=[m for m in SAVE_MODES if m != "none"],
                        default=[m for m in SAVE_MODES if m not in ("none", "process-before")],
                        help="--save-cost: the modes besides none")
    parser.add_argument("--baseline", metavar="DIR", help="--save-cost: the code `process-before` runs (a directory "
                        "put first on PYTHONPATH, e.g. a `git archive` of main)")
    parser.add_argument("--json", default="bench_out/bench_goodput.json")
    parser.add_argument("--keep", metavar="DIR", help="keep each run's directory (logs, records) under DIR")
    parser.add_argument("train_args", nargs="*", help="more trainer options, after --, e.g. -- --async-save")
    args = parser.parse_args(argv)
    if args.save_cost:
        if "process-before" in args.modes and not args.baseline:
            parser.error("--modes process-before needs --baseline DIR (the earlier code, e.g. a git archive)")
        result = save_cost(args.runs, steps=args.steps, modes=tuple(args.modes), baseline=args.baseline)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "save_cost": result}, indent=2))
        return 0
    variants = {"off": [False], "on": [True], "both": [False, True]}[args.warm_start]
    runs = []
    for run in range(args.runs * len(variants)):
        warm_start = variants[run % len(variants)]
        with tempfile.TemporaryDirectory(prefix="bench-goodput-", dir=args.keep) as tmp:
            if args.keep:  # the run's logs, checkpoints and records stay for a look
                tmp = Path(args.keep) / f"run-{run + 1}"
                tmp.mkdir()
            runs.append(run_once(Path(tmp), steps=args.steps, losses=args.losses,
                                 checkpoint_every=args.checkpoint_every, extra=args.train_args,
                                 rdzv_conf=args.rdzv_conf, warm_start=warm_start,
                                 first_loss_after=args.first_loss_after))
        print(f"run {run + 1}/{args.runs * len(variants)} (warm start {'on' if warm_start else 'off'}): "
              f"{runs[-1]['wall_s']:.0f} s wall, goodput {100 * runs[-1]['goodput']:.1f}%, "
              f"exact ({runs[-1]['exact']['ids']} ids), {runs[-1]['forked_workers']} workers forked; rank 0's saves "
              f"held the loop {runs[-1]['held_per_save_ms']} ms ({runs[-1]['held_cpu_per_save_ms']} ms CPU), "
              f"completing one {runs[-1]['completed_per_save_ms']} ms (medians)", flush=True)
    tables = {}
    for warm_start in variants:
        name = "warm start on" if warm_start else "warm start off"
        tables[name] = medians([r for r in runs if r["warm_start"] == warm_start])
        print_table(tables[name], args.runs, title=f"{name}: ")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "median": tables}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
