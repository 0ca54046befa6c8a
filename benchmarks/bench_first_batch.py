"""Time to the first batch in a fresh process, and what the read path imported to get there (issue 36 item 1).

    python benchmarks/bench_first_batch.py [--runs 3] [--cache-modes decoded,none] [--compare PYTHON]
        [--real tar arrow] [--workers 0 2] [--resume] [--peers] [--out bench_out/first_batch.json]

A small dataset (2,000 samples of 1,025 uint16 tokens, document boundaries on; arrow and tar, format v2) is
written once; then each run is a fresh interpreter that imports `shardkit.loaders` (timed apart: torch
dominates it), creates a `StreamingDataset` over a fresh cache directory and takes one batch of 8 from a
`StreamingDataLoader` with 0 workers (timed: dataset creation + first batch, the column of the side-by-side
run), for each of --cache-modes. The child also reports whether `pandas` and `pyarrow.compute` were
imported. With --compare PYTHON (e.g. a virtual environment holding another commit's shardkit) the same
children run under that interpreter too, alternating run by run so that both see the same machine load.
Medians of --runs runs; prints a table, writes JSON.

--real FORMAT ... reads the real-token data of `bench_loader.py --real` instead (`benchmarks/real_tokens.py`:
GPT-2 tokens of ../shared, seq 1024, document boundaries, one shard; $SHARDKIT_SHARED), and each child then
also takes the first batch a second time from another fresh cache ("again": the process's first imports and
allocations paid, as in `bench_loader.py --real --cold`). --workers repeats every row per DataLoader worker
count; --resume adds rows whose loader first loads a state saved at half the epoch; --peers adds LitData on the
same samples (`benchmarks/peers.py`: no compression, ~64 MiB chunks) in children of its own, alternating with
shardkit's, timed the same way.
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

# argv: url, scratch, cache_mode, workers, state (JSON, or "null"), rounds.
CHILD = """
import json, sys, tempfile, time
began = time.perf_counter()
from shardkit.loaders import StreamingDataLoader, StreamingDataset
imported = time.perf_counter()
url, scratch, cache_mode, workers, state, rounds = sys.argv[1:7]
workers, state, rounds = int(workers), json.loads(state), int(rounds)

def first_batch():
    start = time.perf_counter()
    options = {"cache_mode": cache_mode} if cache_mode != "decoded" else {}  # a baseline may predate the option
    dataset = StreamingDataset(url, cache_dir=tempfile.mkdtemp(dir=scratch), rank=0, world_size=1, **options)
    loader = StreamingDataLoader(dataset, batch_size=8, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - start
    del batches  # stops the workers
    for cache in dataset.caches:  # the background completion, before the next round's clock starts
        getattr(cache, "drain", lambda: None)()
    return seconds

times = [first_batch() for _ in range(rounds)]
print(json.dumps({"import_s": imported - began, "first_batch_s": times[0], "again_s": times[-1],
                  "pandas": "pandas" in sys.modules, "pyarrow.compute": "pyarrow.compute" in sys.modules}))
"""

# The same for LitData (argv: url, scratch, workers, state, rounds).
LITDATA_CHILD = """
import json, os, sys, tempfile, time
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
began = time.perf_counter()
from litdata import StreamingDataLoader, StreamingDataset
imported = time.perf_counter()
url, scratch, workers, state, rounds = sys.argv[1:6]
workers, state, rounds = int(workers), json.loads(state), int(rounds)

def first_batch():
    start = time.perf_counter()
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=tempfile.mkdtemp(dir=scratch), shuffle=True),
                                 batch_size=8, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - start
    del batches
    return seconds

times = [first_batch() for _ in range(rounds)]
print(json.dumps({"import_s": imported - began, "first_batch_s": times[0], "again_s": times[-1]}))
"""

# A state saved at half the epoch (argv: kind, url, scratch, workers); printed as JSON.
STATE_CHILD = """
import json, os, sys, tempfile
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
kind, url, scratch, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if kind == "litdata":
    from litdata import StreamingDataLoader, StreamingDataset
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=tempfile.mkdtemp(dir=scratch), shuffle=True),
                                 batch_size=8, num_workers=workers)
else:
    from shardkit.loaders import StreamingDataLoader, StreamingDataset
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=tempfile.mkdtemp(dir=scratch), rank=0,
                                                  world_size=1), batch_size=8, num_workers=workers)
batches = iter(loader)
for _ in range(len(loader) // 2):
    next(batches)
print(json.dumps(loader.state_dict()))
"""


def write_datasets(root: Path) -> dict[str, str]:
    sys.path.insert(0, str(REPO / "tests"))
    from loader_helpers import write_fixed

    urls = {}
    for shard_format in ("arrow", "tar"):
        urls[shard_format] = str(root / shard_format)
        write_fixed(urls[shard_format], SAMPLES, seq_len=SEQ_LEN, per_shard=500, shard_format=shard_format)
    return urls


def real_datasets(data_dir: Path, formats: list[str]) -> tuple[dict[str, str], tuple[Path, int]]:
    """The real-token datasets of bench_loader --real (built once), and their flat copy and sample count."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import real_tokens

    urls, flat, samples = {}, None, 0
    for shard_format in formats:
        urls[shard_format], flat, samples = real_tokens.build_real(data_dir, shard_format)
    return urls, (flat, samples)


def run(args: list[str], what: str) -> dict:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    if result.returncode:  # cwd: not the repository, so each interpreter imports its own shardkit
        raise RuntimeError(f"{what} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compare", default=None, metavar="PYTHON",
                        help="another interpreter whose shardkit reads too, alternating with this one")
    parser.add_argument("--cache-modes", default="decoded,none", help="comma-separated cache_mode values")
    parser.add_argument("--real", nargs="+", choices=("tar", "arrow"), default=None,
                        help="the real-token data of bench_loader --real, in these formats")
    parser.add_argument("--data-dir", type=Path, default=REPO / "bench_out", help="--real: where its data is kept")
    parser.add_argument("--workers", type=int, nargs="+", default=[0])
    parser.add_argument("--resume", action="store_true", help="also the first batch after a resume at half the epoch")
    parser.add_argument("--peers", action="store_true", help="--real: LitData on the same samples, same timing")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pythons = {"this": sys.executable, **({"compare": args.compare} if args.compare else {})}
    rounds = "2" if args.real else "1"
    cache_modes = args.cache_modes.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-first-batch-") as tmp:
        litdata_url = None
        if args.real:
            urls, (flat, samples) = real_datasets(args.data_dir.resolve() / "real", args.real)
            if args.peers:
                import peers

                if peers.installed("litdata", "LitData"):
                    litdata_url = peers.build_litdata(args.data_dir.resolve() / "real", flat, samples, SEQ_LEN + 1,
                                                      64 << 20, None)
        else:
            urls = write_datasets(Path(tmp))
        for shard_format, url in urls.items():
            for cache_mode in cache_modes:
                for workers in args.workers:
                    for resumed in (False, True) if args.resume else (False,):
                        sides = {label: [python, "-c", CHILD, url, tmp, cache_mode, str(workers)]
                                 for label, python in pythons.items()}
                        if litdata_url and cache_mode == cache_modes[0]:
                            sides["LitData"] = [sys.executable, "-c", LITDATA_CHILD, litdata_url, tmp, str(workers)]
                        states = dict.fromkeys(sides, "null")
                        if resumed:
                            for label, command in sides.items():
                                kind = "litdata" if label == "LitData" else "shardkit"
                                python = sys.executable if label == "LitData" else pythons[label]
                                states[label] = json.dumps(run([python, "-c", STATE_CHILD, kind, command[3], tmp,
                                                                str(workers)], f"{label}: saving a state"))
                        runs: dict[str, list[dict]] = {label: [] for label in sides}
                        for _ in range(args.runs):
                            for label, command in sides.items():  # alternating, run by run
                                runs[label].append(run([*command, states[label], rounds], f"{label}: first batch"))
                        for label, results in runs.items():
                            rows.append(_row(label, shard_format, cache_mode, workers, resumed, results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"python": pythons, "rows": rows}, indent=1))


def _row(label: str, shard_format: str, cache_mode: str, workers: int, resumed: bool, results: list[dict]) -> dict:
    row = {"python": label, "format": shard_format if label != "LitData" else "litdata",
           "cache_mode": cache_mode, "workers": workers, "resumed": resumed,
           "first_batch_s": statistics.median(r["first_batch_s"] for r in results),
           "again_s": statistics.median(r["again_s"] for r in results),
           "import_s": statistics.median(r["import_s"] for r in results),
           "first_batch_runs": [round(r["first_batch_s"], 4) for r in results],
           "again_runs": [round(r["again_s"], 4) for r in results],
           "pandas": any(r.get("pandas") for r in results),
           "pyarrow.compute": any(r.get("pyarrow.compute") for r in results)}
    runs = [round(t * 1e3, 1) for t in row["first_batch_runs"]]
    again = [round(t * 1e3, 1) for t in row["again_runs"]]
    print(f"{label:<8} {row['format']:<7} {cache_mode:<8} workers {workers} {'resumed' if resumed else 'fresh':<7} "
          f"first batch {row['first_batch_s'] * 1e3:7.1f} ms (runs {runs}), again {row['again_s'] * 1e3:7.1f} ms "
          f"(runs {again}), import {row['import_s']:.2f} s, pandas {row['pandas']}, "
          f"pyarrow.compute {row['pyarrow.compute']}", flush=True)
    return row


if __name__ == "__main__":
    main()
