"""The peers of bench_loader's cold mode (issue 14: LitData and MosaicML Streaming) and of its side-by-side mode
(issue 36: also WebDataset and Hugging Face datasets), on the same samples.

Each peer's copy of the benchmark samples is written once under --data-dir, as shardkit's shards are,
with ~64 MiB chunks and the sample's index stored beside its tokens so that a pass can be checked for
exactness. Each run then starts from a fresh cache directory and makes one pass with batch 8, shuffle on
and 0 workers: time to first batch (dataset construction included), samples/s over the whole pass, and
how many distinct samples it delivered. A peer that is not installed is skipped with a printed line.

Each peer is read its usual way: LitData's `StreamingDataset`/`StreamingDataLoader` over its chunks;
Streaming's over MDS shards (zstd); WebDataset's `WebDataset` pipeline over its own tar shards (a `.npy`
and a `.cls` member per sample, shards shuffled, a 1,000-sample shuffle buffer; from S3 through presigned
URLs, which WebDataset fetches with curl, its way for object stores); Hugging Face `datasets` streaming
Parquet files (`load_dataset("parquet", streaming=True)`, a 1,000-sample shuffle buffer, fsspec's s3fs for
S3) under torchdata's `StatefulDataLoader`, which is how it resumes. A factory takes the same arguments for
every peer, `(url, batch, server, workers)`, and returns `make(cache_dir)`, the peer's loader.

Installing them: their requirements pull a CUDA torch over ours, so use a venv that sees the system's
packages and add the peers without their dependencies, then the few small ones they import:

    python3 -m venv --system-site-packages /tmp/peersvenv
    /tmp/peersvenv/bin/pip install --no-deps litdata lightning-utilities obstore mosaicml-streaming zstd \\
        xxhash brotli python-snappy cramjam catalogue
    /tmp/peersvenv/bin/pip install --no-deps --no-build-isolation -e .

(Hugging Face `datasets` comes from the system's packages with its own huggingface_hub: pinning
`huggingface_hub<1` in the venv, as this line once did, made `datasets` 5 fail to import and its peer skip.)

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


def written_once(data_dir: Path, name: str, samples: int, chunk_bytes: int,
                 write: Callable[[Path], None]) -> str:
    """`data_dir / name`, written by `write(path)` unless a stamp says these samples and chunk size are there."""
    url = data_dir / name
    stamp = data_dir / f"{name}-{samples}-{chunk_bytes}"
    if not stamp.exists():
        shutil.rmtree(url, ignore_errors=True)
        write(url)
        stamp.touch()
    return str(url)


def rows_of(flat: Path, samples: int, seq: int) -> np.memmap:
    return np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, seq))


def build_litdata(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int,
                  compression: str | None) -> str:
    """The samples as LitData chunks of at most `chunk_bytes`, items {"index", "tokens"}."""
    from litdata.streaming.writer import BinaryWriter

    def write(url: Path) -> None:
        writer = BinaryWriter(str(url), chunk_bytes=chunk_bytes, compression=compression)
        for index, row in enumerate(rows_of(flat, samples, seq)):
            writer.add_item(index, {"index": index, "tokens": np.array(row)})
        writer.done()
        writer.merge()
    return written_once(data_dir, f"peer-litdata-{compression or 'none'}", samples, chunk_bytes, write)


def build_mds(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int) -> str:
    """The samples as MosaicML MDS shards with zstd, columns index and tokens."""
    from streaming import MDSWriter

    def write(url: Path) -> None:
        columns = {"index": "int64", "tokens": f"ndarray:uint16:{seq}"}
        with MDSWriter(out=str(url), columns=columns, compression="zstd", size_limit=chunk_bytes) as writer:
            for index, row in enumerate(rows_of(flat, samples, seq)):
                writer.write({"index": index, "tokens": np.array(row)})
    return written_once(data_dir, "peer-mds-zstd", samples, chunk_bytes, write)


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


def litdata_loader(url: str, batch: int, server=None, workers: int = 0) -> Callable[[str], Iterable[dict]]:
    from litdata import StreamingDataLoader, StreamingDataset

    options = None
    if server is not None:
        options = {"endpoint_url": server.options["endpoint_url"], "region_name": "us-east-1"}
        # LitData fetches chunks with obstore, which refuses plain http unless told; LitData passes it
        # no such option (real S3 is https), so the loopback endpoint needs it set here.
        from litdata.streaming import downloader
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

    def make(cache: str) -> Iterable[dict]:
        dataset = StreamingDataset(url, cache_dir=cache, shuffle=True, storage_options=options)
        return StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)
    return make


def mds_loader(url: str, batch: int, server=None, workers: int = 0) -> Callable[[str], Iterable[dict]]:
    from streaming import StreamingDataLoader, StreamingDataset

    if server is not None:
        os.environ["S3_ENDPOINT_URL"] = server.options["endpoint_url"]  # Streaming's boto3 client reads it here

    def make(cache: str) -> Iterable[dict]:
        dataset = StreamingDataset(remote=url, local=cache, shuffle=True, batch_size=batch)
        return StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)
    return make


def build_webdataset(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int) -> str:
    """The samples as WebDataset tar shards of at most `chunk_bytes`: per sample `tokens.npy` and `index.cls`."""
    import webdataset as wds

    def write(url: Path) -> None:
        url.mkdir(parents=True)
        with wds.ShardWriter(str(url / "shard-%06d.tar"), maxcount=samples, maxsize=chunk_bytes, verbose=0) as sink:
            for index, row in enumerate(rows_of(flat, samples, seq)):
                sink.write({"__key__": f"{index:09d}", "tokens.npy": np.array(row), "index.cls": index})
    return written_once(data_dir, "peer-webdataset", samples, chunk_bytes, write)


def _wds_batch(batch: tuple) -> dict:
    return {"index": np.asarray(batch[0]), "tokens": batch[1]}


def webdataset_loader(url: str, batch: int, server=None, workers: int = 0) -> Callable[[str], Iterable[dict]]:
    import webdataset as wds

    if server is None:
        shards = [str(path) for path in sorted(Path(url).glob("*.tar"))]
    else:  # presigned GETs: WebDataset reads an object store through URLs (curl), not through an S3 client
        bucket, prefix = url[len("s3://"):].split("/", 1)
        keys = sorted(o["Key"] for o in server.client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"])
        shards = [server.client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                       ExpiresIn=3600) for key in keys if key.endswith(".tar")]

    def make(cache: str) -> Iterable[dict]:
        pipeline = (wds.WebDataset(shards, shardshuffle=len(shards), nodesplitter=wds.single_node_only,
                                   empty_check=False)
                    .shuffle(1000).decode().to_tuple("index.cls", "tokens.npy").batched(batch).map(_wds_batch))
        return wds.WebLoader(pipeline, batch_size=None, num_workers=workers)
    return make


def build_hf(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int) -> str:
    """The samples as Parquet files of about `chunk_bytes` of tokens (zstd), columns index and tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(url: Path) -> None:
        url.mkdir(parents=True)
        data, rows = rows_of(flat, samples, seq), max(1, chunk_bytes // (2 * seq))
        for number, start in enumerate(range(0, samples, rows)):
            part = np.array(data[start:start + rows])
            tokens = pa.FixedSizeListArray.from_arrays(pa.array(part.ravel()), seq)
            table = pa.table({"index": pa.array(np.arange(start, start + len(part))), "tokens": tokens})
            pq.write_table(table, url / f"part-{number:05d}.parquet", compression="zstd", row_group_size=1024)
    return written_once(data_dir, "peer-hf-parquet", samples, chunk_bytes, write)


def hf_loader(url: str, batch: int, server=None, workers: int = 0) -> Callable[[str], Iterable[dict]]:
    import datasets
    from datasets import load_dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    # datasets 5 sleeps 5 s whenever a shuffled stream's Parquet readers end (SLEEP_TIME_ON_THREADS_SHUTDOWN,
    # a workaround for apache/arrow#45214): in a pass of seconds that one sleep would be most of its time.
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here is on the Hub: no lookups inside timed runs

    if server is None:
        files, options = [str(path) for path in sorted(Path(url).glob("*.parquet"))], None
    else:
        bucket, prefix = url[len("s3://"):].split("/", 1)
        keys = sorted(o["Key"] for o in server.client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"])
        files = [f"s3://{bucket}/{key}" for key in keys if key.endswith(".parquet")]
        options = {name: value for name, value in server.options.items() if name != "skip_instance_cache"}

    def make(cache: str) -> Iterable[dict]:
        dataset = load_dataset("parquet", data_files=files, split="train", streaming=True, cache_dir=cache,
                               storage_options=options)
        dataset = dataset.shuffle(seed=0, buffer_size=1000).with_format("numpy")
        return StatefulDataLoader(dataset, batch_size=batch, num_workers=workers)
    return make


PEERS = ("litdata", "streaming", "webdataset", "datasets")  # importable names, in the tables' order


def build_peers(data_dir: Path, flat: Path, samples: int, seq: int, chunk_bytes: int, *,
                which: tuple[str, ...] = ("litdata", "streaming"),
                litdata_compressions: tuple[str | None, ...] = LITDATA_COMPRESSIONS) -> dict[str, tuple]:
    """{label: (url, loader factory)} for every installed peer of `which` (names of `PEERS`), its data written once."""
    out = {}
    if "litdata" in which and (litdata_version := installed("litdata", "LitData")):
        for compression in litdata_compressions:
            url = build_litdata(data_dir, flat, samples, seq, chunk_bytes, compression)
            out[f"LitData {litdata_version}, {compression or 'no compression'}"] = (url, litdata_loader)
    if "streaming" in which and (mds_version := installed("streaming", "MosaicML Streaming")):
        out[f"MosaicML Streaming {mds_version}, MDS zstd"] = (build_mds(data_dir, flat, samples, seq, chunk_bytes),
                                                               mds_loader)
    if "webdataset" in which and (wds_version := installed("webdataset", "WebDataset")):
        out[f"WebDataset {wds_version}, .npy members"] = (build_webdataset(data_dir, flat, samples, seq, chunk_bytes),
                                                           webdataset_loader)
    if "datasets" in which and (hf_version := installed("datasets", "Hugging Face datasets")):
        out[f"HF datasets {hf_version}, Parquet streaming"] = (build_hf(data_dir, flat, samples, seq, chunk_bytes),
                                                               hf_loader)
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
        if server is not None:
            url = server.upload(url, Path(url).name)
        with warnings.catch_warnings(), environment(credentials):
            # Streaming hands torch read-only arrays: one warning per process
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            row = peer_pass(loader(url, batch, server), samples, runs)
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
