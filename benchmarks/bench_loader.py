"""Loader throughput, side by side: the limits, shardkit, and the peers that are installed.

    python benchmarks/bench_loader.py [--out bench_out/loader.json] [--runs 3]

Data: ~100M tokens as 2,049-token uint16 samples (~49k samples), written once under --data-dir
as shardkit tar shards plus a flat memmap copy for the limits. Every reader gets batch 8 with
shuffling on, from a warm local cache; each figure is the median of --runs runs over --batches
batches (time to first batch excluded from throughput, reported apart). Also measured: time to first
batch from a cold S3 endpoint (moto on loopback), time to first batch after resuming at 0%, 50% and
99% of the epoch, and the loader's anonymous memory per rank. Prints a table, writes JSON.

    python benchmarks/bench_loader.py --cold [--tokens 25e6] [--out bench_out/loader_cold.json]

Cold mode (issue 14): the same samples as format v1 shards read the way shardkit did before format v2
("before": the whole first shard downloaded, hashed, decoded and written before the first batch) and as
v2 shards with each `cache_mode` ("after"), tar and arrow, locally and from moto S3 on loopback (and from
s3rver, where installed: moto reads the whole object for every ranged GET, s3rver only the range). Each run
starts from a fresh cache directory and makes one pass with 0 workers: time to first batch (dataset
construction included) and samples/s over the whole pass, beside the single-thread zstd limit: the time
to decompress every zstd frame of the same shards from memory, in this run. Also: resume at 50% of the
epoch on a fresh node (empty cache). Medians of --runs runs. The peers that are installed (LitData, no
compression and zstd; MosaicML Streaming, MDS zstd: benchmarks/peers.py) make the same cold pass over the
same samples, locally and from the same moto server, and the table shows shardkit's rows against them
and against the issue's goal, twice LitData's samples/s.

    python benchmarks/bench_loader.py --side-by-side [--tokens 10e6] [--shard-mb 4] [--runs 3]

Side-by-side mode (issue 36, benchmarks/side_by_side.py): shardkit Arrow and tar and every installed peer
(LitData, MosaicML Streaming, WebDataset, Hugging Face datasets) in every column: samples/s of one pass with 0
and 2 workers, local and from moto S3, first batch fresh and after a resume, each pass checked for exactness.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (the cold mode's peers)
from batch_cost import at_position  # noqa: E402

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


def build_arrow_copy(data_dir: Path, flat: Path, samples: int, shard_bytes: int) -> str:
    """The same samples as Arrow shards (for the cold-start comparison of the two formats)."""
    from shardkit.formats import ShardWriter
    from shardkit.manifest import Manifest, TokenizerInfo, write_manifest
    from shardkit.storage import Storage

    url = data_dir / "arrow"
    stamp = data_dir / f"arrow-done-{samples}-{shard_bytes}"
    if stamp.exists():
        return str(url)
    shutil.rmtree(url, ignore_errors=True)
    data = np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, SEQ + 1))
    with ShardWriter(str(url), shard_format="arrow", token_dtype="uint16", max_bytes=shard_bytes) as writer:
        for row in data:
            writer.write(np.array(row))
    manifest = Manifest(shard_format="arrow", token_dtype="uint16", seq_len=SEQ, packing="concat",
                        tokenizer=TokenizerInfo(kind="byte", name="random", vocab_size=VOCAB), shards=writer.shards)
    write_manifest(Storage(str(url)), manifest)
    stamp.touch()
    return str(url)


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

    from shardkit.formats import wds_decode_hook, wds_samples
    from shardkit.manifest import load_manifest

    shards = [f"{url}/{s.name}" for s in load_manifest(url).shards]

    def make():
        # A tar shard's webdataset record is a block of samples (docs/FORMAT.md section 4): split, then shuffle.
        pipeline = (wds.WebDataset(shards, shardshuffle=len(shards), nodesplitter=wds.single_node_only,
                                   empty_check=False)
                    .decode(wds_decode_hook).compose(wds_samples).shuffle(1000).to_tuple("tokens.npy.zst")
                    .batched(batch))
        return iter(wds.WebLoader(pipeline, batch_size=None, num_workers=workers))
    return make


def cold_s3(urls: dict[str, str], runs: int, batch: int) -> dict:
    """Upload the shards to a moto S3 server on loopback (`MotoServer`); time to first batch from empty
    caches."""
    from shardkit import StreamingDataLoader, StreamingDataset

    out = {}
    with MotoServer() as moto:
        for name, url in urls.items():
            s3_url = moto.upload(url, name)
            # The first batch needs every shard of the first shuffle window: the default window
            # (16,384 samples) spans two of these shards, a window of 8,192 usually one.
            for window in (16384, 8192):
                times, creates = [], []
                for _ in range(runs):
                    cache = tempfile.mkdtemp(prefix="shardkit-bench-cold-")
                    start = time.perf_counter()
                    ds = StreamingDataset(s3_url, cache_dir=cache, storage_options=moto.options, rank=0,
                                          world_size=1, shuffle_window=window)
                    created = time.perf_counter()
                    next(iter(StreamingDataLoader(ds, batch_size=batch)))
                    times.append(time.perf_counter() - start)
                    creates.append(created - start)
                    for cache_of_stream in ds.caches:  # the shards the dropped iterator opened are completed
                        cache_of_stream.drain()       # in the background: not beside the next run
                    shutil.rmtree(cache, ignore_errors=True)
                out[f"{name}, shuffle_window={window}"] = {
                    "first_batch_s": statistics.median(times), "manifest_s": statistics.median(creates),
                    "runs": [round(t, 3) for t in times]}
    return out


def resume_times(url: str, cache: str, batch: int, runs: int) -> dict:
    from shardkit import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(url, cache_dir=cache, rank=0, world_size=1)
    template = StreamingDataLoader(ds, batch_size=batch).state_dict()
    steps = len(StreamingDataLoader(ds, batch_size=batch))
    out = {}
    for fraction in (0.0, 0.5, 0.99):
        state = at_position(template, int(steps * fraction) * batch)
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


# -- cold start: fresh cache, one pass (issue 14) ------------------------------------------------
COLD_CONFIGS = ((1, "decoded"), (2, "decoded"), (2, "compressed"), (2, "none"))


def build_versions(data_dir: Path, flat: Path, samples: int, shard_bytes: int) -> dict[tuple[str, int], str]:
    """The benchmark samples as tar and arrow shards of format versions 1 and 2: {(format, version): url}."""
    from shardkit.formats import ShardWriter
    from shardkit.manifest import Manifest, TokenizerInfo, write_manifest
    from shardkit.storage import Storage

    urls = {}
    data = np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, SEQ + 1))
    for shard_format in ("tar", "arrow"):
        for version in (1, 2):
            url = data_dir / f"cold-{shard_format}-v{version}"
            stamp = data_dir / f"cold-{shard_format}-v{version}-{samples}-{shard_bytes}"
            urls[shard_format, version] = str(url)
            if stamp.exists():
                continue
            shutil.rmtree(url, ignore_errors=True)
            with ShardWriter(str(url), shard_format=shard_format, token_dtype="uint16", max_bytes=shard_bytes,
                             format_version=version) as writer:
                for row in data:
                    writer.write(np.array(row))
            manifest = Manifest(shard_format=shard_format, token_dtype="uint16", seq_len=SEQ, packing="concat",
                                tokenizer=TokenizerInfo(kind="byte", name="random", vocab_size=VOCAB),
                                shards=writer.shards)
            write_manifest(Storage(str(url)), manifest)
            stamp.touch()
    return urls


def zstd_limit(url: str, runs: int) -> dict:
    """Samples/s of decompressing every zstd frame of the dataset's shards in one thread, from memory
    (tar: one frame per member; arrow: one frame per compressed Arrow buffer): the work no loader of
    these bytes can skip."""
    import struct

    import pyarrow as pa
    import zstandard

    from shardkit.formats.arrow_ipc import record_batch_buffers
    from shardkit.formats.tar_format import iter_tar_members
    from shardkit.manifest import load_manifest

    manifest = load_manifest(url)
    frames: list[tuple[bytes, int]] = []
    for shard in manifest.shards:
        data = (Path(url) / shard.name).read_bytes()
        if manifest.shard_format == "tar":
            frames += [(bytes(payload), -1) for _, payload in iter_tar_members(data, shard.name)]
            continue
        messages = pa.ipc.MessageReader.open_stream(pa.BufferReader(pa.py_buffer(data).slice(8)))
        for message in messages:
            if message.type != "record batch":
                continue
            body = message.body.to_pybytes()
            buffers, _ = record_batch_buffers(message.metadata.to_pybytes(), shard.name)
            for offset, length in buffers:
                declared = struct.unpack_from("<q", body, offset)[0] if length >= 8 else -1
                if declared > 0:
                    frames.append((body[offset + 8:offset + length], declared))
    rates = []
    for _ in range(runs):
        dctx = zstandard.ZstdDecompressor()
        start = time.perf_counter()
        for frame, size in frames:
            dctx.decompress(frame, max_output_size=size) if size > 0 else dctx.decompress(frame)
        rates.append(manifest.num_samples / (time.perf_counter() - start))
    return {"samples_per_s": statistics.median(rates), "frames": len(frames)}


def sha256_limit(url: str, runs: int) -> dict:
    """Samples/s of one thread computing the SHA-256 of every shard's bytes from memory: a verified
    cold pass hashes every byte at least once, so no such pass runs faster on one core (for incompressible
    tokens this, not zstd, is the bound)."""
    import hashlib

    from shardkit.manifest import load_manifest

    manifest = load_manifest(url)
    blobs = [(Path(url) / shard.name).read_bytes() for shard in manifest.shards]
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        for blob in blobs:
            hashlib.sha256(blob).digest()
        rates.append(manifest.num_samples / (time.perf_counter() - start))
    return {"samples_per_s": statistics.median(rates), "bytes": sum(map(len, blobs))}


def cold_pass(url: str, batch: int, runs: int, *, cache_mode: str, options: dict | None = None,
              resume_at: float | None = None) -> dict:
    """Fresh cache each run: time to first batch (dataset construction included) and samples/s over the
    whole pass (first batch included); with `resume_at`, resume from that fraction of the epoch and time
    the first batch only (a fresh node taking over a job)."""
    from shardkit import StreamingDataLoader, StreamingDataset

    firsts, rates = [], []
    for _ in range(runs):
        cache = tempfile.mkdtemp(prefix="shardkit-bench-cold-")
        try:
            start = time.perf_counter()
            dataset = StreamingDataset(url, cache_dir=cache, rank=0, world_size=1, cache_mode=cache_mode,
                                       storage_options=options)
            loader = StreamingDataLoader(dataset, batch_size=batch)
            if resume_at is not None:
                state = loader.state_dict()
                loader.load_state_dict(at_position(state, int(len(loader) * resume_at) * batch))
            iterator = iter(loader)
            next(iterator)
            firsts.append(time.perf_counter() - start)
            if resume_at is None:
                count = 1 + sum(1 for _ in iterator)
                rates.append(count * batch / (time.perf_counter() - start))
            del iterator, loader
            for cache_of_stream in dataset.caches:  # background completions, before the directory goes
                cache_of_stream.drain()
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    out = {"first_batch_s": statistics.median(firsts), "first_batch_runs": [round(t, 4) for t in firsts]}
    if rates:
        out["samples_per_s"] = statistics.median(rates)
    return out


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a server started next)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoServer:
    """A moto S3 server in its own process on loopback (in-process it would compete for the GIL)."""

    def __enter__(self) -> MotoServer:
        import subprocess
        import sys

        for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            os.environ.setdefault(key, value)
        port = free_port()
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{port}"
        self._create_bucket(endpoint)
        self.options = {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"},
                        "skip_instance_cache": True}
        return self

    def _create_bucket(self, endpoint: str, **keys: str) -> None:
        import boto3

        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise
                time.sleep(0.2)

    def upload(self, url: str, name: str) -> str:
        for path in sorted(Path(url).iterdir()):
            self.client.upload_file(str(path), "bench", f"{name}/{path.name}")
        return f"s3://bench/{name}"

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(10)


class S3rverServer(MotoServer):
    """An s3rver (npm `s3rver`, a Node.js S3 server storing objects as files) on loopback: it serves a ranged
    GET by streaming that range from its file, as S3 does, where moto 5 reads the whole object for every
    range. Credentials are s3rver's fixed pair; signatures are not checked."""

    def __init__(self, executable: str):
        self.executable = executable

    def __enter__(self) -> S3rverServer:
        import subprocess

        port = free_port()
        self.directory = tempfile.mkdtemp(prefix="shardkit-bench-s3rver-")
        self.process = subprocess.Popen([self.executable, "-d", self.directory, "-a", "127.0.0.1", "-p", str(port),
                                         "--silent", "--allow-mismatched-signatures", "--no-vhost-buckets"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{port}"
        self._create_bucket(endpoint, aws_access_key_id="S3RVER", aws_secret_access_key="S3RVER")
        self.options = {"endpoint_url": endpoint, "key": "S3RVER", "secret": "S3RVER",
                        "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__()
        shutil.rmtree(self.directory, ignore_errors=True)


def cold_benchmark(args: argparse.Namespace) -> dict:
    data_dir = Path(args.data_dir)
    _, flat, samples = build_data(data_dir, int(args.tokens), args.shard_mb * 2**20)
    urls = build_versions(data_dir, flat, samples, args.shard_mb * 2**20)
    batch, runs = args.batch, args.runs
    rows: dict[str, dict] = {}

    def record(where: str, shard_format: str, version: int, mode: str, row: dict) -> None:
        label = f"{where}, {shard_format} v{version}, cache_mode={mode}"
        rows[label] = row
        rate = f"{row['samples_per_s']:>10,.0f} samples/s" if "samples_per_s" in row else ""
        print(f"  {label:<50} first batch {row['first_batch_s']:.3f} s {rate}", flush=True)

    limits = {fmt: zstd_limit(urls[fmt, 2], runs) for fmt in ("tar", "arrow")}
    for fmt, limit in limits.items():
        print(f"  zstd limit, {fmt}: {limit['samples_per_s']:,.0f} samples/s ({limit['frames']} frames)", flush=True)
    hash_limits = {fmt: sha256_limit(urls[fmt, 2], runs) for fmt in ("tar", "arrow")}
    for fmt, limit in hash_limits.items():
        print(f"  sha256 limit, {fmt}: {limit['samples_per_s']:,.0f} samples/s", flush=True)
    for fmt in ("tar", "arrow"):
        for version, mode in COLD_CONFIGS:
            record("local", fmt, version, mode, cold_pass(urls[fmt, version], batch, runs, cache_mode=mode))
    peer_data = peers.build_peers(data_dir, flat, samples, SEQ + 1, args.shard_mb * 2**20)
    peer_rows = peers.measure_peers(peer_data, "local", samples, batch, runs)
    resume = {}
    for fmt in ("tar", "arrow"):
        for version, mode in ((1, "decoded"), (2, "decoded"), (2, "none")):
            row = cold_pass(urls[fmt, version], batch, runs, cache_mode=mode, resume_at=0.5)
            resume[f"local, {fmt} v{version}, cache_mode={mode}"] = row
            print(f"  resume at 50% on a fresh node, {fmt} v{version} {mode}: {row['first_batch_s']:.3f} s", flush=True)
    servers = {"moto S3": MotoServer} if not args.skip_s3 else {}
    if servers and args.s3rver:
        servers["s3rver S3"] = lambda: S3rverServer(args.s3rver)
    for where, start_server in servers.items():
        with start_server() as server:
            for fmt in ("tar", "arrow"):
                for version in (1, 2):
                    s3_url = server.upload(urls[fmt, version], f"{fmt}-v{version}")
                    for v, mode in COLD_CONFIGS:
                        if v == version and mode != "compressed":
                            record(where, fmt, v, mode, cold_pass(s3_url, batch, runs, cache_mode=mode,
                                                                  options=server.options))
                    if where != "moto S3":
                        continue
                    row = cold_pass(s3_url, batch, runs, cache_mode="decoded", options=server.options, resume_at=0.5)
                    resume[f"moto S3, {fmt} v{version}, cache_mode=decoded"] = row
                    print(f"  resume at 50% on a fresh node, moto S3, {fmt} v{version}: {row['first_batch_s']:.3f} s",
                          flush=True)
            peer_rows |= peers.measure_peers(peer_data, where, samples, batch, runs, server=server)
    return {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "note": "shared 2-core machine"},
            "data": {"samples": samples, "tokens_per_sample": SEQ + 1, "token_dtype": "uint16", "batch": batch,
                     "shard_mb": args.shard_mb, "runs": runs, "workers": 0},
            "zstd_limit": limits, "sha256_limit": hash_limits, "cold": rows, "cold_resume_50pct": resume,
            "peers": peer_rows}


def print_cold(result: dict) -> None:
    limits = result["zstd_limit"]
    print(f"\n{'cold, one pass, workers=0':<56} {'first batch s':>13} {'samples/s':>11} {'% of zstd limit':>16}")
    for name, row in result["cold"].items():
        fmt = "tar" if ", tar " in name else "arrow"
        rate = row.get("samples_per_s")
        share = f"{100 * rate / limits[fmt]['samples_per_s']:.0f}%" if rate else ""
        print(f"{name:<56} {row['first_batch_s']:>13.3f} {rate or 0:>11,.0f} {share:>16}")
    for fmt, limit in limits.items():
        print(f"{'zstd limit (one thread), ' + fmt:<56} {'':>13} {limit['samples_per_s']:>11,.0f}")
    for fmt, limit in result.get("sha256_limit", {}).items():
        print(f"{'sha256 limit (one thread), ' + fmt:<56} {'':>13} {limit['samples_per_s']:>11,.0f}")
    print(f"\n{'resume at 50% on a fresh node':<56} {'first batch s':>13}")
    for name, row in result["cold_resume_50pct"].items():
        print(f"{name:<56} {row['first_batch_s']:>13.3f}")
    peers.print_peers(result)


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
    parser.add_argument("--s3rver", default=shutil.which("s3rver"),
                        help="s3rver executable (npm install s3rver): cold mode adds rows from it, an S3 server that "
                        "serves a range in proportion to its length (moto reads the whole object for each range)")
    parser.add_argument("--cold", action="store_true", help="cold start only: fresh cache, one pass, format "
                        "v1 vs v2 and each cache_mode, local and moto S3, resume on a fresh node, and the "
                        "installed peers (benchmarks/peers.py); with --real: cold rows beside the warm ones")
    parser.add_argument("--side-by-side", action="store_true", help="issue 36's table: shardkit Arrow and tar and "
                        "every installed peer, one pass with 0 and 2 workers, local and moto S3, first batch fresh "
                        "and after a resume (benchmarks/side_by_side.py)")
    parser.add_argument("--real", action="store_true", help="real-token rows only (benchmarks/real_tokens.py): GPT-2 "
                        "tokens of ../shared with document boundaries, seq 1024, warm, beside the memmap limit")
    parser.add_argument("--baseline", default=None, help="--real: a commit to measure in the same run (A/B)")
    parser.add_argument("--after", default=None, help="--real: measure this commit instead of the working tree")
    parser.add_argument("--workers", type=int, nargs="+", default=[0], help="--real: DataLoader workers")
    parser.add_argument("--epochs", type=int, default=4, help="--real: warm epochs per run")
    parser.add_argument("--cache-modes", nargs="+", default=["decoded"], choices=["decoded", "compressed", "none"],
                        help="--real: cache_mode of each row")
    parser.add_argument("--peers", action="store_true", help="--real: LitData's cold pass on the same samples")
    parser.add_argument("--real-format", default="tar", choices=["tar", "arrow"], help="--real: shard format")
    args = parser.parse_args()
    if args.side_by_side:
        import side_by_side

        result = side_by_side.side_by_side(args)
        print(side_by_side.table(result))
        print(f"load average at the end: {os.getloadavg()}")
        out = Path(args.out if args.out != "bench_out/loader.json" else "bench_out/loader_side_by_side.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        return
    if args.real:
        import real_tokens

        result = real_tokens.real_benchmark(args)
        real_tokens.print_real(result)
        out = Path(args.out if args.out != "bench_out/loader.json" else "bench_out/loader_real.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        return
    if args.cold and not args.real:
        result = cold_benchmark(args)
        print_cold(result)
        out = Path(args.out if args.out != "bench_out/loader.json" else "bench_out/loader_cold.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        return

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
        arrow = build_arrow_copy(Path(args.data_dir), flat, samples, args.shard_mb * 2**20)
        result["cold_s3"] = cold_s3({"tar": url, "arrow": arrow}, runs, batch)

    print(f"\n{'loader':<50} {'samples/s':>12} {'first batch s':>14}")
    for name, row in rows.items():
        print(f"{name:<50} {row['samples_per_s']:>12,.0f} {row['first_batch_s']:>14.3f}")
    print("\nresume, time to first batch (s):", {k: round(v, 3) for k, v in result["resume_first_batch_s"].items()})
    for name, row in result.get("cold_s3", {}).items():
        print(f"cold S3 (moto on loopback, {name}, {args.shard_mb} MiB shards), time to first batch: "
              f"{row['first_batch_s']:.3f} s (manifest {row['manifest_s']:.3f} s)")
    print("loader memory per rank:", result["memory_per_rank"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
