"""Raw text's first step and rate (issue 47 items 1 and 2), a commit measured beside the working tree in one run.

    SHARDKIT_SHARED=/work/shared python benchmarks/bench_raw_start.py --baseline main [--runs 3] [--ranks 0]

1. First step at 64 lanes x 2 MiB units (the defaults) on 8 ranks, GPT-2 HF tokenizer, seq_len 1024, batch 8 per
   rank: a fresh process per measurement builds `StreamingDataset(corpus, tokenizer=, seq_len=, rank=r,
   world_size=8)` and its `StreamingDataLoader` and takes the first batch (timed from the dataset's construction,
   after the imports), fresh and after `load_state_dict` of a state saved 3 global steps in (made once by the
   working tree with one rank and the same global batch, the same global order; the baseline loads it with its
   6-entry cursors, which mean the same position). `--ranks` chooses the ranks measured (each in its own process,
   one at a time: 8 concurrent processes on a shared 2-core machine would measure the machine). The corpus is
   `mix.jsonl.zst` and `prose.jsonl.zst` decompressed and written again under other names up to 136 MiB of .jsonl,
   so 64 units of 2 MiB exist.
2. Rate per loader process against the build's text layer, per tokenizer kind (HF tokenizer.json, tiktoken
   r50k_base, a sentencepiece model trained here on the slice, byte): `bench_raw_text.text_layer_pass` and
   `bench_raw_text.raw_pass` (0 workers, concat, 64 KiB units, 4 lanes, --lane-epochs 2) on --mb of the mix
   corpus, alternating, each side in its own process; document tokens per second and per CPU-second, and each
   run's loader rate over its own build pass. Beside that yardstick, the real `shardkit build --workers 1` of the same files in the same
   process (`shardkit_build_pass`: tokenize in one worker process, pack, write zstd shards, hash and verify them),
   and the loader's rate over it.

Medians of --runs, every run listed; JSON to --out.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHARED = Path(os.environ.get("SHARDKIT_SHARED", REPO.parent / "shared"))
GPT2 = SHARED / "tokenizers" / "gpt2_hf_tokenizer.json"
WORLD, BATCH, SEQ = 8, 8, 1024


def write_start_corpus(directory: Path, mib: int = 136) -> Path:
    """The shared corpora decompressed and written again under other names up to `mib` MiB of .jsonl."""
    import zstandard

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "done").exists():
        return directory
    texts = [zstandard.ZstdDecompressor().stream_reader(open(SHARED / "corpora" / name, "rb")).read()
             for name in ("mix.jsonl.zst", "prose.jsonl.zst")]
    written, copy = 0, 0
    while written < mib << 20:
        for k, text in enumerate(texts):
            (directory / f"part-{copy:02d}-{k}.jsonl").write_bytes(text)
            written += len(text)
        copy += 1
    (directory / "done").write_text("1")
    return directory


def start_child(corpus: str, rank: int, state_path: str) -> dict:
    """One rank's first step (in this interpreter's shardkit): construction to first batch."""
    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    began = time.perf_counter()
    dataset = StreamingDataset(corpus, tokenizer=str(GPT2), seq_len=SEQ, rank=rank, world_size=WORLD)
    loader = StreamingDataLoader(dataset, batch_size=BATCH)
    built = time.perf_counter() - began
    if state_path != "-":
        loader.load_state_dict(json.loads(Path(state_path).read_text()))
    next(iter(loader))
    return {"first_step_s": time.perf_counter() - began, "construction_s": built,
            "lanes": dataset.source.corpus.num_lanes}


def make_state(corpus: str, out: Path, steps: int = 3) -> None:
    """A global state `steps` global batches in, saved by one rank reading the 8 ranks' global batch (this tree)."""
    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    loader = StreamingDataLoader(StreamingDataset(corpus, tokenizer=str(GPT2), seq_len=SEQ, rank=0, world_size=1),
                                 batch_size=BATCH * WORLD)
    batches = iter(loader)
    for _ in range(steps):
        next(batches)
    state = loader.state_dict()
    out.write_text(json.dumps(state))
    # The same position as the previous release writes it (version 1: flat, six-entry cursors, its identity recipe).
    from shardkit.loaders.state.envelope import decode

    flat = decode(state)
    old = {**flat, "dataset": loader.dataset.source.corpus.legacy_fingerprint,
           "raw_text": {**flat["raw_text"], "cursors": [r[:6] for r in flat["raw_text"]["cursors"]]}}
    out.with_suffix(".old.json").write_text(json.dumps(old))


def rate_child(tokenizer: str, mb: float, work: str, lane_epochs: int) -> dict:
    """One build pass and one loader pass (0 workers) on the slice, in this interpreter's shardkit."""
    sys.path.insert(0, str(HERE))
    import bench_raw_text as b

    records = b.corpus_records(SHARED / "corpora" / "mix.jsonl.zst", max_bytes=int(mb * 2**20))
    paths = sorted(Path(work).glob("slice/*.jsonl.zst")) or b.write_corpus(records, Path(work) / "slice", 4)
    b.text_layer_pass(paths[:1], tokenizer, SEQ, "concat", 1 << 16)  # the tokenizer loaded, the code warm
    build = b.text_layer_pass(paths, tokenizer, SEQ, "concat", 1 << 16)
    raw = b.raw_pass(paths, tokenizer, SEQ, 0, BATCH, unit_bytes=1 << 16, lanes=4, lane_epochs=lane_epochs)
    cli = shardkit_build_pass(paths, tokenizer, Path(work))
    return {"build": build["tokens_per_s"], "build_cpu": build["tokens_per_cpu_s"], "raw": raw["tokens_per_s"],
            "raw_cpu": raw["tokens_per_cpu_s"], "ratio": raw["tokens_per_s"] / build["tokens_per_s"],
            "ratio_cpu": raw["tokens_per_cpu_s"] / build["tokens_per_cpu_s"], "cli": cli["tokens_per_s"],
            "cli_cpu": cli["tokens_per_cpu_s"], "ratio_cli": raw["tokens_per_s"] / cli["tokens_per_s"],
            "ratio_cli_cpu": raw["tokens_per_cpu_s"] / cli["tokens_per_cpu_s"]}


def shardkit_build_pass(paths: list[Path], tokenizer: str, work: Path) -> dict:
    """`shardkit build --workers 1` of the slice (its defaults otherwise: 1 MiB units, concat here, zstd arrow
    shards written, hashed and checked): document tokens per second and per CPU-second (its one tokenizer worker
    process and its threads included; the tokenizer was loaded by this process before)."""
    import shutil

    from shardkit.tools.build import run_build
    from shardkit.tools.config import BuildConfig

    sys.path.insert(0, str(HERE))
    import bench_raw_text as b

    out = work / f"built-{os.getpid()}"
    config = BuildConfig(inputs=tuple(str(p) for p in paths), output=str(out), tokenizer=tokenizer, seq_len=SEQ,
                         packing="concat", workers=1, progress=False)
    with b.CpuTime() as cpu:
        began = time.perf_counter()
        result = run_build(config)
        seconds = time.perf_counter() - began
    shutil.rmtree(out, ignore_errors=True)
    tokens = result.report["packing"]["document_tokens"]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_cpu_s": tokens / cpu.seconds}


def sentencepiece_model(work: Path) -> str:
    import sentencepiece

    sys.path.insert(0, str(HERE))
    import bench_raw_text as b

    text = work / "sp.txt"
    text.write_text("\n".join(r["text"].replace("\n", " ") for r in b.corpus_records(
        SHARED / "corpora" / "mix.jsonl.zst", max_bytes=2 << 20)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(work / "sp"), vocab_size=8000,
                                             model_type="bpe", minloglevel=2)
    return str(work / "sp.model")


def run_child(python: str, env: dict, *args: str) -> dict:
    out = subprocess.run([python, __file__, *args], check=True, capture_output=True, text=True, cwd="/", env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def sides(args, data: Path) -> dict[str, tuple[str, dict]]:
    from real_tokens import baseline_python

    after = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    before = {k: v for k, v in after.items() if k != "PYTHONPATH"}
    out = {}
    if args.baseline:
        out[f"before ({args.baseline})"] = (baseline_python(args.baseline, data), before)
    out["after"] = (sys.executable, after)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="a commit measured beside the working tree")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[0])
    parser.add_argument("--mb", type=float, default=3.0, help="--part rate: MB of the mix corpus")
    parser.add_argument("--part", nargs="+", default=["start", "rate"], choices=["start", "rate"])
    parser.add_argument("--lane-epochs", type=int, default=2,
                        help="--part rate: lane epochs the loader's pass reads (each lane ends it up to one tokenizer "
                             "call ahead of what it delivered: ~5%% of one epoch of the 3 MB slice, half that of two)")
    parser.add_argument("--kinds", nargs="+", default=["hf", "tiktoken", "sentencepiece", "byte"])
    parser.add_argument("--data-dir", default=str(REPO / "bench_out" / "raw_start"))
    parser.add_argument("--out", default=str(REPO / "bench_out" / "raw_start.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    data = Path(args.data_dir).resolve()
    data.mkdir(parents=True, exist_ok=True)
    runners = sides(args, data)
    result: dict = {"load_average": os.getloadavg(), "runs": args.runs, "lane_epochs": args.lane_epochs}
    if "start" in args.part:
        corpus = str(write_start_corpus(data / "corpus"))
        state = data / "state.json"
        make_state(corpus, state)
        rows: dict[str, list] = {}
        for _ in range(args.runs):
            for mode in ("fresh", "resume"):
                for rank in args.ranks:
                    for side, (python, env) in runners.items():
                        saved = state if side == "after" else state.with_suffix(".old.json")
                        path = "-" if mode == "fresh" else str(saved)
                        rows.setdefault(f"{side}, {mode}, rank {rank}", []).append(
                            run_child(python, env, "--child-start", corpus, str(rank), path))
        result["start"] = {name: {"first_step_s": statistics.median(r["first_step_s"] for r in runs),
                                  "construction_s": statistics.median(r["construction_s"] for r in runs),
                                  "runs": [round(r["first_step_s"], 3) for r in runs]} for name, runs in rows.items()}
    if "rate" in args.part:
        with tempfile.TemporaryDirectory() as work:
            specs = {"hf": str(GPT2), "tiktoken": str(SHARED / "tokenizers" / "r50k_base.tiktoken"), "byte": "byte"}
            if "sentencepiece" in args.kinds:
                specs["sentencepiece"] = sentencepiece_model(Path(work))
            rows = {}
            for _ in range(args.runs):
                for kind in args.kinds:
                    for side, (python, env) in runners.items():
                        rows.setdefault(f"{side}, {kind}", []).append(
                            run_child(python, env, "--child-rate", specs[kind], str(args.mb), work,
                                      str(args.lane_epochs)))
            result["rate"] = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                              | {"ratios": [round(r["ratio"], 3) for r in runs],
                                 "ratios_cpu": [round(r["ratio_cpu"], 3) for r in runs],
                                 "ratios_cli_cpu": [round(r["ratio_cli_cpu"], 3) for r in runs]}
                              for name, runs in rows.items()}
    result["load_average_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    return 0


def print_tables(result: dict) -> None:
    if "start" in result:
        print("| side, mode, rank | first step (s, median) | construction (s) | runs |\n|---|---|---|---|")
        for name, row in result["start"].items():
            print(f"| {name} | {row['first_step_s']:.2f} | {row['construction_s']:.2f} | {row['runs']} |")
    if "rate" in result:
        print("\n| side, tokenizer | text layer tok/s | shardkit build tok/s | loader tok/s | loader / text layer: "
              "wall (runs) | per CPU-second (runs) | loader / shardkit build: wall | per CPU-second (runs) |\n"
              "|---|---|---|---|---|---|---|---|")
        for name, row in result["rate"].items():
            print(f"| {name} | {row['build'] / 1e6:.2f}M | {row['cli'] / 1e6:.2f}M | {row['raw'] / 1e6:.2f}M | "
                  f"{row['ratio']:.0%} ({_runs(row['ratios'])}) | {row['ratio_cpu']:.0%} ({_runs(row['ratios_cpu'])}) "
                  f"| {row['ratio_cli']:.0%} | {row['ratio_cli_cpu']:.0%} ({_runs(row['ratios_cli_cpu'])}) |")


def _runs(ratios: list[float]) -> str:
    return ", ".join(f"{r:.0%}" for r in ratios)


if __name__ == "__main__" and sys.argv[1:2] == ["--child-start"]:
    print(json.dumps(start_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
elif __name__ == "__main__" and sys.argv[1:2] == ["--child-rate"]:
    print(json.dumps(rate_child(sys.argv[2], float(sys.argv[3]), sys.argv[4], int(sys.argv[5]))))
elif __name__ == "__main__":
    sys.exit(main())
