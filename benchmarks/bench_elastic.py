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

    python benchmarks/bench_elastic.py --runs 3 [--json bench_out/bench_elastic.json]

Both simulated nodes share this machine's cores, so worker start-up is slower than on real nodes.
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
    joined = max(t for t, text in events if re.search(rf"rank \d+/{world} joined the gloo process group", text))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=360)
    parser.add_argument("--json", default="bench_out/bench_elastic.json")
    args = parser.parse_args(argv)
    runs = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
            started = time.time()
            runs.append(run_once(Path(tmp), steps=args.steps))
            print(f"run {run + 1}/{args.runs}: {time.time() - started:.0f} s", flush=True)
    table = {change: {phase: statistics.median(r[change][phase] for r in runs) for phase in PHASES}
             for change in runs[0]}
    print(f"\nmedian of {args.runs} runs, seconds")
    print(f"{'change':24}" + "".join(f"{phase:>13}" for phase in PHASES))
    for change, row in table.items():
        print(f"{change:24}" + "".join(f"{row[phase]:13.2f}" for phase in PHASES))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"runs": runs, "median": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
