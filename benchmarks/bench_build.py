"""Benchmark `shardkit build` against the bare tokenizer, and shard writing against raw Megatron .bin.

On ../shared/corpora/mix.jsonl.zst (override with --corpus) with the r50k (GPT-2) and cl100k tiktoken files:

(a) bare tokenizer: tokens/s of one thread in one process over the same documents (already decoded
    and in memory), with `encode_ordinary` (Python lists) and `encode_to_numpy` (the path the build uses);
(b) `shardkit build` (a subprocess running the CLI) with --workers 1 and 2: tokens/s as the build
    reports it (its whole wall time: worker start-up, reading, tokenizing, packing, compressing,
    writing) and the peak RSS of the build's whole process tree; then peak RSS on half the corpus
    versus all of it, to show memory does not grow with corpus size (--shard-size 16MB, so that
    both corpora fill several shards: a shard's samples are the largest buffer the build holds);
(c) writing the same packed samples: shardkit tar and arrow shards (encode + write) versus a
    Megatron-style raw .bin/.idx (uncompressed tokens + sizes), and Mosaic MDS / LitData when
    installed (they are not installed here, and pip-installing them would pull torch).

Every figure is the median of --runs runs. Prints a table, writes JSON (--out).
    python benchmarks/bench_build.py --runs 3 --out bench_out/build.json
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDKIT_SHARED", REPO.parent / "shared"))


def read_documents(path: Path, limit: int | None = None) -> list[str]:
    import zstandard

    docs = []
    with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
        for line in io.TextIOWrapper(reader, encoding="utf-8"):
            docs.append(json.loads(line)["text"])
            if limit and len(docs) >= limit:
                break
    return docs


def bare_tokenizer(tokenizer_path: Path, docs: list[str], runs: int) -> dict:
    from shardkit.text.tokenizers import load_tokenizer

    encoding = load_tokenizer(str(tokenizer_path)).encoding
    results = {}
    for label, encode in (("encode_ordinary", encoding.encode_ordinary),
                          ("encode_to_numpy", lambda t: encoding.encode_to_numpy(t, disallowed_special=()))):
        rates, cpu_rates, tokens = [], [], 0
        for _ in range(runs):
            began, cpu = time.perf_counter(), time.process_time()
            tokens = sum(len(encode(t)) for t in docs)
            rates.append(tokens / (time.perf_counter() - began))
            cpu_rates.append(tokens / (time.process_time() - cpu))
        results[label] = {"tokens": tokens, "tokens_per_second": statistics.median(rates),
                          "tokens_per_cpu_second": statistics.median(cpu_rates), "runs": rates}
    return results


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (Linux /proc; psutil is not a dependency)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {pid}, [pid]
    while frontier:
        current = frontier.pop()
        for child, parent in parents.items():
            if parent == current and child not in tree:
                tree.add(child)
                frontier.append(child)
    total = 0
    for member in tree:
        try:
            with open(f"/proc/{member}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def run_build(corpus: Path, tokenizer: Path, workers: int, out: Path, seq_len: int, shard_format: str,
              shard_size: str = "16MB") -> dict:
    """One `shardkit build` in a subprocess; returns its report timing and the peak RSS of its process tree."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "shardkit", "build", str(corpus), "--output", str(out), "--tokenizer", str(tokenizer),
           "--seq-len", str(seq_len), "--workers", str(workers), "--format", shard_format, "--no-progress",
           "--shard-size", shard_size]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def poll() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], _tree_rss(process.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    watcher.start()
    began = time.perf_counter()
    _, stderr = process.communicate()
    wall = time.perf_counter() - began
    watcher.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the build and its reaped workers
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if process.returncode != 0:
        raise RuntimeError(f"build failed ({process.returncode}): {stderr[-2000:]}")
    report = json.loads((out / "build_report.json").read_text())
    return {"tokens": report["packing"]["document_tokens"], "tokens_per_second": report["timing"]["tokens_per_second"],
            "build_seconds": report["timing"]["seconds"], "process_seconds": wall, "cpu_seconds": cpu,
            "tokens_per_cpu_second": report["packing"]["document_tokens"] / cpu, "peak_rss_bytes": peak[0],
            "shards": report["totals"]["shards"], "compressed_bytes": report["totals"]["compressed_bytes"],
            "padding_fraction": report["packing"]["padding_fraction"]}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def write_comparison(dataset: Path, work: Path, runs: int) -> dict:
    """Time writing the dataset's packed samples as shardkit tar/arrow shards and as a raw Megatron .bin/.idx."""
    from shardkit.formats import ShardReader, ShardWriter
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    manifest = load_manifest(str(dataset))
    storage = Storage(str(dataset))
    samples = []
    for shard in manifest.shards:
        reader = ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard, manifest=manifest)
        samples += [reader.sample(i) for i in range(len(reader))]
    tokens = sum(len(s.tokens) for s in samples)
    results = {"samples": len(samples), "tokens": tokens}

    def timed(fn) -> dict:
        seconds = []
        for _ in range(runs):
            target = work / "write"
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            began = time.perf_counter()
            written = fn(target)
            seconds.append(time.perf_counter() - began)
        return {"seconds": statistics.median(seconds), "tokens_per_second": tokens / statistics.median(seconds),
                "bytes": written}

    def shardkit_writer(shard_format: str):
        def write(target: Path) -> int:
            with ShardWriter(str(target), shard_format=shard_format, token_dtype=manifest.token_dtype,
                             max_bytes=64 * 10**6) as writer:
                for sample in samples:
                    writer.write(sample)
            return sum(s.compressed_bytes for s in writer.shards)
        return write

    def megatron(target: Path) -> int:
        # Megatron-LM's MMapIndexedDataset layout: .bin = all tokens back to back; .idx = header,
        # sizes (int32), pointers (int64), document indices (int64).
        dtype = np.dtype(manifest.token_dtype)
        sizes = np.fromiter((len(s.tokens) for s in samples), dtype=np.int32, count=len(samples))
        with open(target / "data.bin", "wb") as fh:
            for sample in samples:
                fh.write(np.asarray(sample.tokens, dtype=dtype).tobytes())
        pointers = np.zeros(len(samples), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
        with open(target / "data.idx", "wb") as fh:
            fh.write(b"MMIDIDX\x00\x00")
            fh.write(np.array([1], dtype=np.int64).tobytes())
            fh.write(np.array([{2: 8, 4: 4}[dtype.itemsize]], dtype=np.uint8).tobytes())
            fh.write(np.array([len(samples), len(samples) + 1], dtype=np.int64).tobytes())
            fh.write(sizes.tobytes())
            fh.write(pointers.tobytes())
            fh.write(np.arange(len(samples) + 1, dtype=np.int64).tobytes())
        return (target / "data.bin").stat().st_size + (target / "data.idx").stat().st_size

    results["shardkit_tar"] = timed(shardkit_writer("tar"))
    results["shardkit_arrow"] = timed(shardkit_writer("arrow"))
    results["megatron_bin"] = timed(megatron)
    for name, module in (("mosaic_mds", "streaming"), ("litdata", "litdata")):
        results[name] = "installed but not measured" if importlib.util.find_spec(module) else "not installed"
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=SHARED / "corpora" / "mix.jsonl.zst")
    parser.add_argument("--tokenizers", nargs="+", default=["r50k_base", "cl100k_base"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--format", default="arrow", choices=("tar", "arrow"))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "build.json")
    parser.add_argument("--skip-write", action="store_true", help="skip part (c)")
    args = parser.parse_args(argv)
    if not args.corpus.exists():
        print(f"{args.corpus} is absent: this benchmark needs the shared corpora (set SHARDKIT_SHARED)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench_build_"))
    results: dict = {"corpus": str(args.corpus), "runs": args.runs, "seq_len": args.seq_len, "format": args.format,
                     "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "note": "shared machine: other jobs ran at the same time"},
                     "tokenizers": {}}
    try:
        docs = read_documents(args.corpus)
        half = work / "half.jsonl.zst"
        _write_half(args.corpus, half)
        for name in args.tokenizers:
            tokenizer = SHARED / "tokenizers" / f"{name}.tiktoken"
            entry: dict = {"bare": bare_tokenizer(tokenizer, docs, args.runs), "build": {}}
            for workers in args.workers:
                runs = [run_build(args.corpus, tokenizer, workers, work / "ds", args.seq_len, args.format)
                        for _ in range(args.runs)]
                entry["build"][str(workers)] = {
                    "tokens": runs[0]["tokens"], "tokens_per_second": median_of(runs, "tokens_per_second"),
                    "tokens_per_cpu_second": median_of(runs, "tokens_per_cpu_second"),
                    "peak_rss_bytes": median_of(runs, "peak_rss_bytes"), "runs": runs}
                print(f"{name} workers={workers}: {entry['build'][str(workers)]['tokens_per_second'] / 1e6:.2f}M tok/s",
                      file=sys.stderr)
            if name == args.tokenizers[0]:
                top = max(args.workers)
                halves = [run_build(half, tokenizer, top, work / "half", args.seq_len, args.format)
                          for _ in range(args.runs)]
                entry["rss_half_corpus"] = {"workers": top, "peak_rss_bytes": median_of(halves, "peak_rss_bytes"),
                                            "tokens": halves[0]["tokens"]}
                if not args.skip_write:
                    run_build(args.corpus, tokenizer, top, work / "ds", args.seq_len, args.format)
                    results["write_comparison"] = write_comparison(work / "ds", work, args.runs)
            results["tokenizers"][name] = entry
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


def _write_half(corpus: Path, target: Path) -> None:
    import zstandard

    with open(corpus, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
        data = reader.read()
    lines = data.split(b"\n")
    target.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines[: len(lines) // 2]) + b"\n"))


def table(results: dict) -> str:
    rows = ["| tokenizer | bare encode_ordinary | bare encode_to_numpy | build w=1 | w=1 / bare | build w=2 | "
            "w=2 / w=1 | build tokens per CPU-s (w=1) / bare per CPU-s | peak RSS w=1 | peak RSS w=2 |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in results["tokenizers"].items():
        bare = entry["bare"]
        ceiling = max(b["tokens_per_second"] for b in bare.values())
        w1, w2 = entry["build"].get("1"), entry["build"].get("2")
        rows.append("| " + " | ".join([
            name, f"{bare['encode_ordinary']['tokens_per_second'] / 1e6:.2f}M",
            f"{bare['encode_to_numpy']['tokens_per_second'] / 1e6:.2f}M",
            f"{w1['tokens_per_second'] / 1e6:.2f}M" if w1 else "-",
            f"{w1['tokens_per_second'] / ceiling:.0%}" if w1 else "-",
            f"{w2['tokens_per_second'] / 1e6:.2f}M" if w2 else "-",
            f"{w2['tokens_per_second'] / w1['tokens_per_second']:.2f}x" if w1 and w2 else "-",
            (f"{w1['tokens_per_cpu_second'] / 1e6:.2f}M / {bare['encode_to_numpy']['tokens_per_cpu_second'] / 1e6:.2f}M"
             if w1 else "-"),
            f"{w1['peak_rss_bytes'] / 2**20:.0f} MiB" if w1 else "-",
            f"{w2['peak_rss_bytes'] / 2**20:.0f} MiB" if w2 else "-"]) + " |")
        if "rss_half_corpus" in entry:
            half = entry["rss_half_corpus"]
            full = entry["build"][str(half["workers"])]
            rows.append(f"\npeak RSS ({name}, workers={half['workers']}): half corpus {half['peak_rss_bytes'] / 2**20:.0f} MiB"
                        f" ({half['tokens']:,} tokens) vs full corpus {full['peak_rss_bytes'] / 2**20:.0f} MiB"
                        f" ({full['tokens']:,} tokens)")
    if "write_comparison" in results:
        w = results["write_comparison"]
        rows.append(f"\nwriting the same {w['samples']:,} packed samples ({w['tokens']:,} tokens):")
        rows.append("| writer | seconds | tokens/s | bytes |")
        rows.append("|---|---|---|---|")
        for key in ("shardkit_tar", "shardkit_arrow", "megatron_bin"):
            r = w[key]
            rows.append(f"| {key} | {r['seconds']:.2f} | {r['tokens_per_second'] / 1e6:.1f}M | {r['bytes']:,} |")
        rows.append(f"| mosaic_mds | {w['mosaic_mds']} | | |")
        rows.append(f"| litdata | {w['litdata']} | | |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
