"""Pictures without a metrics server: `shardkit plot RUN_DIR` (loss, throughput and data wait of a
run) and `shardkit inspect --plot` (a dataset's sample lengths and tokens per source), as PNGs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardkit.records import read_records


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) from RUN_DIR/metrics.jsonl, naming the file and line on bad input."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a training run directory?")
    steps, evals = [], []
    for _, record in read_records(path):
        if "loss" in record:
            steps.append(record)
        elif "eval_loss" in record:
            evals.append(record)
    if not steps:
        raise ValueError(f"{path} holds no training steps yet")
    return steps, evals


def plot_run(run_dir: str | Path, *, output: str | Path | None = None) -> Path:
    """Write the loss (training and eval) and tokens/s curves; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    steps, evals = read_metrics(run_dir)
    output = Path(output) if output else Path(run_dir) / "curves.png"
    fig, (loss_ax, speed_ax, time_ax) = plt.subplots(3, 1, figsize=(8, 10))
    loss_ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train", linewidth=1)
    if evals:
        loss_ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    loss_ax.set_ylabel("loss (nats/token)")
    loss_ax.set_title(f"{Path(run_dir).resolve().name}")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    speed_ax.plot([r["step"] for r in steps], [r["tokens_per_s"] for r in steps], linewidth=1)
    speed_ax.set_ylabel("tokens/s (all ranks)")
    speed_ax.set_xlabel("step")
    speed_ax.grid(alpha=0.3)
    _plot_over_time(time_ax, over_time(steps))
    _save(fig, output)
    return output


def over_time(steps: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Minutes since the first logged step, tokens/s and data-wait fraction of the steps that carry them
    (logs from before the data-wait fraction was recorded have none: those steps are left out)."""
    rows = [r for r in steps if "time" in r and "data_wait_fraction" in r]
    if not rows:
        return {"minutes": np.zeros(0), "tokens_per_s": np.zeros(0), "data_wait": np.zeros(0)}
    times = np.array([r["time"] for r in rows], dtype=np.float64)
    return {"minutes": (times - times[0]) / 60.0, "tokens_per_s": np.array([r["tokens_per_s"] for r in rows]),
            "data_wait": np.array([r["data_wait_fraction"] for r in rows])}


def _plot_over_time(ax, series: dict[str, np.ndarray]) -> None:
    ax.set_xlabel("minutes since the first step (resumed attempts continue on the same clock)")
    if not len(series["minutes"]):
        ax.text(0.5, 0.5, "no timed steps in metrics.jsonl", ha="center", transform=ax.transAxes)
        return
    ax.plot(series["minutes"], series["tokens_per_s"], linewidth=1, color="tab:blue")
    ax.set_ylabel("tokens/s", color="tab:blue")
    ax.grid(alpha=0.3)
    wait_ax = ax.twinx()
    wait_ax.plot(series["minutes"], 100 * series["data_wait"], linewidth=1, color="tab:red")
    wait_ax.set_ylabel("data wait (% of step)", color="tab:red")
    wait_ax.set_ylim(0, 100)


def _save(fig, output: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


# -- datasets ----------------------------------------------------------------------------------
def shard_statistics(arrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample lengths, source index per document segment, tokens per segment) of one shard's arrays.

    Padding segments (source -1) are kept in the lengths but have no source. Shards without document
    boundaries give empty segment arrays.
    """
    offsets = np.asarray(arrays.sample_offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    if arrays.doc_offsets is None:
        return lengths, np.zeros(0, np.int64), np.zeros(0, np.int64)
    doc_offsets = np.asarray(arrays.doc_offsets, dtype=np.int64)
    per_sample = np.diff(doc_offsets)
    owner = np.repeat(np.arange(len(lengths)), per_sample)
    starts = offsets[owner] + np.asarray(arrays.doc_starts, dtype=np.int64)
    # A segment ends where the next one starts: every sample's first segment starts at its first token
    # (the writer checks it), so a sample's last segment ends where the next sample begins.
    ends = np.append(starts[1:], offsets[-1])
    return lengths, np.asarray(arrays.doc_source, dtype=np.int64), ends - starts


def tokens_per_source(sources: np.ndarray, tokens: np.ndarray, num_sources: int) -> np.ndarray:
    real = sources >= 0
    return np.bincount(sources[real], weights=tokens[real], minlength=num_sources).astype(np.int64)


def plot_dataset(shard_arrays, *, sources: tuple[str, ...], title: str, output: str | Path) -> dict[str, Any]:
    """Histogram of sample lengths and bar chart of tokens per source over `shard_arrays` (an iterable of
    decoded shards); writes the PNG and returns the figures drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, by_source, shards = [], np.zeros(len(sources), np.int64), 0
    for arrays in shard_arrays:
        sample_lengths, segment_sources, segment_tokens = shard_statistics(arrays)
        lengths.append(sample_lengths)
        by_source += tokens_per_source(segment_sources, segment_tokens, len(sources))[:len(sources)]
        shards += 1
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    fig, (length_ax, source_ax) = plt.subplots(2, 1, figsize=(8, 8))
    length_ax.hist(lengths, bins=min(50, max(1, len(np.unique(lengths)))), color="tab:blue")
    length_ax.set_xlabel("sample length (tokens)")
    length_ax.set_ylabel("samples")
    length_ax.set_title(f"{title}: {len(lengths):,} samples in {shards} shards")
    names = [Path(s.rstrip("/")).name or s for s in sources]
    source_ax.barh(range(len(names)), by_source, color="tab:green")
    source_ax.set_yticks(range(len(names)), names)
    source_ax.set_xlabel("tokens (document segments; padding excluded)")
    source_ax.set_title("tokens per source")
    _save(fig, Path(output))
    return {"samples": len(lengths), "shards": shards, "tokens_per_source": by_source.tolist(),
            "sample_lengths": lengths}
