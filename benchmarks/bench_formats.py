"""Benchmark the two shard formats against the limits of the same machine, measured in the same run.

For `tar` and `arrow` it measures, on synthetic packed sequences of 2,049 uint16 tokens:

- write MB/s: `ShardWriter` from samples to local shard files (encode + zstd + atomic write);
- cache MB/s: shard bytes (already read into memory, untimed) -> `decode_shard` -> decoded cache
  file (`write_decoded`, a local file), i.e. what the loader's node-local cache does once per shard;
  "cache+sha" adds the SHA-256 check of the shard bytes that precedes it;
- random samples/s: batches of 8 random samples gathered into one [8, 2049] array from a cached shard
  (`ShardReader.open_decoded(...).gather`), the loader's steady state;

and beside them the limits: zstd decompression MB/s of the same raw bytes (one frame per shard, same
level) and numpy memmap random gathers of 8 samples from a flat .bin file of the same tokens, both
through `np.memmap` itself (the issue's reference) and through a plain ndarray view of that mapping
(the tighter bound: the memmap subclass adds Python overhead to every index).

Tokens are not uniform noise (which zstd cannot compress at all): ids follow a Zipf law (exponent
1.1, like word/token frequencies in text) mapped through a fixed random permutation of a 50,257-id
vocabulary, so compression ratios are in the range of real tokenized text, if not equal to it.

MB are 10^6 bytes of *raw* token payload (2 bytes per token). Every figure is the median over
`--repeats` runs. Prints a table and writes JSON (default bench_out/bench_formats.json).
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
from pathlib import Path

import numpy as np
import zstandard

from shardkit.formats import ShardReader, ShardWriter, decode_shard, write_decoded
from shardkit.formats.shard_bytes import check_shard_bytes
from shardkit.storage import Storage

SAMPLE_TOKENS = 2049
VOCAB = 50257
BATCH = 8


def synthetic_tokens(num_samples: int, seed: int) -> np.ndarray:
    """[num_samples, 2049] uint16 ids with a Zipf-like frequency distribution."""
    rng = np.random.default_rng(seed)
    permutation = rng.permutation(VOCAB).astype(np.uint16)
    out = np.empty((num_samples, SAMPLE_TOKENS), dtype=np.uint16)
    chunk = max(1, 4_000_000 // SAMPLE_TOKENS)
    for lo in range(0, num_samples, chunk):
        hi = min(lo + chunk, num_samples)
        ranks = rng.zipf(1.1, size=(hi - lo) * SAMPLE_TOKENS)
        ranks = np.minimum(ranks - 1, VOCAB - 1)  # the tail beyond the vocabulary folds onto the rarest id
        out[lo:hi] = permutation[ranks].reshape(hi - lo, SAMPLE_TOKENS)
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_write(tokens: np.ndarray, directory: Path, shard_format: str, max_bytes: int, level: int):
    shutil.rmtree(directory, ignore_errors=True)
    writer = ShardWriter(str(directory), shard_format=shard_format, token_dtype="uint16", max_bytes=max_bytes,
                         max_samples=None, compression_level=level)

    def run() -> None:
        with writer:
            for row in tokens:
                writer.write(row)

    return timed(run), writer.shards


def bench_cache(directory: Path, shards, shard_format: str, cache_dir: Path, *, verify: bool) -> float:
    storage = Storage(str(directory))
    blobs = [storage.read_bytes(s.name) for s in shards]  # from the page cache: measure decoding, not the disk
    cache_dir.mkdir(parents=True, exist_ok=True)

    def run() -> None:
        for shard, data in zip(shards, blobs):
            if verify:
                check_shard_bytes(data, shard=shard.name, sha256=shard.sha256, size=shard.compressed_bytes)
            arrays = decode_shard(data, shard_format=shard_format, token_dtype="uint16", shard=shard.name,
                                  raw_bytes=shard.raw_bytes)
            write_decoded(str(cache_dir / (shard.name + ".decoded")), arrays)

    return timed(run)


def bench_zstd_limit(tokens: np.ndarray, samples_per_shard: int, level: int) -> tuple[float, int]:
    """Seconds to decompress every shard's raw bytes as one zstd frame each; and the raw byte count."""
    frames = []
    compressor = zstandard.ZstdCompressor(level=level)
    for lo in range(0, len(tokens), samples_per_shard):
        frames.append(compressor.compress(tokens[lo:lo + samples_per_shard].tobytes()))
    dctx = zstandard.ZstdDecompressor()
    return timed(lambda: [dctx.decompress(f) for f in frames]), tokens.nbytes


def bench_gathers(gathers: dict, batches: np.ndarray, rounds: int = 10) -> dict[str, float]:
    """Samples per second of each `gather(indices)` over precomputed [k, 8] random index batches.

    The gathers take turns over `rounds` slices of the batches, so that on a shared machine a burst
    of load from elsewhere hits all of them alike rather than whichever happened to run then.
    """
    everything = np.arange(int(batches.max()) + 1)
    for gather in gathers.values():  # fault every page in first: measure gathers, not first-touch mmap faults
        for part in np.array_split(everything, max(1, everything.size // 256)):
            gather(part)
    seconds = dict.fromkeys(gathers, 0.0)
    for chunk in np.array_split(batches, rounds):
        for name, gather in gathers.items():
            start = time.perf_counter()
            for idx in chunk:
                gather(idx)
            seconds[name] += time.perf_counter() - start
    return {name: batches.size / s for name, s in seconds.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000_000, help="tokens to write per format (default 100M)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians are reported")
    parser.add_argument("--shard-mb", type=float, default=64, help="raw MB per shard (ShardWriter max_bytes)")
    parser.add_argument("--level", type=int, default=3, help="zstd level")
    parser.add_argument("--batches", type=int, default=20_000, help="random batches of 8 per access measurement")
    parser.add_argument("--out", default="bench_out/bench_formats.json", help="JSON results file")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one under bench_out/)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_formats-", dir=out_path.parent))
    work.mkdir(parents=True, exist_ok=True)
    num_samples = max(1, args.tokens // SAMPLE_TOKENS)
    print(f"generating {num_samples:,} samples x {SAMPLE_TOKENS} tokens (Zipf 1.1 ids) ...", file=sys.stderr)
    tokens = synthetic_tokens(num_samples, args.seed)
    raw_mb = tokens.nbytes / 1e6
    max_bytes = int(args.shard_mb * 1e6)
    rng = np.random.default_rng(args.seed + 1)
    results: dict = {"formats": {}, "limits": {}}
    try:
        # The memmap limit: the same tokens as one flat file, gathered with the same random batches.
        flat = work / "flat.bin"
        tokens.tofile(flat)
        mm = np.memmap(flat, dtype=np.uint16, mode="r").reshape(-1, SAMPLE_TOKENS)
        mm_view = mm.view(np.ndarray)
        for shard_format in ("tar", "arrow"):
            runs: dict[str, list[float]] = {"write_mb_s": [], "cache_mb_s": [], "cache_verified_mb_s": [],
                                            "random_samples_s": [], "memmap_samples_s": [], "mmap_view_samples_s": [],
                                            "zstd_mb_s": []}
            for repeat in range(args.repeats):
                print(f"{shard_format}: run {repeat + 1}/{args.repeats}", file=sys.stderr)
                shard_dir = work / f"{shard_format}-shards"
                seconds, shards = bench_write(tokens, shard_dir, shard_format, max_bytes, args.level)
                runs["write_mb_s"].append(raw_mb / seconds)
                cache_dir = work / f"{shard_format}-cache"
                # Alternate which cache variant runs first: on a shared machine the first often runs colder.
                for verify in ((False, True) if repeat % 2 == 0 else (True, False)):
                    key = "cache_verified_mb_s" if verify else "cache_mb_s"
                    runs[key].append(raw_mb / bench_cache(shard_dir, shards, shard_format, cache_dir, verify=verify))
                zstd_seconds, zstd_bytes = bench_zstd_limit(tokens, shards[0].samples, args.level)
                runs["zstd_mb_s"].append(zstd_bytes / 1e6 / zstd_seconds)
                reader = ShardReader.open_decoded(str(cache_dir / (shards[0].name + ".decoded")), name=shards[0].name)
                batches = rng.integers(0, len(reader), size=(args.batches, BATCH))
                rates = bench_gathers({"random_samples_s": reader.gather, "memmap_samples_s": mm.__getitem__,
                                       "mmap_view_samples_s": mm_view.__getitem__}, batches)
                for key, rate in rates.items():
                    runs[key].append(rate)
            median = {key: statistics.median(values) for key, values in runs.items()}
            compressed = sum(s.compressed_bytes for s in shards)
            results["formats"][shard_format] = {
                "shards": len(shards), "samples_per_shard": shards[0].samples,
                "compressed_bytes": compressed, "raw_token_bytes": tokens.nbytes,
                "compression_ratio": tokens.nbytes / compressed,
                **median,
                "random_vs_memmap": median["random_samples_s"] / median["memmap_samples_s"],
                "random_vs_mmap_view": median["random_samples_s"] / median["mmap_view_samples_s"],
                "cache_vs_zstd": median["cache_mb_s"] / median["zstd_mb_s"],
                "runs": runs,
            }
            shutil.rmtree(work / f"{shard_format}-shards", ignore_errors=True)
            shutil.rmtree(work / f"{shard_format}-cache", ignore_errors=True)
        del mm, mm_view
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    results["config"] = {"tokens": int(tokens.size), "samples": num_samples, "sample_tokens": SAMPLE_TOKENS,
                         "token_dtype": "uint16", "distribution": "zipf(1.1) over a permuted 50,257-id vocabulary",
                         "repeats": args.repeats, "shard_raw_mb": args.shard_mb, "zstd_level": args.level,
                         "batch": BATCH, "batches": args.batches, "statistic": "median",
                         "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
                                    f"{platform.python_version()}, numpy {np.__version__}, zstandard {zstandard.__version__}"}
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    print(format_table(results))
    print(f"\nJSON: {out_path}", file=sys.stderr)
    return 0


def format_table(results: dict) -> str:
    cfg = results["config"]
    rows = [("format", "ratio", "write MB/s", "cache MB/s", "cache+sha MB/s", "zstd limit MB/s",
             "random samples/s", "memmap limit/s", "view limit/s", "random/memmap", "random/view")]
    for name, r in results["formats"].items():
        rows.append((name, f"{r['compression_ratio']:.2f}", f"{r['write_mb_s']:.0f}", f"{r['cache_mb_s']:.0f}",
                     f"{r['cache_verified_mb_s']:.0f}", f"{r['zstd_mb_s']:.0f}", f"{r['random_samples_s']:,.0f}",
                     f"{r['memmap_samples_s']:,.0f}", f"{r['mmap_view_samples_s']:,.0f}", f"{r['random_vs_memmap']:.0%}",
                     f"{r['random_vs_mmap_view']:.0%}"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [f"{cfg['tokens']:,} tokens ({cfg['samples']:,} samples of {cfg['sample_tokens']}, {cfg['distribution']}), "
             f"zstd level {cfg['zstd_level']}, ~{cfg['shard_raw_mb']:g} MB shards, median of {cfg['repeats']}; "
             f"MB = 10^6 raw token bytes; random = batches of {cfg['batch']}"]
    for i, row in enumerate(rows):
        lines.append(" | ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
