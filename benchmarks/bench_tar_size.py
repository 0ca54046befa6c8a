"""Tar shard size and cold read rate, per-sample layout against group layout, Arrow as the yardstick (issue 36 item 4).

    SHARDKIT_SHARED=/work/shared python benchmarks/bench_tar_size.py [--mb 8] [--runs 3]

Data: the first `--mb` MB of `corpora/mix.jsonl.zst` (under ../shared or $SHARDKIT_SHARED), built once by
`shardkit build` into Arrow shards (GPT-2 tokenizer, seq-len 1024, concat packing, document boundaries). The
tar datasets are written from those shards' decoded samples, so all three hold the same samples, shard for
shard: "tar (old)" with the per-sample layout (`tar_layout="samples"`), "tar (new)" with the group layout.

Printed: each dataset's bytes, its ratio to Arrow's and its compression ratio (token bytes over shard
bytes; the shards also hold document segments); the time to decode every shard from memory; then the cold read rate and time to the first batch of each: one pass of `StreamingDataLoader` (batch 8, shuffle
on, 0 workers) from a fresh cache directory, dataset construction included, after an untimed first batch
(imports). Runs alternate old, new (and Arrow) so that load on the machine falls on all alike; medians of
`--runs`, ratios within this run.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEQ = 1024


def build_arrow(data_dir: Path, megabytes: float) -> str:
    import zstandard

    from real_tokens import shared_dir
    from shardkit.tools.build import BuildConfig, run_build

    shared = shared_dir()
    url = data_dir / "arrow"
    corpus = data_dir / "slice.jsonl"
    with open(shared / "corpora" / "mix.jsonl.zst", "rb") as raw, open(corpus, "w", encoding="utf-8") as out:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        written = 0
        for line in text:
            if written >= megabytes * 1e6:
                break
            out.write(line)
            written += len(line)
    run_build(BuildConfig(inputs=(str(corpus),), output=str(url), tokenizer=str(shared / "tokenizers" / "gpt2_hf_tokenizer.json"),
                          seq_len=SEQ, shard_format="arrow", progress=False, workers=1))
    return str(url)


def write_tar(arrow_url: str, url: str, tar_layout: str) -> None:
    """The Arrow dataset's samples as tar shards, shard for shard."""
    from shardkit.formats import ShardReader, ShardWriter
    from shardkit.manifest import load_manifest, write_manifest
    from shardkit.storage import Storage

    manifest, storage = load_manifest(arrow_url), Storage(arrow_url)
    with ShardWriter(url, shard_format="tar", token_dtype=manifest.token_dtype, max_bytes=None,
                     tar_layout=tar_layout) as writer:
        for shard in manifest.shards:
            writer.write_arrays(ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard,
                                                       manifest=manifest).arrays)
            writer.flush()
    write_manifest(writer.storage, replace(manifest, shard_format="tar", shards=tuple(writer.shards), format_version=None))


def sizes(url: str) -> tuple[int, int]:
    """(shard bytes, token bytes)."""
    from shardkit.manifest import load_manifest

    manifest = load_manifest(url)
    stored = sum(s.compressed_bytes for s in manifest.shards)
    itemsize = 2 if manifest.token_dtype == "uint16" else 4
    return stored, manifest.num_tokens * itemsize


def decode_seconds(url: str) -> float:
    """Seconds to decode every shard of the dataset from bytes in memory (what `decode_shard` costs)."""
    from shardkit.formats import decode_shard
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    manifest, storage = load_manifest(url), Storage(url)
    shards = [(shard, storage.read_bytes(shard.name)) for shard in manifest.shards]
    start = time.perf_counter()
    for shard, data in shards:
        decode_shard(data, shard_format=manifest.shard_format, token_dtype=manifest.token_dtype, shard=shard.name,
                     raw_bytes=shard.raw_bytes)
    return time.perf_counter() - start


def cold_pass(url: str, scratch: Path) -> tuple[float, float]:
    """(samples/s, seconds to the first batch) of one pass from a fresh cache directory, 0 workers (dataset
    construction included in both)."""
    from shardkit import StreamingDataLoader, StreamingDataset

    cache = tempfile.mkdtemp(prefix="cold-", dir=scratch)
    start = time.perf_counter()
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=cache, rank=0, world_size=1), batch_size=8,
                                 num_workers=0)
    batches = iter(loader)
    got = len(next(batches)["tokens"])
    first = time.perf_counter() - start
    got += sum(len(batch["tokens"]) for batch in batches)
    rate = got / (time.perf_counter() - start)
    for stream_cache in loader.dataset.caches:  # background completions end before their directory goes
        getattr(stream_cache, "drain", lambda: None)()
    shutil.rmtree(cache, ignore_errors=True)
    return rate, first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8, help="MB of mix.jsonl text to tokenize (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="cold passes per dataset; medians are reported")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    scratch = Path(args.workdir or tempfile.mkdtemp(prefix="bench-tar-size-"))
    scratch.mkdir(parents=True, exist_ok=True)
    urls = {"arrow": build_arrow(scratch, args.mb)}
    for name, layout in (("tar (old)", "samples"), ("tar (new)", "blocks")):
        urls[name] = str(scratch / layout)
        write_tar(urls["arrow"], urls[name], layout)

    arrow_bytes, raw = sizes(urls["arrow"])
    print(f"{raw / 2 / 1e6:.2f}M uint16 tokens with document boundaries, seq-len {SEQ}, from {args.mb:g} MB of mix.jsonl")
    print(f"{'dataset':<10} {'bytes':>12} {'vs arrow':>9} {'tokens/bytes':>13}")
    for name, url in urls.items():
        stored, _ = sizes(url)
        print(f"{name:<10} {stored:>12,} {stored / arrow_bytes:>8.2f}x {raw / stored:>12.2f}x")

    decode = {name: statistics.median(decode_seconds(url) for _ in range(args.runs)) for name, url in urls.items()}
    print(f"decode every shard from memory, median of {args.runs}: " + ", ".join(
        f"{name} {seconds * 1e3:.0f} ms ({sizes(urls[name])[1] / 1e6 / seconds:.0f} MB/s of tokens)"
        for name, seconds in decode.items()))

    from shardkit import StreamingDataLoader, StreamingDataset

    warm = tempfile.mkdtemp(prefix="imports-", dir=scratch)  # untimed: the read path's first imports
    next(iter(StreamingDataLoader(StreamingDataset(urls["tar (new)"], cache_dir=warm, rank=0, world_size=1),
                                  batch_size=8)))
    passes: dict[str, list[tuple[float, float]]] = {name: [] for name in urls}
    for _ in range(args.runs):
        for name in ("tar (old)", "tar (new)", "arrow"):
            passes[name].append(cold_pass(urls[name], scratch))
    print(f"cold pass, 0 workers, batch 8, median of {args.runs} (runs in order):")
    old = statistics.median(rate for rate, _ in passes["tar (old)"])
    for name in ("tar (old)", "tar (new)", "arrow"):
        rates, firsts = [rate for rate, _ in passes[name]], [first for _, first in passes[name]]
        median = statistics.median(rates)
        print(f"  {name:<10} {median:>9,.0f} samples/s ({' / '.join(f'{v:,.0f}' for v in rates)}), "
              f"{median / old:.2f}x tar (old); first batch {statistics.median(firsts) * 1e3:.1f} ms "
              f"({' / '.join(f'{v * 1e3:.1f}' for v in firsts)})")
    if args.workdir is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
