"""Peak memory of tokenizing one long document: whole (as before) vs in bounded pieces (`safe_pieces`).

Each measurement runs in a fresh process (peak RSS only grows): it loads the tokenizer, builds a
~10 MB document from real prose, notes its peak RSS, encodes the document, and reports the growth of
the peak. Prints a table and writes JSON (medians of --runs runs).

    python benchmarks/bench_long_document.py [--mb 10] [--runs 3] [--json benchmarks/long_document.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SHARED = Path(os.environ.get("SHARDKIT_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
TOKENIZERS = {"gpt2 (HF json)": "tokenizers/gpt2_hf_tokenizer.json", "cl100k (tiktoken)": "tokenizers/cl100k_base.tiktoken"}

CHILD = r"""
import io, json, resource, sys, time
import numpy as np, zstandard
from shardkit.text.tokenizers import load_tokenizer
spec, corpus, megabytes, mode = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
tokenizer = load_tokenizer(spec)
tokenizer.encode("warm up")
parts, size = [], 0
with open(corpus, "rb") as fh:
    for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(fh), encoding="utf-8"):
        text = json.loads(line)["text"]
        parts.append(text)
        size += len(text)
        if size >= megabytes * 1e6:
            break
document = "\n\n".join(parts)[: int(megabytes * 1e6)]
del parts
if mode == "whole":
    tokenizer.piece_chars = len(document) + 1
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.perf_counter()
ids = tokenizer.encode(document)
seconds = time.perf_counter() - began
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"chars": len(document), "tokens": int(len(ids)), "peak_growth_mib": (after - before) / 1024,
                  "peak_mib": after / 1024, "seconds": seconds}))
"""


def measure(spec: str, corpus: Path, megabytes: float, mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, spec, str(corpus), str(megabytes), mode], capture_output=True,
                          text=True, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=10.0, help="document size in millions of characters")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    corpus = SHARED / "corpora/prose.jsonl.zst"
    if not corpus.exists():
        sys.exit(f"{corpus} is absent: set SHARDKIT_SHARED to the shared corpora/tokenizers folder")
    rows = []
    for label, relative in TOKENIZERS.items():
        for mode in ("whole", "pieces"):
            runs = [measure(str(SHARED / relative), corpus, args.mb, mode) for _ in range(args.runs)]
            rows.append({"tokenizer": label, "mode": mode, "chars": runs[0]["chars"], "tokens": runs[0]["tokens"],
                         "peak_growth_mib": statistics.median(r["peak_growth_mib"] for r in runs),
                         "peak_mib": statistics.median(r["peak_mib"] for r in runs),
                         "seconds": statistics.median(r["seconds"] for r in runs), "runs": len(runs)})
    print(f"{'tokenizer':20} {'mode':7} {'chars':>11} {'tokens':>10} {'peak growth':>12} {'peak RSS':>10} {'seconds':>8}")
    for r in rows:
        print(f"{r['tokenizer']:20} {r['mode']:7} {r['chars']:>11,} {r['tokens']:>10,} {r['peak_growth_mib']:>8.0f} MiB "
              f"{r['peak_mib']:>6.0f} MiB {r['seconds']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
