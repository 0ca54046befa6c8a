"""Elastic training: how long a membership change costs, with torchrun's own elastic agents.

Two simulated nodes on this machine (tests/elastic_nodes.py: one `torchrun --nnodes 1:2 --rdzv-backend c10d`
agent each, own node cache) train the tiny model; node b's whole process tree is SIGKILLed mid-epoch, node
a re-forms alone, node b starts again and the job scales back up. For both changes the time from the event
(the kill; node b's start) to the end of the first step of the re-formed job, split into:

    rendezvous    event -> the new process group is formed (failure detection or the waiting node being
                  seen, the agents' rendezvous round, worker start-up including `import torch`)
    checkpoint    process group -> checkpoint loaded (resharded to the new world size)
    loader        checkpoint loaded -> the first step starts (model wrap, loader state, data check)
    first batch   the first step's data wait (the first batch from the node cache)
    total         event -> the first step of the re-formed job completed

It also builds one corpus with `--executor ray` on a `ray.cluster_utils.Cluster` of 1, 2 and 3 worker
nodes (one CPU each) beside the local executor with one worker: units/s, units/s per node, and Ray's
overhead per unit (its seconds per unit minus the local executor's).

    python benchmarks/bench_elastic.py --runs 3 [--json bench_out/bench_elastic.json] [--skip-ray]

The simulated nodes share this machine's 2 cores, so worker start-up is slower than on real nodes and the
Ray rows measure overhead and work per node, not scaling.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from elastic_nodes import lose_and_return, metric_records  # noqa: E402
from train_runs import write_byte_dataset  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank \d+\] (.*)$", re.M)
PHASES = ("rendezvous", "checkpoint", "loader", "first_batch", "total")


def _events(log: str) -> list[tuple[float, str]]:
    return [(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), text) for stamp, text in STAMP.findall(log)]


def _phases(event_at: float, world: int, logs: str, records: list[dict]) -> dict[str, float]:
    """Split the time from `event_at` to the first step at `world` ranks (from the trainer's own log lines)."""
    events = [(t, text) for t, text in _events(logs) if t >= event_at]
    joined = max(t for t, text in events if re.search(rf"rank \d+/{world} (joined the gloo process group|runs alone)", text))
    resumed_at, resumed_step = next((t, int(m.group(1))) for t, text in events if t >= joined
                                    for m in [re.search(r"resumed from .* at step (\d+)", text)] if m)
    first = next(r for r in records if r.get("step") == resumed_step + 1 and "loss" in r)
    step_started = first["time"] - first["step_time_s"]
    return {"rendezvous": joined - event_at, "checkpoint": resumed_at - joined, "loader": step_started - resumed_at,
            "first_batch": first["data_wait_fraction"] * first["step_time_s"], "total": first["time"] - event_at}


def run_once(workdir: Path, *, steps: int) -> dict[str, dict[str, float]]:
    data = workdir / "data"
    write_byte_dataset(str(data), num_samples=4000, seq_len=32, samples_per_shard=100)
    result = lose_and_return(workdir, data=str(data), storage_options=None, steps=steps, batch_size=4,
                             checkpoint_every=10)
    logs = "\n".join(node.log() for node in result["nodes"])
    records = metric_records(result["run_dir"])
    return {"node lost (2 -> 1)": _phases(result["killed_at"], 1, logs, records),
            "node returns (1 -> 2)": _phases(result["returned_at"], 2, logs, records)}


def ray_build_rates(workdir: Path, *, nodes: tuple[int, ...] = (1, 2, 3)) -> dict[str, dict[str, float]]:
    """Units/s of one build on the local executor (1 worker) and on Ray clusters of `nodes` worker nodes."""
    from ray.cluster_utils import Cluster

    from shardkit.tools.build import run_build
    from test_build import config, write_corpus

    corpus = write_corpus(workdir / "corpus", docs=3000, bad=False)
    inputs = sorted(corpus.iterdir())

    def timed(name: str, **options) -> tuple[float, int]:
        started = time.perf_counter()
        result = run_build(config(inputs, workdir / name, unit_bytes=4096, shard_size=200_000, **options))
        return time.perf_counter() - started, sum(result.report["timing"]["units_per_node"].values())

    seconds, units = timed("local", workers=1)
    rows = {"local, 1 worker": {"nodes": 1, "units": units, "units_per_s": units / seconds,
                                "units_per_s_per_node": units / seconds, "overhead_ms_per_unit": 0.0}}
    local_per_unit = seconds / units
    for count in nodes:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        try:
            for _ in range(count):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            seconds, units = timed(f"ray{count}", workers=count, executor="ray", ray_address=cluster.address)
        finally:
            cluster.shutdown()
        rows[f"ray, {count} node(s)"] = {
            "nodes": count, "units": units, "units_per_s": units / seconds,
            "units_per_s_per_node": units / seconds / count,
            "overhead_ms_per_unit": 1000 * (seconds * count / units - local_per_unit)}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=360)
    parser.add_argument("--json", default="bench_out/bench_elastic.json")
    parser.add_argument("--skip-ray", action="store_true", help="only the elastic training rows")
    parser.add_argument("--skip-elastic", action="store_true", help="only the Ray build rows")
    args = parser.parse_args(argv)
    results: dict = {}
    if not args.skip_elastic:
        runs = []
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
                started = time.time()
                runs.append(run_once(Path(tmp), steps=args.steps))
                print(f"run {run + 1}/{args.runs}: {time.time() - started:.0f} s", flush=True)
        table = {change: {phase: statistics.median(r[change][phase] for r in runs) for phase in PHASES}
                 for change in runs[0]}
        print(f"\nmembership changes: median of {args.runs} runs, seconds")
        print(f"{'change':24}" + "".join(f"{phase:>13}" for phase in PHASES))
        for change, row in table.items():
            print(f"{change:24}" + "".join(f"{row[phase]:13.2f}" for phase in PHASES))
        results["elastic"] = {"runs": runs, "median": table}
    if not args.skip_ray:
        builds = []
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
                builds.append(ray_build_rates(Path(tmp)))
        columns = ("units_per_s", "units_per_s_per_node", "overhead_ms_per_unit")
        table = {name: {c: statistics.median(b[name][c] for b in builds) for c in columns} for name in builds[0]}
        print(f"\nbuild on Ray nodes: median of {args.runs} runs ({builds[0]['local, 1 worker']['units']} units)")
        print(f"{'executor':18}" + "".join(f"{c:>22}" for c in columns))
        for name, row in table.items():
            print(f"{name:18}" + "".join(f"{row[c]:22.2f}" for c in columns))
        results["ray_build"] = {"runs": builds, "median": table}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
