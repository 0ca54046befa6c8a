"""`shardkit plot RUN_DIR`: loss and throughput curves of a run as one PNG."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) from RUN_DIR/metrics.jsonl, naming the file and line on bad input."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a training run directory?")
    steps, evals = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON record ({err})") from err
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
    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
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
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
