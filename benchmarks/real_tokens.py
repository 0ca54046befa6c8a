"""Real-token rows of the loader benchmark (issue 23): GPT-2 tokens of ../shared with document boundaries.

    python benchmarks/bench_loader.py --real [--baseline REF] [--runs 3] [--workers 0 2] [--cold] \
        [--cache-modes decoded compressed none] [--peers]

Data: every second document of `../shared/corpora/mix.jsonl.zst` (or $SHARDKIT_SHARED/corpora), built once with
`shardkit build --tokenizer gpt2_hf_tokenizer.json --seq-len 1024 --format tar` under --data-dir: about 10k
samples of 1,025 uint16 tokens, every shard with document boundaries. A flat memmap copy of the same samples
gives the limit: numpy random gathers of batch rows, the same shape, in the same run.

Each shardkit figure comes from a child process (`--measure`) that makes `--epochs` warm epochs with batch 8,
shuffle on: samples/s (median over the epochs after the first), epoch start (`iter()` to first batch, median)
and CPU microseconds per sample (process time of the main process / samples; with workers the workers' time
is not in it). With `--baseline REF` the same child runs from an install of commit REF (a `git archive`
extract with its own virtual environment under --data-dir) and the two alternate run by run (A/B in one run);
`--after REF` measures another commit the same way instead of the working tree.

With `--cold` each child also makes one pass from a fresh cache directory (dataset construction included,
after an untimed first batch from another fresh cache, so that the process's first imports are not in it):
time to its first batch, samples/s over the pass and CPU us per sample; `--cache-modes` repeats the warm and
cold rows for each `cache_mode` (warm "none" streams every epoch from storage again). `--peers` adds a cold
pass of LitData on the same samples in the same run (`benchmarks/peers.py`: chunks of ~64 MiB written once,
a fresh cache per run, batch 8, shuffle on, 0 workers, every pass checked for exactness).
"""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SEQ = 1024


def shared_dir() -> Path:
    for path in (os.environ.get("SHARDKIT_SHARED"), REPO.parent / "shared"):
        if path and (Path(path) / "corpora").exists():
            return Path(path)
    raise SystemExit("../shared (or $SHARDKIT_SHARED) with corpora/ and tokenizers/ is absent: the real-token "
                     "rows need it")


def build_real(data_dir: Path, shard_format: str = "tar") -> tuple[str, Path, int]:
    """The dataset's URL, its flat memmap copy and its sample count (built once per shard format; the samples
    and so the flat copy are the same in every format)."""
    import zstandard

    from shardkit.formats import ShardReader
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    shared = shared_dir()
    url, flat = data_dir / f"mix-half-{SEQ}-{shard_format}", data_dir / f"mix-half-{SEQ}.u16"
    data_dir.mkdir(parents=True, exist_ok=True)
    if not (url / "shardkit.json").exists():
        corpus = data_dir / "mix-half.jsonl"
        with open(shared / "corpora" / "mix.jsonl.zst", "rb") as raw, open(corpus, "w") as out:
            text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
            for index, line in enumerate(text):
                if index % 2 == 1:
                    out.write(line)
        subprocess.run([sys.executable, "-m", "shardkit", "build", str(corpus), "--output", str(url), "--tokenizer",
                        str(shared / "tokenizers" / "gpt2_hf_tokenizer.json"), "--seq-len", str(SEQ), "--format",
                        shard_format, "--workers", "2", "--no-progress"], check=True)
    storage = Storage(str(url))
    manifest = load_manifest(storage)
    if not flat.exists():
        with open(flat, "wb") as out:
            for shard in manifest.shards:
                reader = ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard, manifest=manifest)
                out.write(np.asarray(reader.arrays.tokens, dtype=np.uint16).tobytes())
    return str(url), flat, manifest.num_samples


def memmap_limit(flat: Path, samples: int, batch: int, runs: int) -> float:
    """Samples/s of numpy random gathers of `batch` rows from a memmap of the same shape."""
    data = np.memmap(flat, dtype=np.uint16, mode="r", shape=(samples, SEQ + 1)).view(np.ndarray)
    rates = []
    for _ in range(runs):
        order = np.random.default_rng().permutation(samples)
        start = time.perf_counter()
        for i in range(0, samples - batch + 1, batch):
            np.take(data, np.sort(order[i:i + batch]), axis=0)
        rates.append((samples // batch) * batch / (time.perf_counter() - start))
    return statistics.median(rates)


def measure_child(url: str, cache: str, batch: int, workers: int, epochs: int, cache_mode: str = "decoded",
                  cold: bool = False) -> dict:
    """Warm epochs of StreamingDataLoader (in this interpreter's shardkit); `cold`: one pass from a fresh cache
    directory under `cache` instead."""
    import tempfile

    from shardkit import StreamingDataLoader, StreamingDataset

    def make_loader(cache_dir: str) -> StreamingDataLoader:
        options = {"cache_mode": cache_mode} if cache_mode != "decoded" else {}  # a baseline may predate the option
        return StreamingDataLoader(StreamingDataset(url, cache_dir=cache_dir, rank=0, world_size=1, **options),
                                   batch_size=batch, num_workers=workers, persistent_workers=workers > 0)

    if cold:
        import shutil

        def drain(loader: StreamingDataLoader) -> None:  # background completions, before the directory goes
            for stream_cache in loader.dataset.caches:
                getattr(stream_cache, "drain", lambda: None)()

        Path(cache).mkdir(parents=True, exist_ok=True)
        # Untimed: one first batch from another fresh cache, so that the timed one does not include this
        # process's first imports of the read path (a peer measured in a running process has them too).
        warmup = tempfile.mkdtemp(prefix="cold-warmup-", dir=cache)
        loader = make_loader(warmup)
        next(iter(loader))
        drain(loader)
        shutil.rmtree(warmup, ignore_errors=True)
        fresh = tempfile.mkdtemp(prefix="cold-", dir=cache)
        wall, proc = time.perf_counter(), time.process_time()
        loader = make_loader(fresh)
        iterator = iter(loader)
        first = next(iterator)
        first_s = time.perf_counter() - wall
        got = len(first["tokens"]) + sum(len(b["tokens"]) for b in iterator)
        end = time.perf_counter()
        drain(loader)
        shutil.rmtree(fresh, ignore_errors=True)
        return {"samples_per_s": got / (end - wall), "first_batch_s": first_s, "samples": got,
                "cpu_us_per_sample": (time.process_time() - proc) / got * 1e6, "keys": sorted(first)}
    loader = make_loader(cache)
    for _ in loader:  # fills the cache (not timed)
        pass
    rates, starts, cpu = [], [], []
    for _ in range(epochs):
        wall, proc = time.perf_counter(), time.process_time()
        iterator = iter(loader)
        first = next(iterator)
        started = time.perf_counter()
        got = len(first["tokens"])
        for b in iterator:
            got += len(b["tokens"])
        end = time.perf_counter()
        rates.append((got - len(first["tokens"])) / (end - started))
        starts.append(started - wall)
        cpu.append((time.process_time() - proc) / got * 1e6)
    keys = sorted(first)
    return {"samples_per_s": statistics.median(rates), "epoch_start_s": statistics.median(starts),
            "cpu_us_per_sample": statistics.median(cpu), "keys": keys}


def baseline_python(ref: str, data_dir: Path) -> str:
    """An interpreter with commit `ref` of this repository installed (built once under `data_dir`)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], check=True, capture_output=True,
                            text=True).stdout.strip()
    root = data_dir / f"baseline-{commit}"
    python = root / "venv" / "bin" / "python"
    if not python.exists():
        src = root / "src"
        src.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src)],
                       check=True)
    return str(python)


def real_benchmark(args) -> dict:
    data_dir = Path(args.data_dir).resolve()
    url, flat, samples = build_real(data_dir / "real", args.real_format)
    batch = args.batch
    # --after REF measures a commit too (an install of its own), so editing the working tree meanwhile is safe.
    sides = {f"after ({args.after})" if args.after else "after": baseline_python(args.after, data_dir) if args.after
             else sys.executable}
    if args.baseline:
        sides = {f"before ({args.baseline})": baseline_python(args.baseline, data_dir), **sides}
    rows: dict[str, list[dict]] = {}
    limits = []
    peer_data = {}
    if args.peers:
        import peers

        peer_data = peers.build_peers(data_dir / "real", flat, samples, SEQ + 1, 64 * 2**20)
        peer_data = {label: row for label, row in peer_data.items() if label.startswith("LitData")}
    kinds = ("warm", "cold") if args.cold else ("warm",)
    for run in range(args.runs):
        limits.append(memmap_limit(flat, samples, batch, 1))  # in every run: the machine is shared
        for kind in kinds:
            for mode in args.cache_modes:
                for workers in args.workers:
                    for side, python in sides.items():  # alternating: before, after, before, after, ...
                        cache = str(data_dir / "real" / f"cache-{side.split()[0]}-{args.real_format}-{mode}")
                        out = subprocess.run([python, __file__, "--measure", url, cache, str(batch), str(workers),
                                              str(args.epochs), mode, kind], check=True, capture_output=True,
                                             text=True, cwd="/").stdout  # cwd: the child imports the installed shardkit
                        name = f"{side}, {kind}, cache_mode={mode}, workers={workers}"
                        rows.setdefault(name, []).append(json.loads(out.strip().splitlines()[-1]))
        if peer_data:
            for label, row in peers.measure_peers(peer_data, "local", samples, batch, 1).items():
                rows.setdefault(f"peer: {label}, cold, workers=0", []).append(row)
        print(f"  run {run + 1}/{args.runs} done", flush=True)
    limit = statistics.median(limits)
    fields = ("samples_per_s", "epoch_start_s", "first_batch_s", "cpu_us_per_sample")
    table = {name: {k: statistics.median(r[k] for r in runs) for k in fields if k in runs[0]}
             | {"runs": [round(r["samples_per_s"]) for r in runs], "keys": runs[0].get("keys", [])}
             | ({"exact": all(r["exact"] for r in runs)} if "exact" in runs[0] else {})
             for name, runs in rows.items() if "goal" not in runs[0]}
    return {"data": {"url": url, "samples": samples, "tokens_per_sample": SEQ + 1, "batch": batch,
                     "format": args.real_format},
            "memmap_gather_limit": limit, "rows": table}


def print_real(result: dict) -> None:
    limit = result["memmap_gather_limit"]
    print(f"\nreal tokens: {result['data']['samples']:,} samples of {SEQ + 1} GPT-2 tokens, "
          f"{result['data'].get('format', 'tar')} shards, batch {result['data']['batch']}")
    print(f"{'loader':<62} {'samples/s':>10} {'of limit':>9} {'epoch start ms':>15} {'first batch ms':>15} "
          f"{'CPU us/sample':>14}")
    print(f"{'limit: numpy memmap gathers':<62} {limit:>10,.0f} {'100%':>9}")
    for name, row in result["rows"].items():
        start = f"{row['epoch_start_s'] * 1e3:>15.1f}" if "epoch_start_s" in row else f"{'':>15}"
        first = f"{row['first_batch_s'] * 1e3:>15.1f}" if "first_batch_s" in row else f"{'':>15}"
        cpu = f"{row['cpu_us_per_sample']:>14.1f}" if "cpu_us_per_sample" in row else f"{'':>14}"
        extra = f"   keys {','.join(row['keys'])}" if row["keys"] else f"   exact {row.get('exact')}"
        print(f"{name:<62} {row['samples_per_s']:>10,.0f} {row['samples_per_s'] / limit:>9.0%} {start} {first} "
              f"{cpu}{extra}")


if __name__ == "__main__" and sys.argv[1:2] == ["--measure"]:
    _url, _cache, _batch, _workers, _epochs = sys.argv[2:7]
    _mode, _kind = (sys.argv[7:9] + ["decoded", "warm"][len(sys.argv[7:9]):])
    print(json.dumps(measure_child(_url, _cache, int(_batch), int(_workers), int(_epochs), _mode, _kind == "cold")))
