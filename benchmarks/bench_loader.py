"""Loader throughput, side by side: the limits, shardkit, and the peers that are installed.

    python benchmarks/bench_loader.py [--out bench_out/loader.json] [--runs 3]

Data: ~100M tokens as 2,049-token uint16 samples (~49k samples), written once under --data-dir
as shardkit tar shards plus a flat memmap copy for the limits. Every reader gets batch 8 with
shuffling on, from a warm local cache; each figure is the median of --runs runs over --batches
batches (time to first batch excluded from throughput, reported apart). Also measured: time to first
batch from a cold S3 endpoint (moto on loopback), time to first batch after resuming at 0%, 50% and
99% of the epoch, and the loader's anonymous memory per rank. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

SEQ = 2048
VOCAB = 50257


def rss_anon_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- data ---------------------------------------------------------------------------------------
def build_data(data_dir: Path, tokens: int, shard_bytes: int) -> tuple[str, Path, int]:
    from shardkit.formats import ShardWriter
    from shardkit.manifest import Manifest, TokenizerInfo, write_manifest

    samples = tokens // (SEQ + 1)
    url, flat = data_dir / "shards", data_dir / "flat.u16"
    stamp = data_dir / f"done-{samples}-{shard_bytes}"
    if stamp.exists():
        return str(url), flat, samples
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    memmap = np.memmap(flat, dtype=np.uint16, mode="w+", shape=(samples, SEQ + 1))
    with ShardWriter(str(url), token_dtype="uint16", max_bytes=shard_bytes) as writer:
        for start in range(0, samples, 4096):
            block = rng.integers(0, VOCAB, size=(min(4096, samples - start), SEQ + 1), dtype=np.uint16)
            memmap[start:start + len(block)] = block
            for row in block:
                writer.write(row)
    memmap.flush()
    manifest = Manifest(shard_format="tar", token_dtype="uint16", seq_len=SEQ, packing="concat",
                        tokenizer=TokenizerInfo(kind="byte", name="random", vocab_size=VOCAB), shards=writer.shards)
    from shardkit.storage import Storage
    write_manifest(Storage(str(url)), manifest)
    stamp.touch()
    return str(url), flat, samples


# -- measurement ---------------------------------------------------------------------------------
def measure(make: Callable[[], Iterator], batches: int, runs: int, batch_size: int) -> dict:
    rates, firsts = [], []
    for _ in range(runs):
        start = time.perf_counter()
        iterator = make()
        next(iterator)
        first = time.perf_counter()
        got = 1
        for _ in iterator:
            got += 1
            if got >= batches:
                break
        end = time.perf_counter()
        del iterator
        rates.append((got - 1) * batch_size / (end - first))
        firsts.append(first - start)
    return {"samples_per_s": statistics.median(rates), "first_batch_s": statistics.median(firsts),
            "runs": [round(r) for r in rates]}


def memmap_gathers(flat: Path, samples: int, batch: int) -> Callable[[], Iterator]:
    def make():
        # a plain ndarray view of the mapping: np.memmap's subclass hooks would slow every index
        data = np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, SEQ + 1)).view(np.ndarray)
        order = np.random.default_rng().permutation(samples)
        for i in range(0, samples - batch + 1, batch):
            yield np.take(data, np.sort(order[i:i + batch]), axis=0)
    return make


def torch_memmap_loader(flat: Path, samples: int, batch: int, workers: int) -> Callable[[], Iterator]:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class MemmapDataset(Dataset):
        def __init__(self):
            self.data = None

        def __len__(self):
            return samples

        def __getitem__(self, i):
            if self.data is None:  # opened lazily so that workers map the file themselves
                self.data = np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, SEQ + 1))
            return torch.from_numpy(np.array(self.data[i]))

    def make():
        return iter(DataLoader(MemmapDataset(), batch_size=batch, shuffle=True, num_workers=workers))
    return make


def shardkit_loader(url: str, cache: str, batch: int, workers: int, state: dict | None = None) -> Callable:
    from shardkit import StreamingDataLoader, StreamingDataset

    def make():
        loader = StreamingDataLoader(StreamingDataset(url, cache_dir=cache, rank=0, world_size=1), batch_size=batch,
                                     num_workers=workers)
        if state is not None:
            loader.load_state_dict(state)
        return iter(loader)
    return make


def webdataset_loader(url: str, batch: int, workers: int) -> Callable[[], Iterator]:
    import webdataset as wds

    from shardkit.formats import wds_decode_hook
    from shardkit.manifest import load_manifest

    shards = [f"{url}/{s.name}" for s in load_manifest(url).shards]

    def make():
        pipeline = (wds.WebDataset(shards, shardshuffle=len(shards), nodesplitter=wds.single_node_only,
                                   empty_check=False)
                    .shuffle(1000).decode(wds_decode_hook).to_tuple("tokens.npy.zst").batched(batch))
        return iter(wds.WebLoader(pipeline, batch_size=None, num_workers=workers))
    return make


def cold_s3(url: str, runs: int, batch: int) -> dict:
    """Upload the shards to a moto S3 server on loopback; time to first batch from empty caches.

    The server runs in its own process, as a real endpoint would: in-process it would compete with
    the loader for the GIL.
    """
    import socket
    import subprocess
    import sys

    import boto3

    from shardkit import StreamingDataLoader, StreamingDataset

    for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for path in sorted(Path(url).iterdir()):
            client.upload_file(str(path), "bench", f"data/{path.name}")
        options = {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
        times, creates = [], []
        for _ in range(runs):
            cache = tempfile.mkdtemp(prefix="shardkit-bench-cold-")
            start = time.perf_counter()
            ds = StreamingDataset("s3://bench/data", cache_dir=cache, storage_options=options, rank=0, world_size=1)
            created = time.perf_counter()
            next(iter(StreamingDataLoader(ds, batch_size=batch)))
            times.append(time.perf_counter() - start)
            creates.append(created - start)
            shutil.rmtree(cache, ignore_errors=True)
        return {"first_batch_s": statistics.median(times), "manifest_s": statistics.median(creates),
                "runs": [round(t, 3) for t in times]}
    finally:
        server.terminate()
        server.wait(10)


def resume_times(url: str, cache: str, batch: int, runs: int) -> dict:
    from shardkit import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(url, cache_dir=cache, rank=0, world_size=1)
    template = StreamingDataLoader(ds, batch_size=batch).state_dict()
    steps = len(StreamingDataLoader(ds, batch_size=batch))
    out = {}
    for fraction in (0.0, 0.5, 0.99):
        state = {**template, "samples_consumed": int(steps * fraction) * batch}
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            loader = StreamingDataLoader(StreamingDataset(url, cache_dir=cache, rank=0, world_size=1), batch_size=batch)
            loader.load_state_dict(state)
            next(iter(loader))
            times.append(time.perf_counter() - start)
        out[f"{round(fraction * 100)}%"] = statistics.median(times)
    return out


def memory_per_rank(url: str, cache: str, batch: int, batches: int) -> dict:
    import gc
    import tracemalloc

    from shardkit import StreamingDataLoader, StreamingDataset

    gc.collect()
    before = rss_anon_mb()
    tracemalloc.start()
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=cache, rank=0, world_size=1), batch_size=batch)
    peak_rss = before
    for i, _ in enumerate(loader):
        if i % 256 == 0:
            peak_rss = max(peak_rss, rss_anon_mb())
        if i >= batches:
            break
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"rss_anon_growth_mb": round(peak_rss - before, 1), "python_heap_peak_mb": round(peak / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out/loader.json", help="JSON output path")
    parser.add_argument("--data-dir", default="bench_out/loader_data", help="where the benchmark data is kept")
    parser.add_argument("--tokens", type=float, default=100e6, help="dataset size in tokens")
    parser.add_argument("--shard-mb", type=int, default=64, help="raw MiB per shard")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4096, help="batches per timed run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-s3", action="store_true", help="skip the cold S3 measurement")
    args = parser.parse_args()

    url, flat, samples = build_data(Path(args.data_dir), int(args.tokens), args.shard_mb * 2**20)
    cache = str(Path(args.data_dir) / "cache")
    batch, batches, runs = args.batch, args.batches, args.runs
    next(shardkit_loader(url, cache, batch, 0)())  # warm the cache
    for _ in shardkit_loader(url, cache, batch, 0)():
        pass

    rows: dict[str, dict] = {}
    candidates = {
        "limit: numpy memmap random gathers": memmap_gathers(flat, samples, batch),
        "limit: torch DataLoader over memmap, workers=0": torch_memmap_loader(flat, samples, batch, 0),
        "limit: torch DataLoader over memmap, workers=2": torch_memmap_loader(flat, samples, batch, 2),
        "shardkit, workers=0": shardkit_loader(url, cache, batch, 0),
        "shardkit, workers=2": shardkit_loader(url, cache, batch, 2),
    }
    try:
        import webdataset  # noqa: F401 - a peer, measured where installed
        candidates["peer: webdataset, workers=0"] = webdataset_loader(url, batch, 0)
        candidates["peer: webdataset, workers=2"] = webdataset_loader(url, batch, 2)
    except ImportError:
        pass
    for name, make in candidates.items():
        rows[name] = measure(make, batches, runs, batch)
        print(f"  measured {name}: {rows[name]['samples_per_s']:,.0f} samples/s", flush=True)

    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "note": "shared 2-core machine"},
        "data": {"samples": samples, "tokens_per_sample": SEQ + 1, "token_dtype": "uint16", "batch": batch,
                 "shard_mb": args.shard_mb, "batches_per_run": batches, "runs": runs},
        "throughput": rows,
        "resume_first_batch_s": resume_times(url, cache, batch, runs),
        "memory_per_rank": memory_per_rank(url, cache, batch, batches),
    }
    if not args.skip_s3:
        result["cold_s3"] = cold_s3(url, runs, batch)

    print(f"\n{'loader':<50} {'samples/s':>12} {'first batch s':>14}")
    for name, row in rows.items():
        print(f"{name:<50} {row['samples_per_s']:>12,.0f} {row['first_batch_s']:>14.3f}")
    print("\nresume, time to first batch (s):", {k: round(v, 3) for k, v in result["resume_first_batch_s"].items()})
    if "cold_s3" in result:
        print("cold S3 (moto on loopback), time to first batch (s):", round(result["cold_s3"]["first_batch_s"], 3))
    print("loader memory per rank:", result["memory_per_rank"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
