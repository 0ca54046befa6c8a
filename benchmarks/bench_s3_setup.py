"""A one-pass read from S3 in fresh processes, two installs alternating (A/B): what a new S3 filesystem costs.

    python benchmarks/bench_s3_setup.py --baseline main [--tokens 10e6] [--shard-mb 4] [--runs 3]

bench_loader's samples as Arrow shards, uploaded once to a moto server on loopback. Each child is a fresh
interpreter of one install (this working tree, or --baseline's commit installed by `real_tokens.baseline_python`)
that makes, from fresh caches: one pass with 0 workers (the process's first S3 filesystem), a second such pass
(a second filesystem in the same process, as side_by_side's later runs and any second dataset make), and one
pass with 2 workers (each forked worker opens its own). Children alternate between the installs; medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = """
import json, sys
sys.path.insert(0, {benchmarks!r})
import shardkit, side_by_side
from bench_loader import MotoServer
server = MotoServer.__new__(MotoServer)
server.options = {options!r}
out = {{}}
for name, workers in (("first filesystem, 0 workers", 0), ("second filesystem, 0 workers", 0), ("2 workers", 2)):
    out[name] = side_by_side.one_pass(side_by_side.shardkit_factory(None)({url!r}, 8, server, workers), {samples})
out["shardkit"] = shardkit.__file__
print(json.dumps(out))
"""


def main() -> None:
    from bench_loader import MotoServer, build_arrow_copy, build_data
    from real_tokens import baseline_python

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit to compare with (e.g. main)")
    parser.add_argument("--data-dir", default="bench_out/s3_setup")
    parser.add_argument("--tokens", type=float, default=10e6)
    parser.add_argument("--shard-mb", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    data_dir = Path(args.data_dir).resolve()
    _, flat, samples = build_data(data_dir, int(args.tokens), args.shard_mb * 2**20)
    arrow = build_arrow_copy(data_dir, flat, samples, args.shard_mb * 2**20)
    sides = {f"before ({args.baseline})": baseline_python(args.baseline, data_dir), "after": sys.executable}
    rows: dict[str, dict[str, list[dict]]] = {side: {} for side in sides}
    with MotoServer() as server:
        url = server.upload(arrow, "arrow")
        child = CHILD.format(benchmarks=str(Path(__file__).resolve().parent), options=server.options, url=url,
                             samples=samples)
        for _ in range(args.runs):
            for side, python in sides.items():  # alternating: before, after, before, after, ...
                # run outside the checkout: `python -c` puts the working directory first on sys.path
                result = json.loads(subprocess.run([python, "-c", child], check=True, capture_output=True, text=True,
                                                   cwd=data_dir).stdout.splitlines()[-1])
                print(f"  {side}: shardkit of {result.pop('shardkit')}", flush=True)
                for name, row in result.items():
                    rows[side].setdefault(name, []).append(row)
    print(f"{'':<40} {'samples/s (runs)':>36} {'first batch s':>14} exact")
    for side, by_name in rows.items():
        for name, runs in by_name.items():
            rates = [round(r["samples_per_s"]) for r in runs]
            print(f"{side + ', ' + name:<40} {statistics.median(rates):>9,.0f} {str(rates):>26} "
                  f"{statistics.median(r['first_batch_s'] for r in runs):>14.3f} {all(r['exact'] for r in runs)}")


if __name__ == "__main__":
    main()
