"""S3 through obstore against S3 through fsspec (s3fs), the peers beside, every cell in a fresh process (issue 47).

    python benchmarks/bench_object_store.py [--tokens 10e6] [--shard-mb 4] [--runs 3] [--out bench_out/object_store.json]

The samples of side_by_side.py (bench_loader's: 2,049 random uint16 tokens each) as shardkit Arrow and tar shards
and as each installed peer's format (benchmarks/peers.py), uploaded once to a moto server on loopback. Each cell is
one pass in a fresh interpreter (imports done before the clock starts, as in side_by_side; the client's set-up,
the manifest and the first batch inside it), batch 8, shuffle on, a fresh cache: the time to the first batch and
samples/s over the pass, with 0 and 2 DataLoader workers (shardkit, WebDataset, LitData). shardkit runs twice: with
`SHARDKIT_STORAGE_CLIENT=fsspec` (s3fs, the opt-out and the path of every release before obstore) and on the
default (obstore where it is installed; forked workers load obstore's extension afresh), children alternating
run by run.
The set-up rows time, in fresh processes: importing the object-store path (`shardkit.storage` and, after, obstore),
building its client (obstore's store / an s3fs filesystem), and the first request (a HEAD of the manifest, which
builds s3fs's botocore client). Medians of --runs; prints tables, writes JSON. `--before DIR` measures the
obstore cells and the profile of shardkit's code in DIR beside this code's, alternating run by run. `--profile` adds, per client and
worker count, where the first batch's time goes in a fresh process: the dataset (its manifest), the loader and
its iterator (forking the workers), the first batch, and cProfile's heaviest functions with 0 workers.

Peers need their own venv (benchmarks/peers.py's docstring): run this with that venv's python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

PASS_CHILD = """
import json, os, sys, warnings
sys.path.insert(0, {bench!r})
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
import numpy, side_by_side, peers
from bench_loader import MotoServer
label, url, workers, samples = {label!r}, {url!r}, {workers}, {samples}
server = MotoServer.__new__(MotoServer)
server.options = {options!r}
if label in ("webdataset", "datasets"):
    import boto3
    server.client = boto3.client("s3", endpoint_url=server.options["endpoint_url"], region_name="us-east-1")
factory = {{"shardkit": side_by_side.shardkit_factory(None), "litdata": peers.litdata_loader,
            "streaming": peers.mds_loader, "webdataset": peers.webdataset_loader, "datasets": peers.hf_loader}}[label]
make = factory(url, 8, server, workers)
if label == "shardkit":
    import shardkit.storage
    client = shardkit.storage.Storage(url, server.options).client
else:
    client = label
row = side_by_side.one_pass(make, samples)
row["client"] = client
print(json.dumps(row))
"""

SETUP_CHILD = """
import json, time
began = time.perf_counter()
import shardkit.storage
imported = time.perf_counter()
storage = shardkit.storage.Storage({url!r}, {options!r})  # fsspec: imports s3fs, builds the filesystem
if storage.client == "obstore":
    storage.objects.store  # imports obstore, builds the store
built = time.perf_counter()
storage.exists("shardkit.json")  # the first request (s3fs builds its botocore client here)
answered = time.perf_counter()
print(json.dumps({{"client": storage.client, "import_ms": 1e3 * (imported - began),
                  "client_ms": 1e3 * (built - imported), "first_request_ms": 1e3 * (answered - built)}}))
"""

PROFILE_CHILD = """
import cProfile, io, json, pstats, shutil, tempfile, time, warnings
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
from shardkit import StreamingDataLoader, StreamingDataset
cache = tempfile.mkdtemp(prefix="shardkit-bench-profile-")
profile = cProfile.Profile()
if {workers} == 0:
    profile.enable()
began = time.perf_counter()
dataset = StreamingDataset({url!r}, cache_dir=cache, rank=0, world_size=1, storage_options={options!r},
                           partial_batches="partial")
made = time.perf_counter()
loader = StreamingDataLoader(dataset, batch_size=8, num_workers={workers})
iterator = iter(loader)
started = time.perf_counter()
next(iterator)
first = time.perf_counter()
profile.disable()
text = io.StringIO()
if {workers} == 0:  # with workers the parent only waits
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("shardkit/|obstore|s3fs/", 14)
del iterator
shutil.rmtree(cache, ignore_errors=True)
from shardkit.storage import Storage
print(json.dumps({{"client": Storage({url!r}, {options!r}).client,
                  "dataset_ms": 1e3 * (made - began), "iterator_ms": 1e3 * (started - made),
                  "first_batch_ms": 1e3 * (first - started), "total_ms": 1e3 * (first - began),
                  "top": text.getvalue()}}))
"""


def child(code: str, client: str | None = None, code_dir: str | None = None) -> dict:
    """Run `code` in a fresh interpreter (shardkit from `code_dir` when given: the before-code) and return the
    JSON of its last line."""
    env = dict(os.environ)
    env.pop("SHARDKIT_STORAGE_CLIENT", None)
    if client == "fsspec":  # shardkit's opt-out; obstore is the default
        env["SHARDKIT_STORAGE_CLIENT"] = client
    if code_dir is not None:
        env["PYTHONPATH"] = code_dir
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env,
                          cwd="/tmp")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    import peers
    from bench_loader import MotoServer, build_arrow_copy, build_data

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="bench_out/object_store")
    parser.add_argument("--tokens", type=float, default=10e6)
    parser.add_argument("--shard-mb", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench_out/object_store.json")
    parser.add_argument("--only", default="", help="run only the cells whose label holds one of these texts "
                        "(comma-separated)")
    parser.add_argument("--before", default=None, help="a source tree of shardkit to measure beside this one "
                        "(e.g. `git archive` of main with its loaders/tools links): its obstore cells and profile "
                        "rows alternate with this code's, run by run, labelled 'before' and 'after'")
    parser.add_argument("--profile", action="store_true", help="also time the first batch's phases (see above)")
    args = parser.parse_args()
    data_dir, shard_bytes = Path(args.data_dir).resolve(), args.shard_mb * 2**20
    tar_url, flat, samples = build_data(data_dir, int(args.tokens), shard_bytes)
    local = {"shardkit Arrow": ("shardkit", build_arrow_copy(data_dir, flat, samples, shard_bytes)),
             "shardkit tar": ("shardkit", tar_url)}
    for name, (url, loader) in peers.build_peers(data_dir, flat, samples, 2049, shard_bytes, which=peers.PEERS,
                                                 litdata_compressions=("zstd",)).items():
        local[name] = ({peers.litdata_loader: "litdata", peers.mds_loader: "streaming",
                        peers.webdataset_loader: "webdataset", peers.hf_loader: "datasets"}[loader], url)
    cells: dict[str, dict] = {}
    with MotoServer() as server:
        os.environ.update({"AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
                           "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "bench")})
        remote = {name: (kind, server.upload(url, Path(url).name)) for name, (kind, url) in local.items()}
        configs = []  # (row label, kind, url, workers, client, code_dir)
        wanted = [text for text in args.only.split(",") if text] or [""]
        for name, (kind, url) in remote.items():
            clients = ("fsspec", "obstore") if kind == "shardkit" else (None,)
            for workers in (0, 2) if kind in ("shardkit", "webdataset", "litdata") else (0,):
                for client in clients:
                    side = f", {'fsspec (opt-out)' if client == 'fsspec' else 'obstore (default)'}" if client else ""
                    label = f"{name}{side}, workers={workers}"
                    if not any(text in label for text in wanted):
                        continue
                    if args.before and client == "obstore":
                        configs.append((f"{label}, before", kind, url, workers, client, args.before))
                        label += ", after"
                    configs.append((label, kind, url, workers, client, None))
        setup_url = remote["shardkit Arrow"][1]
        profiled = [("fsspec", None), ("obstore", None)] if not args.before else \
            [("obstore", args.before), ("obstore", None)]
        for run in range(args.runs):  # alternating: every configuration once per run
            for label, kind, url, workers, client, code_dir in configs:
                row = child(PASS_CHILD.format(bench=str(BENCH), label=kind, url=url, workers=workers,
                                              samples=samples, options=server.options), client, code_dir)
                cells.setdefault(label, []).append(row)
                print(f"  run {run + 1}: {label:<62} first batch {row['first_batch_s']:.3f} s "
                      f"{row['samples_per_s']:>9,.0f} samples/s exact {row['exact']} ({row['client']})", flush=True)
            for client, code_dir in profiled:
                code = "" if not args.before else ", before" if code_dir else ", after"
                row = child(SETUP_CHILD.format(url=setup_url, options=server.options), client, code_dir)
                cells.setdefault(f"set-up, {client}{code}", []).append(row)
                for workers in (0, 2) if args.profile else ():
                    row = child(PROFILE_CHILD.format(url=setup_url, options=server.options, workers=workers), client,
                                code_dir)
                    cells.setdefault(f"profile, {client}{code}, workers={workers}", []).append(row)
    result = {"machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
              "data": {"samples": samples, "shard_mb": args.shard_mb, "runs": args.runs}, "cells": cells}
    print(table(cells))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def table(cells: dict[str, list[dict]]) -> str:
    lines = ["| moto S3, fresh process, medians | first batch (s) | samples/s | runs (samples/s) | each sample once |",
             "|---|---|---|---|---|"]
    for label, runs in cells.items():
        if label.startswith(("set-up", "profile")):
            continue
        rates = [r["samples_per_s"] for r in runs]
        lines.append(f"| {label} | {statistics.median(r['first_batch_s'] for r in runs):.3f} | "
                     f"{statistics.median(rates):,.0f} | {' / '.join(f'{r:,.0f}' for r in rates)} | "
                     f"{'yes' if all(r['exact'] for r in runs) else '**no**'} |")
    lines += ["", "| object-store path set-up, fresh process, medians (ms) | import shardkit.storage | client (import "
              "+ build) | first request |",
              "|---|---|---|---|"]
    for label, runs in cells.items():
        if label.startswith("set-up"):
            lines.append(f"| {label} | " + " | ".join(f"{statistics.median(r[k] for r in runs):.1f}"
                                                      for k in ("import_ms", "client_ms", "first_request_ms")) + " |")
    profiled = {label: runs for label, runs in cells.items() if label.startswith("profile")}
    if profiled:
        lines += ["", "| first batch's phases, shardkit Arrow, fresh process, medians (ms) | dataset (manifest) "
                  "| loader + iterator | first batch | total |", "|---|---|---|---|---|"]
        for label, runs in profiled.items():
            lines.append(f"| {label} | " + " | ".join(f"{statistics.median(r[k] for r in runs):.1f}" for k in (
                "dataset_ms", "iterator_ms", "first_batch_ms", "total_ms")) + " |")
        for label, runs in profiled.items():
            if runs[-1]["top"]:
                lines += ["", f"cProfile, {label} (last run), by cumulative time:", runs[-1]["top"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
