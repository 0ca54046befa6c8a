"""End to end on real text: build ../shared/corpora/prose.jsonl.zst with the GPT-2 tokenizer, train
`tiny` on CPU, and compare the held-out loss with the corpus's unigram entropy.

    python benchmarks/e2e_prose.py [--steps 300] [--seq-len 128] [--work-dir /tmp/shardkit-e2e]

Every 10th document goes to the held-out set (split by document, so no text is in both). The unigram
entropy -sum p(t) ln p(t) over the training tokens is the loss of the best model that ignores context;
a trained model must get far below it. Prints both numbers (nats/token) and writes JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def split_corpus(source: Path, work: Path) -> tuple[Path, Path]:
    import zstandard

    train, held_out = work / "corpus-train.jsonl", work / "corpus-heldout.jsonl"
    if train.exists() and held_out.exists():
        return train, held_out
    with open(source, "rb") as raw, open(train, "w") as t, open(held_out, "w") as h:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        for index, line in enumerate(text):
            (h if index % 10 == 9 else t).write(line)
    return train, held_out


def build(corpus: Path, output: Path, tokenizer: Path, seq_len: int) -> None:
    if (output / "shardkit.json").exists():
        return
    subprocess.run([sys.executable, "-m", "shardkit", "build", str(corpus), "--output", str(output),
                    "--tokenizer", str(tokenizer), "--seq-len", str(seq_len), "--workers", "2", "--no-progress"],
                   check=True)


def unigram_entropy(url: Path) -> float:
    from shardkit.formats import ShardReader
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    storage = Storage(str(url))
    manifest = load_manifest(storage)
    counts = np.zeros(manifest.tokenizer.vocab_size, dtype=np.int64)
    for shard in manifest.shards:
        reader = ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard, manifest=manifest)
        counts += np.bincount(reader.arrays.tokens, minlength=len(counts))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def prepare_data(work: Path, seq_len: int, shared: Path = SHARED) -> tuple[Path, Path]:
    """The prose corpus split 9:1 and built with the GPT-2 tokenizer under `work` (reused when there)."""
    corpus, tokenizer = shared / "corpora" / "prose.jsonl.zst", shared / "tokenizers" / "gpt2_hf_tokenizer.json"
    for path in (corpus, tokenizer):
        if not path.exists():
            raise SystemExit(f"{path} is absent: this benchmark needs ../shared beside the repository")
    work.mkdir(parents=True, exist_ok=True)
    train_corpus, held_out_corpus = split_corpus(corpus, work)
    train_data, held_out_data = work / f"prose-train-{seq_len}", work / f"prose-heldout-{seq_len}"
    build(train_corpus, train_data, tokenizer, seq_len)
    build(held_out_corpus, held_out_data, tokenizer, seq_len)
    return train_data, held_out_data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (tiny models take a high one)")
    parser.add_argument("--work-dir", default="/tmp/shardkit-e2e")
    parser.add_argument("--out", default="bench_out/e2e_prose.json")
    args = parser.parse_args()
    work = Path(args.work_dir)
    train_data, held_out_data = prepare_data(work, args.seq_len)
    entropy = unigram_entropy(train_data)
    run_dir = work / "run"
    subprocess.run([sys.executable, "-m", "shardkit.train", "--data", str(train_data), "--eval-data", str(held_out_data),
                    "--preset", "tiny", "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                    "--warmup-steps", str(max(1, args.steps // 10)), "--eval-every", str(max(1, args.steps // 3)),
                    "--eval-batches", "16", "--log-every", "25", "--run-dir", str(run_dir), "--resume", "none",
                    "--checkpoint-every", "0", "--save-final", "false", "--device", "cpu"], check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    result = {"unigram_entropy_nats": entropy, "eval_losses": {r["step"]: r["eval_loss"] for r in evals},
              "final_eval_loss": evals[-1]["eval_loss"], "steps": args.steps, "seq_len": args.seq_len,
              "batch_size": args.batch_size, "lr": args.lr, "run_dir": str(run_dir)}
    print(f"unigram entropy of the training tokens: {entropy:.3f} nats/token")
    print(f"held-out loss after {args.steps} steps:  {result['final_eval_loss']:.3f} nats/token")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
