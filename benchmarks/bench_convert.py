"""Benchmark `shardkit convert --from megatron` against copying the same bytes and re-tokenizing the text.

On ../shared/corpora/mix.jsonl.zst (override with --corpus) with the r50k (GPT-2) tiktoken file:

(1) `shardkit build` of the corpus (--pack none, --workers 2): the re-tokenization a conversion saves,
    as tokens/s from its report; its output is exported with `shardkit export --to megatron`, and that
    Megatron dataset is copied --repeat times (separate prefixes) to make the source;
(2) copy: the source's .bin and .idx files copied to another directory (`shutil.copyfile`, page cache
    warm, as for the conversions), bytes/s;
(3) `shardkit convert --from megatron` (a subprocess running the CLI, --pack concat --seq-len 2048,
    arrow shards, zstd --level) with --workers 1 and 2: tokens/s and source bytes/s over its whole wall
    time, and the ratio to the copy rate (the issue's goal: >= 50%); with --compare PYTHON, the same
    conversion by another interpreter's shardkit (e.g. a virtual environment holding main's code),
    alternating with this one run by run so that both see the same machine;
(4) the physical limits on one core, over the source's .bin bytes: zstd at --level in 1 MiB pieces (an
    Arrow shard's record batches, through pyarrow's codec as the shard writer uses it), SHA-256 (shard,
    block and source hashes) and CRC-32, and a memory copy;
(5) the compression limit (issue 36: convert's goal is >= 60% of it): zstd at --level plus SHA-256 of the
    source and of the compressed bytes, 1 MiB pieces on one thread per core available (and on one thread),
    in the same run as the conversions; each conversion is stated as a fraction of it;
(6) CPU time (user + system) of each conversion and of the limit's work on one thread: on a shared machine
    the wall rates move with the load, the CPU a conversion spends per byte much less; the limit's CPU over
    a conversion's is the share of its CPU that compressing and hashing take.

Every interpreter's shardkit is compiled to bytecode first, as an installed wheel is. Every figure is the median
of --runs runs. Prints a table, writes JSON (--out).
    python benchmarks/bench_convert.py --runs 3 --repeat 2 --out bench_out/convert.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDKIT_SHARED", REPO.parent / "shared"))


def shardkit(*args: str, python: str = sys.executable) -> tuple[float, float]:
    """Run the CLI in a subprocess (of `python`); returns its wall time and CPU time (user + system, of it and
    its worker processes: what it costs the machine, whatever else is running)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    run = subprocess.run([python, "-m", "shardkit", *args], capture_output=True, text=True)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        raise RuntimeError(f"shardkit {args[0]} failed: {run.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compile_bytecode(python: str) -> None:
    """Write the bytecode of `python`'s shardkit (as installing the wheel does): a checkout run where
    PYTHONDONTWRITEBYTECODE is set compiles every shardkit module at each start (~0.1 s of a 2 s conversion),
    which no installed copy pays, and which would differ between the checkouts compared."""
    code = ("import compileall, shardkit, shardkit.tools, shardkit.loaders\n"
            "for package in (shardkit, shardkit.tools, shardkit.loaders):\n"
            "    for folder in package.__path__:\n"
            "        compileall.compile_dir(folder, quiet=1)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([python, "-c", code], check=True, env=env)


def make_source(corpus: Path, tokenizer: Path, work: Path, repeat: int) -> tuple[list[Path], dict]:
    """Build the corpus once (timed), export it to Megatron and copy that `repeat` times."""
    built = work / "built"
    seconds, _ = shardkit("build", str(corpus), "--output", str(built), "--tokenizer", str(tokenizer), "--seq-len", "2048",
                       "--pack", "none", "--workers", "2", "--no-progress")
    report = json.loads((built / "build_report.json").read_text())
    shardkit("export", str(built), "--to", "megatron", "--output", str(work / "mega" / "part0"), "--no-progress")
    prefixes = [work / "mega" / "part0"]
    for i in range(1, repeat):
        for suffix in (".bin", ".idx", ".shardkit.json"):
            shutil.copyfile(work / "mega" / f"part0{suffix}", work / "mega" / f"part{i}{suffix}")
        prefixes.append(work / "mega" / f"part{i}")
    build = {"tokens": report["packing"]["document_tokens"], "seconds": report["timing"]["seconds"],
             "process_seconds": seconds, "tokens_per_second": report["timing"]["tokens_per_second"], "workers": 2}
    return prefixes, build


def copy_rate(prefixes: list[Path], work: Path, runs: int) -> dict:
    files = [p.with_suffix(s) for p in prefixes for s in (".bin", ".idx")]
    total = sum(f.stat().st_size for f in files)
    seconds = []
    for _ in range(runs):
        target = work / "copy"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        began = time.perf_counter()
        for f in files:
            shutil.copyfile(f, target / f.name)
        seconds.append(time.perf_counter() - began)
    shutil.rmtree(work / "copy", ignore_errors=True)
    median = statistics.median(seconds)
    return {"bytes": total, "seconds": median, "bytes_per_second": total / median}


def convert(prefixes: list[Path], work: Path, workers: int, runs: int, level: int,
            pythons: dict[str, str]) -> dict[str, dict]:
    """Each interpreter's conversion, alternating run by run (this one first)."""
    walls: dict[str, list[float]] = {name: [] for name in pythons}
    cpus: dict[str, list[float]] = {name: [] for name in pythons}
    reports: dict[str, list[dict]] = {name: [] for name in pythons}
    for _ in range(runs):
        for name, python in pythons.items():
            out = work / f"converted-{name}-{workers}"
            shutil.rmtree(out, ignore_errors=True)
            wall, cpu = shardkit("convert", *map(str, prefixes), "--from", "megatron", "--output", str(out),
                                 "--seq-len", "2048", "--workers", str(workers), "--compression", f"zstd:{level}",
                                 "--no-progress", python=python)
            walls[name].append(wall)
            cpus[name].append(cpu)
            reports[name].append(json.loads((out / "build_report.json").read_text()))
            shutil.rmtree(out, ignore_errors=True)
    results = {}
    for name in pythons:
        wall = statistics.median(walls[name])
        report = reports[name][0]
        tokens = report["packing"]["document_tokens"]
        results[name] = {"workers": workers, "tokens": tokens, "process_seconds": wall, "runs": walls[name],
                         "cpu_seconds": statistics.median(cpus[name]), "cpu_runs": cpus[name],
                         "tokens_per_second": tokens / wall, "bytes_per_second": report["bytes"]["in"] / wall,
                         "report_seconds": statistics.median(r["timing"]["seconds"] for r in reports[name]),
                         "source_bytes": report["bytes"]["in"],
                         "compressed_bytes": report["totals"]["compressed_bytes"]}
    return results


def limits(prefixes: list[Path], level: int, runs: int) -> dict[str, float]:
    """Single-core rates (bytes/s of input) of the steps a conversion cannot avoid, on the source's ids."""
    import hashlib
    import zlib

    import pyarrow as pa

    data = b"".join(p.with_suffix(".bin").read_bytes() for p in prefixes[:2])
    buffer, codec, piece = pa.py_buffer(data), pa.Codec("zstd", compression_level=level), 1 << 20

    def zstd() -> None:
        for start in range(0, len(data), piece):
            codec.compress(buffer.slice(start, min(piece, len(data) - start)))

    steps = {f"zstd_level_{level}": zstd, "sha256": lambda: hashlib.sha256(data).digest(),
             "crc32": lambda: zlib.crc32(data), "memory_copy": lambda: bytearray(data)}
    rates = {}
    for name, step in steps.items():
        seconds = []
        for _ in range(runs):
            began = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - began)
        rates[name] = len(data) / statistics.median(seconds)
    compressed = sum(len(codec.compress(buffer.slice(s, min(piece, len(data) - s)))) for s in range(0, len(data), piece))
    rates["zstd_ratio"] = len(data) / compressed
    return rates


def compression_limit(prefixes: list[Path], level: int, runs: int) -> dict[str, float]:
    """The rate (source bytes/s) at which this machine can do what a conversion cannot avoid, on all its cores:
    zstd at `level` in 1 MiB pieces (pyarrow's codec, as the shard writer uses it), SHA-256 of the source bytes
    (the fingerprint's) and of the compressed bytes (the shard's); one thread per core available (what
    `--encode-threads` defaults to), and one thread for the scaling."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa

    from shardkit.process_info import available_cores

    data = pa.py_buffer(b"".join(p.with_suffix(".bin").read_bytes() for p in prefixes[:2]))
    piece = 1 << 20
    pieces = [data.slice(start, min(piece, data.size - start)) for start in range(0, data.size, piece)]

    def encode(part: pa.Buffer) -> None:
        compressed = pa.Codec("zstd", compression_level=level).compress(part)
        hashlib.sha256(part).digest()
        hashlib.sha256(compressed).digest()

    rates = {}
    for threads in sorted({1, available_cores()}):
        seconds, cpu = [], []
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(runs):
                began, began_cpu = time.perf_counter(), time.process_time()
                list(pool.map(encode, pieces))
                seconds.append(time.perf_counter() - began)
                cpu.append(time.process_time() - began_cpu)
        rates[f"threads_{threads}"] = data.size / statistics.median(seconds)
        rates[f"cpu_seconds_threads_{threads}"] = statistics.median(cpu)
    return {"cores": available_cores(), "bytes": data.size, **rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=SHARED / "corpora" / "mix.jsonl.zst")
    parser.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "r50k_base.tiktoken")
    parser.add_argument("--repeat", type=int, default=2, help="copies of the exported corpus in the source")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--level", type=int, default=3, help="zstd level of the shards (--compression-level)")
    parser.add_argument("--compare", default=None, metavar="PYTHON",
                        help="another interpreter whose shardkit converts too, alternating with this one")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pythons = {"this": sys.executable, **({"compare": args.compare} if args.compare else {})}
    for python in pythons.values():
        compile_bytecode(python)
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        work = Path(tmp)
        prefixes, build = make_source(args.corpus, args.tokenizer, work, args.repeat)
        copy = copy_rate(prefixes, work, args.runs)
        converted = {w: convert(prefixes, work, w, args.runs, args.level, pythons) for w in (1, 2)}
        results = {"build": build, "copy": copy, "limits": limits(prefixes, args.level, args.runs),
                   "compression_limit": compression_limit(prefixes, args.level, args.runs),
                   "convert": [converted[w]["this"] for w in (1, 2)],
                   "compare": [converted[w]["compare"] for w in (1, 2)] if args.compare else None}
    first = results["convert"][0]
    print(f"source: {copy['bytes'] / 1e6:.1f} MB Megatron ({len(prefixes)} x the exported corpus), "
          f"{first['tokens']:,} tokens")
    print(f"copy: {copy['bytes_per_second'] / 1e6:.0f} MB/s")
    print("one core: " + ", ".join(f"{name} {rate / 1e6:.0f} MB/s" for name, rate in results["limits"].items()
                                    if name != "zstd_ratio") + f" (zstd ratio {results['limits']['zstd_ratio']:.2f})")
    limit = results["compression_limit"]
    on_all = limit[f"threads_{limit['cores']}"]
    print(f"zstd level {args.level} + SHA-256 (source and compressed): {limit['threads_1'] / 1e6:.0f} MB/s on one "
          f"thread, {on_all / 1e6:.0f} MB/s on all {limit['cores']} cores (the compression limit)")
    # CPU per source byte is what the load changes least: the limit's work against each conversion's.
    limit_cpu = limit["cpu_seconds_threads_1"] / limit["bytes"]
    print(f"CPU: the limit's work {limit_cpu * 1e9:.2f} CPU-s per GB of source (one thread)")
    print(f"build (re-tokenize, w=2): {build['tokens_per_second'] / 1e6:.2f}M tokens/s "
          f"-> {first['tokens'] / build['tokens_per_second']:.1f} s for the source's tokens")
    for label in ("convert", "compare"):
        for c in results[label] or ():
            print(f"{label} w={c['workers']}: {c['tokens_per_second'] / 1e6:.2f}M tokens/s, "
                  f"{c['bytes_per_second'] / 1e6:.0f} MB/s ({c['bytes_per_second'] / copy['bytes_per_second']:.1%} of "
                  f"copy, {c['bytes_per_second'] / on_all:.0%} of the compression limit; "
                  f"{c['source_bytes'] / c['report_seconds'] / on_all:.0%} over the report's seconds, without the "
                  f"interpreter's start-up), {c['process_seconds']:.2f} s (runs {', '.join(f'{r:.2f}' for r in c['runs'])}), "
                  f"{c['tokens_per_second'] / build['tokens_per_second']:.1f}x the build; "
                  f"CPU {c['cpu_seconds']:.2f} s (runs {', '.join(f'{r:.2f}' for r in c['cpu_runs'])}): "
                  f"{c['cpu_seconds'] / c['source_bytes'] * 1e9:.2f} CPU-s per GB, the limit's work is "
                  f"{limit_cpu * c['source_bytes'] / c['cpu_seconds']:.0%} of it")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
