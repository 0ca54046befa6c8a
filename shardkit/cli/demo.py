"""`shardkit demo`: the whole path, build -> stream -> train -> plot, on a corpus every machine has.

The corpus is the Python standard library's own source files (found through `sysconfig`, so nothing
is downloaded): one JSONL document per file, one file in 20 held out for evaluation. It is tokenized
with the dependency-free byte-level tokenizer, packed into Arrow shards, and a `tiny` model trains on it
for a few hundred CPU steps. The demo runs the same `shardkit` commands a user would type and prints
each one, so it doubles as a worked example.
"""

from __future__ import annotations

import json
import math
import shlex
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.options import Namespace, add_command, given_values, option

HOLD_OUT_EVERY = 20


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    out: str = option("runs/demo", "output directory", metavar="DIR")
    steps: int = option(300, "training steps", metavar="N")
    corpus_mb: float = option(8.0, "how much of the standard library to use, in MB of source", metavar="MB")
    seq_len: int = option(128, "training context length", metavar="N")
    workers: int | None = option(None, "build worker processes", metavar="N", cli_default="all cores")


def register(subparsers: Any) -> None:
    add_command(subparsers, "demo", run, options=[DemoOptions],
                help="build the Python standard library's sources into shards and train a tiny model on them (CPU)",
                description="End-to-end demo on an embedded corpus (this Python's standard library sources; no "
                            "download): writes JSONL, runs 'shardkit build', 'shardkit train' and 'shardkit plot', "
                            "and prints where the loss plot is. Takes a few minutes on a laptop CPU.",
                epilog="Example: shardkit demo --out runs/demo --steps 300")


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, in a stable order (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def write_corpus(out: Path, max_bytes: int) -> tuple[Path, Path, int]:
    """Write train.jsonl / val.jsonl from the stdlib sources; returns their paths and the file count."""
    out.mkdir(parents=True, exist_ok=True)
    train_path, val_path = out / "train.jsonl", out / "val.jsonl"
    total = files = 0
    root = Path(sysconfig.get_paths()["stdlib"])
    with open(train_path, "w", encoding="utf-8") as train, open(val_path, "w", encoding="utf-8") as val:
        for path in stdlib_sources():
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a few test fixtures are deliberately not UTF-8; they are simply not part of the corpus
            if not text.strip():
                continue
            target = val if files % HOLD_OUT_EVERY == 0 else train
            target.write(json.dumps({"source": str(path.relative_to(root)), "text": text}) + "\n")
            files += 1
            total += len(text.encode())
            if total >= max_bytes:
                break
    if files < 2:
        raise SystemExit(f"shardkit demo: found only {files} readable standard-library source files under {root}")
    return train_path, val_path, files


def unigram_entropy_nats(path: Path) -> float:
    """Entropy of the corpus's byte distribution: the loss of the best model that ignores context."""
    import numpy as np

    counts = np.zeros(256, dtype=np.int64)
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            data = np.frombuffer(json.loads(line)["text"].encode(), dtype=np.uint8)
            counts += np.bincount(data, minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _shardkit(argv: list[str]) -> None:
    from shardkit.cli import main

    print(f"\n$ shardkit {shlex.join(argv)}", flush=True)
    code = main(argv)
    if code:
        raise SystemExit(f"shardkit demo: 'shardkit {argv[0]}' failed with exit code {code}")


def _last_eval_loss(run_dir: Path) -> float | None:
    loss = None
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if "eval_loss" in record:
                loss = record["eval_loss"]
    return loss


def run(namespace: Namespace) -> int:
    args = DemoOptions(**given_values(namespace, DemoOptions))
    out = Path(args.out).resolve()
    print(f"shardkit demo: corpus = this Python's standard library sources ({sysconfig.get_paths()['stdlib']})")
    train_jsonl, val_jsonl, files = write_corpus(out / "corpus", int(args.corpus_mb * 2**20))
    print(f"wrote {files} documents to {train_jsonl} and {val_jsonl}")
    common = ["--tokenizer", "byte", "--seq-len", str(args.seq_len), "--format", "arrow", "--pack", "concat",
              "--shard-size", "4MB", "--overwrite", "--no-progress"]
    if args.workers:
        common += ["--workers", str(args.workers)]
    _shardkit(["build", str(train_jsonl), "--output", str(out / "data" / "train"), *common])
    _shardkit(["build", str(val_jsonl), "--output", str(out / "data" / "val"), *common])
    _shardkit(["inspect", str(out / "data" / "train")])
    run_dir = out / "run"
    _shardkit(["train", "--data", str(out / "data" / "train"), "--eval-data", str(out / "data" / "val"),
               "--preset", "tiny", "--steps", str(args.steps), "--batch-size", "16", "--lr", "3e-3",
               "--warmup-steps", str(max(1, args.steps // 20)), "--eval-every", str(max(1, args.steps // 6)),
               "--run-dir", str(run_dir), "--resume", "none", "--log-every", str(max(1, args.steps // 15))])
    _shardkit(["plot", str(run_dir)])
    entropy = unigram_entropy_nats(val_jsonl)
    eval_loss = _last_eval_loss(run_dir)
    print("\nshardkit demo: done.")
    if eval_loss is not None:
        print(f"  held-out loss {eval_loss:.3f} nats/byte vs unigram entropy {entropy:.3f} nats/byte "
              f"({eval_loss / math.log(2):.2f} vs {entropy / math.log(2):.2f} bits/byte)")
    print(f"  loss plot: {run_dir / 'curves.png'}")
    return 0
