"""The peers in bench_loader's cold mode (issue 14): LitData and MosaicML Streaming on the same samples.

Each peer's copy of the benchmark samples is written once under --data-dir, as shardkit's shards are,
with ~64 MiB chunks and the sample's index stored beside its tokens so that a pass can be checked for
exactness. Each run then starts from a fresh cache directory and makes one pass with batch 8, shuffle on
and 0 workers: time to first batch (dataset construction included), samples/s over the whole pass, and
how many distinct samples it delivered. A peer that is not installed is skipped with a printed line.

Installing them: their requirements pull a CUDA torch over ours, so use a venv that sees the system's
packages and add the peers without their dependencies, then the few small ones they import:

    python3 -m venv --system-site-packages /tmp/peersvenv
    /tmp/peersvenv/bin/pip install --no-deps litdata lightning-utilities obstore mosaicml-streaming zstd \\
        xxhash brotli python-snappy cramjam catalogue safetensors 'transformers<5' 'tokenizers<=0.23.0' \\
        'huggingface_hub<1' -e .

Streaming also imports torchvision (for its vision datasets only), whose wheels need CUDA torch: a
stand-in package in the venv with `torchvision.datasets.VisionDataset` and
`torchvision.transforms.functional.to_tensor` lets it import.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

# Each import of litdata would otherwise ask PyPI for a newer release, inside the first timed run.
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

LITDATA_COMPRESSIONS = (None, "zstd")


def installed(module: str, label: str) -> str | None:
    """The peer's version, or None after printing why it is skipped."""
    try:
        return importlib.import_module(module).__version__
    except ImportError as err:  # a missing dependency of the peer counts as the peer missing
        print(f"  peer {label} skipped: cannot import {module} ({err})", flush=True)
        return None


def build_litdata(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int,
                  compression: str | None) -> str:
    """The samples as LitData chunks of at most `chunk_bytes`, items {"index", "tokens"}."""
    from litdata.streaming.writer import BinaryWriter

    url = data_dir / f"peer-litdata-{compression or 'none'}"
    stamp = data_dir / f"peer-litdata-{compression or 'none'}-{samples}-{chunk_bytes}"
    if not stamp.exists():
        shutil.rmtree(url, ignore_errors=True)
        data = np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, seq))
        writer = BinaryWriter(str(url), chunk_bytes=chunk_bytes, compression=compression)
        for index, row in enumerate(data):
            writer.add_item(index, {"index": index, "tokens": np.array(row)})
        writer.done()
        writer.merge()
        stamp.touch()
    return str(url)


def build_mds(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int) -> str:
    """The samples as MosaicML MDS shards with zstd, columns index and tokens."""
    from streaming import MDSWriter

    url = data_dir / "peer-mds-zstd"
    stamp = data_dir / f"peer-mds-zstd-{samples}-{chunk_bytes}"
    if not stamp.exists():
        shutil.rmtree(url, ignore_errors=True)
        data = np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, seq))
        columns = {"index": "int64", "tokens": f"ndarray:uint16:{seq}"}
        with MDSWriter(out=str(url), columns=columns, compression="zstd", size_limit=chunk_bytes) as writer:
            for index, row in enumerate(data):
                writer.write({"index": index, "tokens": np.array(row)})
        stamp.touch()
    return str(url)


def peer_pass(make: Callable[[str], Iterable[dict]], samples: int, runs: int) -> dict:
    """`make(cache_dir)` builds the peer's loader; timed like bench_loader.cold_pass, and each pass's
    sample indices are counted: an exact pass delivers every one of the `samples` once."""
    firsts, rates, delivered, distinct = [], [], [], []
    for _ in range(runs):
        cache = tempfile.mkdtemp(prefix="shardkit-bench-peer-")
        try:
            start = time.perf_counter()
            iterator = iter(make(cache))
            indices = [np.asarray(next(iterator)["index"])]
            firsts.append(time.perf_counter() - start)
            indices += [np.asarray(batch["index"]) for batch in iterator]
            seen = np.concatenate(indices)
            rates.append(len(seen) / (time.perf_counter() - start))
            delivered.append(len(seen))
            distinct.append(len(np.unique(seen)))
            del iterator
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return {"first_batch_s": statistics.median(firsts), "samples_per_s": statistics.median(rates),
            "first_batch_runs": [round(t, 4) for t in firsts], "runs": [round(r) for r in rates],
            "samples": samples, "delivered": delivered, "distinct": distinct,
            "exact": all(d == samples for d in delivered) and all(d == samples for d in distinct)}


def litdata_loader(url: str, batch: int, endpoint: str | None = None) -> Callable[[str], Iterable[dict]]:
    from litdata import StreamingDataLoader, StreamingDataset

    options = None
    if endpoint is not None:
        options = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        # LitData fetches chunks with obstore, which refuses plain http unless told; LitData passes it
        # no such option (real S3 is https), so the loopback endpoint needs it set here.
        from litdata.streaming import downloader
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

    def make(cache: str) -> Iterable[dict]:
        dataset = StreamingDataset(url, cache_dir=cache, shuffle=True, storage_options=options)
        return StreamingDataLoader(dataset, batch_size=batch, num_workers=0)
    return make


def mds_loader(url: str, batch: int, endpoint: str | None = None) -> Callable[[str], Iterable[dict]]:
    from streaming import StreamingDataLoader, StreamingDataset

    if endpoint is not None:
        os.environ["S3_ENDPOINT_URL"] = endpoint  # Streaming's boto3 client reads its endpoint from here

    def make(cache: str) -> Iterable[dict]:
        dataset = StreamingDataset(remote=url, local=cache, shuffle=True, batch_size=batch)
        return StreamingDataLoader(dataset, batch_size=batch, num_workers=0)
    return make


def build_peers(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int) -> dict[str, tuple]:
    """{label: (url, loader factory)} for every installed peer, its data written once."""
    out = {}
    if litdata_version := installed("litdata", "LitData"):
        for compression in LITDATA_COMPRESSIONS:
            url = build_litdata(data_dir, flat, samples, seq, chunk_bytes, compression)
            out[f"LitData {litdata_version}, {compression or 'no compression'}"] = (url, litdata_loader)
    if mds_version := installed("streaming", "MosaicML Streaming"):
        out[f"MosaicML Streaming {mds_version}, MDS zstd"] = (build_mds(data_dir, flat, samples, seq, chunk_bytes),
                                                               mds_loader)
    return out


def measure_peers(peers: dict[str, tuple], where: str, samples: int, batch: int, runs: int,
                  server=None) -> dict[str, dict]:
    """One row per peer, read locally or (with `server`, bench_loader's MotoServer or S3rverServer) from
    its S3 endpoint."""
    rows = {}
    # The peers' S3 clients (boto3, obstore) take credentials from the environment: the server's own,
    # where it checks them (s3rver), for the peers' passes only.
    options = server.options if server is not None else {}
    credentials = {"AWS_ACCESS_KEY_ID": options.get("key"), "AWS_SECRET_ACCESS_KEY": options.get("secret")}
    for label, (url, loader) in peers.items():
        endpoint = None
        if server is not None:
            url, endpoint = server.upload(url, Path(url).name), options["endpoint_url"]
        with warnings.catch_warnings(), environment(credentials):
            # Streaming hands torch read-only arrays: one warning per process
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            row = peer_pass(loader(url, batch, endpoint), samples, runs)
        rows[f"{where}, {label}"] = row
        print(f"  {where + ', ' + label:<50} first batch {row['first_batch_s']:.3f} s "
              f"{row['samples_per_s']:>10,.0f} samples/s, distinct {min(row['distinct']):,} of {samples:,}",
              flush=True)
    if best := [row["samples_per_s"] for label, row in rows.items() if ", LitData " in label]:
        rows[f"{where}, LitData x2 (the goal)"] = {"samples_per_s": 2 * max(best), "goal": True}
    return rows


@contextlib.contextmanager
def environment(values: dict[str, str | None]):
    """Set the given environment variables (those not None) for the duration, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def exactness(row: dict) -> str:
    """'yes', or the worst run's repeated and missing samples."""
    if "distinct" not in row:
        return ""
    if row["exact"]:
        return "yes"
    repeated = max(d - u for d, u in zip(row["delivered"], row["distinct"]))
    return f"no: {repeated:,} repeated, {row['samples'] - min(row['distinct']):,} missing"


def print_peers(result: dict) -> None:
    """The peers' rows, then every shardkit row relative to LitData's best and to the goal in its place."""
    peers, cold = result.get("peers", {}), result["cold"]
    if not peers:
        return
    print(f"\n{'peers, cold, one pass, workers=0':<56} {'first batch s':>13} {'samples/s':>11} "
          f"{'each sample once':>17}")
    for name, row in peers.items():
        first = f"{row['first_batch_s']:>13.3f}" if "first_batch_s" in row else f"{'':>13}"
        print(f"{name:<56} {first} {row['samples_per_s']:>11,.0f} {exactness(row):>17}")
    print(f"\n{'shardkit vs the peers (same place)':<56} {'samples/s':>11} {'x LitData best':>15} {'% of goal':>10}")
    for name, row in cold.items():
        where = name.split(",")[0]
        lit = [r["samples_per_s"] for n, r in peers.items() if n.startswith(where + ", LitData ") and "goal" not in r]
        goal = peers.get(f"{where}, LitData x2 (the goal)")
        if "samples_per_s" not in row or not lit:
            continue
        print(f"{name:<56} {row['samples_per_s']:>11,.0f} {row['samples_per_s'] / max(lit):>14.2f}x "
              f"{100 * row['samples_per_s'] / goal['samples_per_s']:>9.0f}%")
