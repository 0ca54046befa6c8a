"""A plain training loop over StreamingDataset inside torchdata's StatefulDataLoader (shardkit's, as documented) or
torch's DataLoader (started by tests/test_integrations_torchdata.py, alone or under torchrun). Saves
`{"loader": state, "step", "epoch"}` with torch.save every 5 steps and loads it (weights_only) on --resume: the
loop a user writes.

    python torchdata_runs.py DATASET FOLDER IDS_JSON --steps N [--stop-at K] [--resume S] [--workers W] [--plain]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from integration_procs import run_parser, write_ids  # noqa: E402
from shardkit import StreamingDataset  # noqa: E402
from shardkit.integrations.torchdata import StatefulDataLoader  # noqa: E402


def main() -> None:
    parser = run_parser()
    parser.add_argument("--resume", type=int, help="the saved step to resume from")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="torch DataLoader; the dataset's own state is saved")
    opts = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    dataset = StreamingDataset(opts.dataset, batch_size=4, shuffle_window=50,
                               cache_dir=os.path.join(opts.folder, "cache"))
    loader = (DataLoader if opts.plain else StatefulDataLoader)(dataset, batch_size=None, num_workers=opts.workers)
    stateful = dataset if opts.plain else loader
    step, epoch = 0, 0
    if opts.resume is not None:
        saved = torch.load(os.path.join(opts.folder, f"step-{opts.resume}-rank-{rank}.pt"), weights_only=True)
        stateful.load_state_dict(saved["loader"])
        step, epoch = saved["step"], saved["epoch"]
    seen = []
    while step < opts.steps and step != opts.stop_at:
        # With workers the epoch lives in the workers' copies (docs/LOADING.md): name it before each epoch. After
        # a load, naming the loaded epoch keeps the loaded position (the plain DataLoader loads at once).
        dataset.set_epoch(epoch)
        for batch in loader:
            step += 1
            seen.append([step, batch["sample_id"].tolist()])
            if step % 5 == 0:
                torch.save({"loader": stateful.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(opts.folder, f"step-{step}-rank-{rank}.pt"))
            if step in (opts.steps, opts.stop_at):
                break
        else:
            epoch += 1
    write_ids(opts.ids, seen)


if __name__ == "__main__":
    main()
