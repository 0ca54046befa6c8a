"""Time to the first batch in a fresh process, and what the read path imported to get there (issue 36 item 1).

    python benchmarks/bench_first_batch.py [--runs 3] [--cache-modes decoded,none] [--compare PYTHON]
        [--out bench_out/first_batch.json]

A small dataset (2,000 samples of 1,025 uint16 tokens, document boundaries on; arrow and tar, format v2) is
written once; then each run is a fresh interpreter that imports `shardkit.loaders` (timed apart: torch
dominates it), creates a `StreamingDataset` over a fresh cache directory and takes one batch of 8 from a
`StreamingDataLoader` with 0 workers (timed: dataset creation + first batch, the column of the side-by-side
run), for each of --cache-modes. The child also reports whether `pandas` and `pyarrow.compute` were
imported. With --compare PYTHON (e.g. a virtual environment holding another commit's shardkit) the same
children run under that interpreter too, alternating run by run so that both see the same machine load.
Medians of --runs runs; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES, SEQ_LEN = 2000, 1024

CHILD = """
import json, sys, tempfile, time
began = time.perf_counter()
from shardkit.loaders import StreamingDataLoader, StreamingDataset
imported = time.perf_counter()
dataset = StreamingDataset(sys.argv[1], cache_dir=tempfile.mkdtemp(dir=sys.argv[2]), cache_mode=sys.argv[3],
                           rank=0, world_size=1)
batch = next(iter(StreamingDataLoader(dataset, batch_size=8, num_workers=0)))
done = time.perf_counter()
print(json.dumps({"import_s": imported - began, "first_batch_s": done - imported,
                  "pandas": "pandas" in sys.modules, "pyarrow.compute": "pyarrow.compute" in sys.modules}))
"""


def write_datasets(root: Path) -> dict[str, str]:
    sys.path.insert(0, str(REPO / "tests"))
    from loader_helpers import write_fixed

    urls = {}
    for shard_format in ("arrow", "tar"):
        urls[shard_format] = str(root / shard_format)
        write_fixed(urls[shard_format], SAMPLES, seq_len=SEQ_LEN, per_shard=500, shard_format=shard_format)
    return urls


def child(python: str, url: str, scratch: str, cache_mode: str) -> dict:
    result = subprocess.run([python, "-c", CHILD, url, scratch, cache_mode], capture_output=True, text=True,
                            timeout=600, cwd=scratch)  # not the repository: the interpreter's own shardkit
    if result.returncode:
        raise RuntimeError(f"{python}: first batch failed:\n{result.stderr}")
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compare", default=None, metavar="PYTHON",
                        help="another interpreter whose shardkit reads too, alternating with this one")
    parser.add_argument("--cache-modes", default="decoded,none", help="comma-separated cache_mode values")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pythons = {"this": sys.executable, **({"compare": args.compare} if args.compare else {})}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-first-batch-") as tmp:
        urls = write_datasets(Path(tmp))
        for shard_format, url in urls.items():
            for cache_mode in args.cache_modes.split(","):
                runs: dict[str, list[dict]] = {label: [] for label in pythons}
                for _ in range(args.runs):
                    for label, python in pythons.items():
                        runs[label].append(child(python, url, tmp, cache_mode))
                for label, results in runs.items():
                    rows.append({"python": label, "format": shard_format, "cache_mode": cache_mode,
                                 "first_batch_s": statistics.median(r["first_batch_s"] for r in results),
                                 "import_s": statistics.median(r["import_s"] for r in results),
                                 "first_batch_runs": [round(r["first_batch_s"], 4) for r in results],
                                 "pandas": any(r["pandas"] for r in results),
                                 "pyarrow.compute": any(r["pyarrow.compute"] for r in results)})
                    row = rows[-1]
                    print(f"{label:<8} {shard_format:<6} {cache_mode:<8} first batch {row['first_batch_s']:.3f} s "
                          f"(runs {row['first_batch_runs']}), import {row['import_s']:.2f} s, pandas "
                          f"{row['pandas']}, pyarrow.compute {row['pyarrow.compute']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"python": pythons, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
