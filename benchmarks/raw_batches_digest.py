"""Digests of raw text's batches and resume states over many configurations, to compare two commits' output
byte for byte (issue 47: the loader's per-step shortcuts must not change a batch or a state).

    PYTHONPATH=<checkout> python benchmarks/raw_batches_digest.py OUT.json [--tokenizer-gpt2 PATH]

Each configuration (tokenizer byte or GPT-2; pack concat, none, bestfit; 1-3 ranks run in this process; 0 or 2
DataLoader workers; 4 lanes, whose steps all start at one phase, or 5, whose do not) runs `--steps` steps per
rank on a small corpus written here (two plain .jsonl files cut into byte ranges and one .jsonl.zst streamed),
digesting every array of every batch (dtype, shape and bytes) and the merged state after every step; the resume
configurations save after `--steps // 2` steps and digest a fresh loader resumed from that state. Run it with
both commits (each on its own PYTHONPATH) and compare the JSON files: every digest must be equal.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import json
import random
import sys
from pathlib import Path

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega the of and to in is was for on with as by at from").split()


def write_corpus(directory: Path) -> list[str]:
    import zstandard

    rng = random.Random(47)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("a.jsonl", "b.jsonl", "c.jsonl.zst"):
        lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 30, 200, 700])))})
                 for _ in range(90)]
        lines[7] = json.dumps({"text": ""})  # a rejected document
        data = ("\n".join(lines) + "\n").encode()
        path = directory / name
        path.write_bytes(zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data)
        paths.append(str(path))
    return paths


def digest_batch(batch) -> str:
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(batch):
        value = batch[key].numpy()
        h.update(f"{key}:{value.dtype}:{value.shape}".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def make_loaders(paths, tokenizer, pack, lanes, world, workers, batch):
    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    return [StreamingDataLoader(StreamingDataset(paths, tokenizer=tokenizer, seq_len=96, pack=pack, lanes=lanes,
                                                 unit_bytes=4096, rank=rank, world_size=world),
                                batch_size=batch, num_workers=workers,
                                multiprocessing_context="fork" if workers else None) for rank in range(world)]


def run(loaders, steps: int, digests: list[str]) -> dict:
    from shardkit.loaders.sources.raw.feed import merge_raw_states

    iterators = [iter(loader) for loader in loaders]
    state = None
    for _ in range(steps):
        for iterator in iterators:
            digests.append(digest_batch(next(iterator)))
        state = merge_raw_states([loader.local_state_dict() for loader in loaders])
        digests.append(hashlib.blake2b(json.dumps(state, sort_keys=True).encode(), digest_size=16).hexdigest())
    for iterator in iterators:
        iterator.close()
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--gpt2", default="/work/shared/tokenizers/gpt2_hf_tokenizer.json")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--work", default="/tmp/raw_batches_digest")
    args = parser.parse_args()
    paths = write_corpus(Path(args.work))
    result = {}
    for tokenizer, pack, lanes, world, workers in itertools.product(("byte", args.gpt2), ("concat", "none", "bestfit"),
                                                                      (4, 5), (1, 2, 3), (0, 2)):
        digests: list[str] = []
        batch = 8 // world if lanes == 4 else 3
        run(make_loaders(paths, tokenizer, pack, lanes, world, workers, batch), args.steps, digests)
        result[f"{Path(tokenizer).name} {pack} lanes={lanes} ranks={world} workers={workers}"] = digests
    for tokenizer, pack in itertools.product(("byte", args.gpt2), ("concat", "none", "bestfit")):
        digests = []
        state = run(make_loaders(paths, tokenizer, pack, 5, 2, 0, 3), args.steps // 2, [])
        loaders = make_loaders(paths, tokenizer, pack, 5, 2, 0, 3)
        for loader in loaders:
            loader.load_state_dict(state)
        run(loaders, args.steps, digests)
        result[f"{Path(tokenizer).name} {pack} resumed at step {args.steps // 2}"] = digests
    Path(args.out).write_text(json.dumps(result, indent=0) + "\n")
    print(f"{len(result)} configurations, {sum(map(len, result.values()))} digests -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
