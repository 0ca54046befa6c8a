"""Many shards: manifest load, dataset construction and first-batch plan at 200k and 1M shards.

    python benchmarks/bench_manifest.py [--shards 200000 1000000] [--runs 3] [--out bench_out/manifest.json]

Writes (once, under --data-dir) a synthetic manifest of N shards with realistic fields: 13,000
samples of 2,049 uint16 tokens per shard (about 53 MB raw, 60% compressed), random SHA-256s, names
`shards/shard-NNNNNNN.tar`; the shard files themselves are never needed, as nothing here reads a
sample. Then, each run in a fresh process (world size 1, batch 8, shuffle on, 0 workers), it times
`load_manifest`, `StreamingDataset` construction (which loads the manifest again: total = construction
+ plan, what one rank pays) and the plan of the first batch (the sample ids of
the first chunk of batches: order, steps, positions), and the process's peak RSS (then, apart, the
data fingerprint that the first saved loader state records); then, in another
fresh process that never imports torch, a bare `load_manifest` (time and peak RSS: what the manifest
itself costs). Figures are medians of --runs runs. Prints a table and writes JSON.

Memory is counted three ways, since the node's processes share the pages of a memory-mapped index:
peak RSS (VmHWM: every resident page, shared ones in full), anonymous memory (RssAnon after the plan:
the process's own pages) and, with --node-ranks R, PSS (/proc/self/smaps_rollup: each shared page
divided by the processes mapping it) of R later processes of one node, all alive at once.

    python benchmarks/bench_manifest.py --code before=/tmp/old/.venv/bin/python --code after=.venv/bin/python

compares versions of shardkit in one run (the machine is shared: its load drifts between runs): each
`--code LABEL=PYTHON` interpreter (one with that version installed) measures every run in turn,
interleaved, on the same manifests. Without --code, this interpreter only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SAMPLES_PER_SHARD = 13_000
SAMPLE_TOKENS = 2_049


def write_synthetic(directory: Path, shards: int, with_index: bool = True) -> Path:
    """A dataset prefix holding a valid manifest of `shards` shards (no shard files), with or without
    the binary index beside it."""
    from shardkit.manifest import MANIFEST_NAME

    prefix = directory / f"shards-{shards}"
    if not (prefix / MANIFEST_NAME).exists():
        write_json(prefix, shards)
    index = prefix / "shardkit.index"
    try:  # the binary index the build writes beside the JSON (when this shardkit has one)
        from shardkit.manifest import write_index
    except ImportError:
        return prefix
    if with_index and not index.exists():
        write_index(str(prefix))
    elif not with_index and index.exists():
        index.unlink()
    return prefix


def write_json(prefix: Path, shards: int) -> None:
    import numpy as np

    prefix.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    raw = SAMPLES_PER_SHARD * SAMPLE_TOKENS * 2
    compressed = raw * 6 // 10
    tokens = SAMPLES_PER_SHARD * SAMPLE_TOKENS
    header = {
        "format": "shardkit", "format_version": 1, "shardkit_version": "bench", "shard_format": "tar",
        "token_dtype": "uint16", "seq_len": SAMPLE_TOKENS - 1, "max_sample_tokens": SAMPLE_TOKENS,
        "packing": "concat", "hash": "sha256", "compression": {"codec": "zstd", "level": 3},
        "tokenizer": {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257, "eos_id": 50256, "bos_id": None,
                      "pad_id": None, "special_ids": {}, "vocab_sha256": None},
        "sources": ["synthetic"], "build": {},
        "totals": {"shards": shards, "samples": shards * SAMPLES_PER_SHARD, "tokens": shards * tokens,
                   "compressed_bytes": shards * compressed, "raw_bytes": shards * raw},
    }
    # Written the way Manifest.to_json lays out a shard (indent=1, sorted keys), without building
    # a million dicts first.
    entry = (' {{\n  "compressed_bytes": {c},\n  "has_doc_boundaries": false,\n  "name": "shards/shard-{i:07d}.tar",\n'
             '  "raw_bytes": {r},\n  "samples": {s},\n  "sha256": "{h}",\n  "tokens": {t}\n }}')
    digests = rng.integers(0, 256, size=(shards, 32), dtype=np.uint8)
    text = json.dumps(header, indent=1, sort_keys=True)
    with open(prefix / "shardkit.json.tmp", "w") as fh:
        fh.write(text[:-2] + ',\n "shards": [\n')
        fh.write(",\n".join(entry.format(c=compressed, i=i, r=raw, s=SAMPLES_PER_SHARD, h=digests[i].tobytes().hex(),
                                         t=tokens) for i in range(shards)))
        fh.write("\n ]\n}\n")
    os.replace(prefix / "shardkit.json.tmp", prefix / "shardkit.json")


def peak_rss_mb() -> float:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a child would report the parent's
    # peak (the parent parses the whole JSON to write the index).
    return memory_mb("/proc/self/status", "VmHWM")


def memory_mb(path: str, field: str) -> float:
    """A "Field:   N kB" line of a /proc file (status, smaps_rollup), in MB."""
    with open(path) as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_for(directory: Path, stage: str, count: int, timeout: float = 600.0) -> None:
    """Mark this process at `stage` and wait until `count` processes are (a file-based barrier)."""
    (directory / f"{stage}-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while len(list(directory.glob(f"{stage}-*"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(directory.glob(f'{stage}-*')))} of {count} processes reached {stage}")
        time.sleep(0.05)


def measure_once(prefix: str, cache_dir: str, node: tuple[Path, int] | None = None) -> dict:
    """One fresh-process measurement (runs inside the child). With `node` (a barrier directory and a
    number of processes), also the PSS while that many processes hold the manifest at once."""
    t0 = time.perf_counter()
    from shardkit.loaders.dataset import StreamingDataset
    from shardkit.manifest import load_manifest
    import_s = time.perf_counter() - t0
    baseline_mb = peak_rss_mb()  # python + numpy + torch

    t0 = time.perf_counter()
    dataset = StreamingDataset(prefix, cache_dir=cache_dir, rank=0, world_size=1, local_rank=0, local_world_size=1,
                               batch_size=8)
    construct_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        ids = first_chunk_ids(dataset)
    except MemoryError:  # the address-space cap below: the plan would have needed more
        ids, plan_s = None, float("inf")
    else:
        plan_s = time.perf_counter() - t0
    peak_mb = peak_rss_mb()  # what one rank holds at its peak, up to the first batch's plan
    anon_mb = memory_mb("/proc/self/status", "RssAnon")  # its own pages, not the page cache's
    shared = {}
    if node is not None:
        barrier, ranks = node
        wait_for(barrier, "planned", ranks)  # every process of the node maps the index now
        shared = {"node_" + key.lower(): memory_mb("/proc/self/smaps_rollup", key)
                  for key in ("Pss", "Pss_Anon", "Pss_File")}
        shared["node_peak_rss_mb"], shared["node_anon_mb"] = peak_mb, anon_mb
        wait_for(barrier, "measured", ranks)  # none exits (unmaps) before all have measured
    t0 = time.perf_counter()
    # The data's identity, which the loader's first saved state records (`fingerprint()` in code before issue 42,
    # which --code may measure).
    (dataset.identity if hasattr(dataset, "identity") else dataset.fingerprint)()
    fingerprint_s = time.perf_counter() - t0
    del dataset
    t0 = time.perf_counter()
    load_manifest(prefix)  # a bare load (no node cache record: hashes the JSON when there is an index)
    load_s = time.perf_counter() - t0
    return {"import_s": import_s, "load_manifest_s": load_s, "construct_s": construct_s, "first_plan_s": plan_s,
            "total_s": construct_s + plan_s, "fingerprint_s": fingerprint_s, "peak_rss_mb": peak_mb,
            "baseline_rss_mb": baseline_mb, "anon_mb": anon_mb, **shared,
            "first_ids": None if ids is None else ids[:4].tolist()}


def measure_bare(prefix: str) -> dict:
    """A bare `load_manifest` in a fresh process that never imports torch (the child): what the
    manifest itself costs, apart from the ~210 MB that importing torch adds to every rank."""
    from shardkit.manifest import load_manifest

    baseline_mb = peak_rss_mb()
    t0 = time.perf_counter()
    load_manifest(prefix)
    return {"bare_load_s": time.perf_counter() - t0, "bare_peak_rss_mb": peak_rss_mb(),
            "bare_baseline_rss_mb": baseline_mb, "torch_imported": "torch" in sys.modules}


def node_runs(python: str, prefix: Path, cache: Path, ranks: int) -> list[dict]:
    """`ranks` later processes of one node (`cache` holds its record), started together; each measures
    its PSS once all of them have planned their first batch."""
    barrier = cache.parent / f"{cache.name}-barrier"
    shutil.rmtree(barrier, ignore_errors=True)
    barrier.mkdir(parents=True)
    children = [subprocess.Popen([python, __file__, "--child", str(prefix), str(cache), "--node", str(barrier),
                                  str(ranks)], stdout=subprocess.PIPE, text=True) for _ in range(ranks)]
    outputs = [child.communicate()[0] for child in children]
    if any(child.returncode for child in children):
        raise RuntimeError(f"a node process failed: exit codes {[child.returncode for child in children]}")
    shutil.rmtree(barrier, ignore_errors=True)
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def first_chunk_ids(dataset):
    """Sample ids of the first chunk of batches, as `_generate` plans them."""
    from shardkit.loaders.dataset import IterationPlan

    topology = dataset.resolve_topology()
    plan = IterationPlan(epoch=0, start=0, batch_size=8, topology=topology, num_partitions=1)
    if hasattr(dataset, "plan"):  # the read plan: the same steps the fixed batch mode reads
        from shardkit.loaders.order.rank_steps import rank_step_ids
        return next(rank_step_ids(dataset.source.order(0, 1), start=0, plan=plan, policy=dataset.config.partial_batches,
                                  chunk_samples=dataset.config.chunk_samples)).reshape(-1)
    if hasattr(dataset, "chunk_ids"):
        return next(iter(dataset.chunk_ids(0, 0, plan, 0, 1))).reshape(-1)
    # Before the lazy plan: the same steps as the old `_generate`.
    from shardkit.loaders.order.partition import rank_positions, steps_in_epoch, worker_steps
    order = dataset.source.order(0, 1)
    total = steps_in_epoch(order.num_positions, start=0, global_batch=8, policy=dataset.config.partial_batches)
    steps = worker_steps(total, worker=0, num_workers=1)
    per_chunk = max(1, dataset.config.chunk_samples // 8)
    chunks = [steps[i:i + per_chunk] for i in range(0, len(steps), per_chunk)]
    positions = rank_positions(chunks[0], start=0, num_positions=order.num_positions, world_size=1, batch_size=8,
                               rank=0, partition_of=order.partition_of)
    ids = order.sample_ids(positions)
    ids.sort(axis=1)
    return ids.reshape(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--data-dir", default="bench_data/manifest")
    parser.add_argument("--out", default="bench_out/manifest.json")
    parser.add_argument("--no-index", action="store_true", help="measure the JSON path (no binary index)")
    parser.add_argument("--label", default="", help="recorded with the results (e.g. before / after)")
    parser.add_argument("--code", action="append", default=[], metavar="LABEL=PYTHON",
                        help="measure with this interpreter's shardkit too (repeat: versions compared in one run)")
    parser.add_argument("--node-ranks", type=int, default=8, metavar="R",
                        help="PSS of R later processes of one node, started together (0: not measured)")
    parser.add_argument("--child", nargs=2, metavar=("PREFIX", "CACHE"), help=argparse.SUPPRESS)
    parser.add_argument("--node", nargs=2, metavar=("BARRIER", "RANKS"), help=argparse.SUPPRESS)
    parser.add_argument("--bare-child", metavar="PREFIX", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_child:
        print(json.dumps(measure_bare(args.bare_child)))
        return
    if args.child:
        # The machine is shared: a plan that needs more than this fails with MemoryError instead of
        # pushing the others into swap (the old plan over 1M shards needs tens of GB).
        cap = 6 * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        node = (Path(args.node[0]), int(args.node[1])) if args.node else None
        print(json.dumps(measure_once(*args.child, node=node)))
        return

    codes = [tuple(c.split("=", 1)) for c in args.code] or [("", sys.executable)]
    rows = []
    for shards in args.shards:
        t0 = time.perf_counter()
        prefix = write_synthetic(Path(args.data_dir), shards, with_index=not args.no_index)
        print(f"{shards:,} shards: manifest ready in {time.perf_counter() - t0:.1f} s "
              f"({(prefix / 'shardkit.json').stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
        for process in ("first", "other"):
            # "first": the node's first process (its cache has no record of the manifest yet: it
            # hashes the JSON once); "other": a later process of the same node (same cache).
            runs: dict[str, list[dict]] = {label: [] for label, _ in codes}
            for run in range(args.runs):
                for k, (label, python) in enumerate(codes):
                    cache = Path(args.data_dir) / f"cache-{shards}-{run}-{k}"
                    if process == "first":
                        shutil.rmtree(cache, ignore_errors=True)
                    out = subprocess.run([python, __file__, "--child", str(prefix), str(cache)], check=True,
                                         capture_output=True, text=True)
                    runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    if process == "first":  # once per run: the manifest alone, without torch
                        out = subprocess.run([python, __file__, "--bare-child", str(prefix)], check=True,
                                             capture_output=True, text=True)
                        runs[label][-1].update(json.loads(out.stdout.strip().splitlines()[-1]))
            if process == "other" and args.node_ranks:
                for k, (label, python) in enumerate(codes):  # one node at a time: its processes share pages
                    runs[label] += node_runs(python, prefix, Path(args.data_dir) / f"cache-{shards}-0-{k}",
                                             args.node_ranks)
            for label, _ in codes:
                row = {"shards": shards, "process": process, "code": label, "runs": runs[label]}
                for key in ("load_manifest_s", "construct_s", "first_plan_s", "total_s", "fingerprint_s", "peak_rss_mb",
                            "baseline_rss_mb", "anon_mb", "bare_load_s", "bare_peak_rss_mb", "bare_baseline_rss_mb"):
                    # Timings from the processes that ran alone, not from the node's crowd.
                    row[key] = statistics.median(r.get(key, float("nan")) for r in runs[label] if "node_pss" not in r)
                for key in ("node_pss", "node_pss_anon", "node_pss_file", "node_peak_rss_mb", "node_anon_mb"):
                    row[key] = statistics.median([r[key] for r in runs[label] if key in r] or [float("nan")])
                rows.append(row)

    print(f"\n{'shards':>10} {'code':>8} {'process':>8} {'load_manifest s':>16} {'construct s':>12} {'first plan s':>13} "
          f"{'total s':>8} {'peak RSS MB':>12} {'RSS after imports MB':>21} {'anon MB':>8}")
    for row in rows:
        print(f"{row['shards']:>10,} {row['code']:>8} {row['process']:>8} {row['load_manifest_s']:>16.3f} "
              f"{row['construct_s']:>12.3f} {row['first_plan_s']:>13.3f} {row['total_s']:>8.3f} "
              f"{row['peak_rss_mb']:>12.0f} {row['baseline_rss_mb']:>21.0f} {row['anon_mb']:>8.0f}")
    if args.node_ranks:
        print(f"\n{args.node_ranks} later processes of one node at once (medians over them), MB per process:")
        print(f"{'shards':>10} {'code':>8} {'PSS':>6} {'PSS anon':>9} {'PSS file':>9} {'peak RSS':>9} {'anon':>6}")
        for row in rows:
            if row["process"] == "other":
                print(f"{row['shards']:>10,} {row['code']:>8} {row['node_pss']:>6.0f} {row['node_pss_anon']:>9.0f} "
                      f"{row['node_pss_file']:>9.0f} {row['node_peak_rss_mb']:>9.0f} {row['node_anon_mb']:>6.0f}")
    print("\nThe data fingerprint (first saved loader state), other processes:")
    for row in rows:
        if row["process"] == "other":
            print(f"{row['shards']:>10,} {row['code']:>8}: {row['fingerprint_s']:.3f} s")
    print("\nA bare load_manifest in a process without torch (no node cache record: it hashes the JSON):")
    for row in rows:
        if row["process"] == "first":
            print(f"{row['shards']:>10,} {row['code']:>8}: {row['bare_load_s']:.3f} s, peak RSS "
                  f"{row['bare_peak_rss_mb']:.0f} MB ({row['bare_baseline_rss_mb']:.0f} MB after imports)")
    result = {"label": args.label, "index": not args.no_index, "machine": platform.platform(), "python": platform.python_version(),
              "cpus": os.cpu_count(), "load_average_after": os.getloadavg(), "runs": args.runs, "codes": dict(codes),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
