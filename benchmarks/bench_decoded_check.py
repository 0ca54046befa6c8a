"""What binding decoded cache files to their shard costs, on the shards of a real dataset.

    python benchmarks/bench_decoded_check.py URL [--repeats 5] [--out bench_out/bench_decoded_check.json]

For each shard of the dataset at URL (e.g. one `shardkit build` wrote from ../shared/corpora), it measures
the medians over `--repeats` runs of:

- fetch: the loader's first use of a shard, `read_shard` (read, SHA-256, decode) + `check_decoded`;
- write: `write_decoded` of the decoded arrays (CRC-32 computed while writing), to a local file;
- open: `open_decoded(..., shard_sha256=...)` of that file, page cache warm (the loader's every later use);
- crc: the CRC-32 pass alone over the same mapped file, i.e. what the check adds to every open.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from shardkit.formats import check_decoded, decode_shard, open_decoded, read_shard, write_decoded
from shardkit.formats.decoded import TRAILER
from shardkit.manifest import load_manifest
from shardkit.storage import Storage


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def crc_pass(path: str) -> int:
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    return zlib.crc32(mapped[:len(mapped) - TRAILER.size])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out/bench_decoded_check.json")
    args = parser.parse_args(argv)
    storage = Storage(args.url)
    manifest = load_manifest(storage)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for shard in manifest.shards:
            def fetch():
                arrays = read_shard(storage, shard, decode=lambda data: decode_shard(
                    data, shard_format=manifest.shard_format, token_dtype=manifest.token_dtype, shard=shard.name,
                    raw_bytes=shard.raw_bytes))
                check_decoded(arrays, shard, vocab_size=manifest.tokenizer.vocab_size)
                return arrays

            arrays = fetch()
            path = os.path.join(scratch, shard.name + ".skd")
            row = {"shard": shard.name, "decoded_mb": None,
                   "fetch_s": median_seconds(fetch, args.repeats),
                   "write_s": median_seconds(lambda: write_decoded(path, arrays, shard_sha256=shard.sha256),
                                             args.repeats),
                   "open_s": median_seconds(lambda: open_decoded(path, shard=shard.name, shard_sha256=shard.sha256),
                                            args.repeats),
                   "crc_s": median_seconds(lambda: crc_pass(path), args.repeats)}
            row["decoded_mb"] = os.path.getsize(path) / 1e6
            row["crc_gb_per_s"] = row["decoded_mb"] / 1e3 / row["crc_s"]
            rows.append(row)
    print(f"{'shard':<22} {'decoded MB':>10} {'fetch ms':>9} {'write ms':>9} {'open ms':>8} {'crc ms':>7} "
          f"{'crc GB/s':>8} {'crc/fetch':>9}")
    for r in rows:
        print(f"{r['shard']:<22} {r['decoded_mb']:>10.1f} {r['fetch_s'] * 1e3:>9.1f} {r['write_s'] * 1e3:>9.1f} "
              f"{r['open_s'] * 1e3:>8.1f} {r['crc_s'] * 1e3:>7.1f} {r['crc_gb_per_s']:>8.2f} "
              f"{r['crc_s'] / r['fetch_s']:>9.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"url": args.url, "repeats": args.repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
