"""Read speed of weighted mixtures, this tree against a commit in the same run (issue 42: one mixture class).

Two mixtures, each read by `StreamingDataLoader` (batch 64, no workers, warm node cache) in a child process per run
(the CPU time counted from the first batch asked for, the loader and dataset already made):
- `built`: a mixture of two built datasets (weights 3 and 1), epochs of one global order;
- `raw+built`: raw text (weight 1) with a built dataset (weight 9), GPT-2 ids, endless lanes.

The sides alternate run by run (before, after, before, ...): this machine is shared, so the figure to compare is
samples per CPU-second of the loading process (and the wall rate beside it), medians of `--runs`. The before side
is `--baseline` (default `main`) installed from its own `git archive` (`real_tokens.baseline_python`); the after
side is this tree (`PYTHONPATH`). Writes the rows to `--out` as JSON.

    python benchmarks/bench_mixture_read.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 128
BATCH = 64
WORDS = ("the river carries stone and light past the mill where children count boats under a grey sky while "
         "merchants argue over salt copper wool and the price of bread in winter").split()

CHILD = r"""
import json, sys, time
from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset
args = json.loads(sys.argv[1])
if args["case"] == "built":
    ds = StreamingDataset([Stream(args["a"], 3), Stream(args["b"], 1)], cache_dir=args["cache"])
else:
    ds = StreamingDataset([Stream(args["raw"], 1, raw_text=True), Stream(args["a"], 9)], tokenizer=args["tokenizer"],
                          seq_len=args["seq_len"], cache_dir=args["cache"])
loader = StreamingDataLoader(ds, batch_size=args["batch"])
samples = steps = 0
wall, cpu = time.perf_counter(), time.process_time()
while steps < args["steps"]:
    for batch in loader:
        samples += len(batch["sample_id"])
        steps += 1
        if steps == args["steps"]:
            break
print(json.dumps({"samples": samples, "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
"""


def write_jsonl(path: Path, docs: int, *, shift: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for i in range(docs):
            words = [WORDS[(i * 7 + j * (shift + 3)) % len(WORDS)] for j in range(60 + i % 180)]
            out.write(json.dumps({"text": f"document {i}: " + " ".join(words)}) + "\n")


def make_data(root: Path, tokenizer: str) -> dict[str, str]:
    """Two built datasets and a raw corpus (made once under `root` with this tree's build)."""
    from shardkit.tools.build import BuildConfig, run_build

    paths = {"a": root / "built_a", "b": root / "built_b", "raw": root / "raw"}
    for name, docs, shift in (("a", 6000, 0), ("b", 3000, 5)):
        if not (paths[name] / "shardkit.json").exists():
            write_jsonl(root / f"text_{name}" / "docs.jsonl", docs, shift=shift)
            run_build(BuildConfig(inputs=(str(root / f"text_{name}"),), output=str(paths[name]), tokenizer=tokenizer,
                                  seq_len=SEQ_LEN, shard_size=2_000_000, progress=False, workers=1))
    if not (paths["raw"] / "docs.jsonl").exists():
        write_jsonl(paths["raw"] / "docs.jsonl", 8000, shift=11)
    return {name: str(path) for name, path in paths.items()}


def run_child(python: str, env: dict[str, str], args: dict) -> dict:
    done = subprocess.run([python, "-c", CHILD, json.dumps(args)], env=env, check=True, capture_output=True,
                          text=True, cwd="/")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", default="main", help="the commit read before (installed from git archive)")
    parser.add_argument("--data-dir", default="/tmp/bench_mixture_read")
    parser.add_argument("--steps", type=int, default=600, help="steps of the raw+built mixture read per run")
    parser.add_argument("--built-steps", type=int, default=20_000,
                        help="steps of the built mixture read per run (its steps cost ~5 us: enough for seconds)")
    parser.add_argument("--cases", nargs="+", default=["built", "raw+built"], choices=["built", "raw+built"])
    parser.add_argument("--tokenizer", default="/work/shared/tokenizers/gpt2_hf_tokenizer.json")
    parser.add_argument("--out", default="bench_mixture_read.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from real_tokens import baseline_python

    root = Path(args.data_dir).resolve()
    data = make_data(root, args.tokenizer)
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {f"before ({args.baseline})": (baseline_python(args.baseline, root), base_env),
             "after (this tree)": (sys.executable, {**base_env, "PYTHONPATH": str(REPO)})}
    rows: dict[tuple[str, str], list[dict]] = {}
    for run in range(-1, args.runs):  # run -1 warms each side's node cache and is not counted
        for case in args.cases:
            for side, (python, env) in sides.items():
                cache = str(root / "cache")  # one node cache: both sides read the same cached shards
                steps = args.built_steps if case == "built" else args.steps
                result = run_child(python, env, {"case": case, "steps": steps, "batch": BATCH, "cache": cache,
                                                 "tokenizer": args.tokenizer, "seq_len": SEQ_LEN, **data})
                if run >= 0:
                    rows.setdefault((case, side), []).append(result)
                    print(f"run {run} {case:9s} {side}: {result['samples'] / result['cpu']:,.0f} samples/CPU-s",
                          flush=True)
    table = []
    for (case, side), results in rows.items():
        table.append({"case": case, "side": side, "samples": results[0]["samples"],
                      "per_cpu_second": statistics.median(r["samples"] / r["cpu"] for r in results),
                      "per_wall_second": statistics.median(r["samples"] / r["wall"] for r in results)})
    print(f"\n| mixture | side | samples | samples per CPU-second | samples/s (wall) |\n|---|---|---|---|---|")
    for row in table:
        print(f"| {row['case']} | {row['side']} | {row['samples']:,} | {row['per_cpu_second']:,.0f} | "
              f"{row['per_wall_second']:,.0f} |")
    for case in args.cases:
        before, after = (r["per_cpu_second"] for r in table if r["case"] == case)
        # each run's pair (read one after the other) shares the machine's state: the median of their ratios
        pairs = zip(*(rows[(case, side)] for side in sides))
        paired = statistics.median((b["samples"] / b["cpu"]) / (a["samples"] / a["cpu"]) for a, b in pairs)
        print(f"{case}: after / before per CPU-second = {after / before:.3f} (medians), {paired:.3f} (median of the "
              "runs' ratios)")
        for row in table:
            if row["case"] == case and row["side"].startswith("after"):
                row["paired_ratio"] = paired
    Path(args.out).write_text(json.dumps({"runs": args.runs, "steps": {"built": args.built_steps, "raw+built": args.steps},
                                          "batch": BATCH, "rows": table},
                                         indent=2))


if __name__ == "__main__":
    main()
