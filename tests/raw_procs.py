"""Task functions that the multi-process raw-text loader tests run in `ProcessPool` processes."""

from __future__ import annotations


def raw_rank_run(*, inputs: str | list, settings: dict, batch_size: int, rank: int, world_size: int, port: int,
                 steps: int) -> dict:
    """Read `steps` batches of a raw-text loader as one rank of a real gloo group; its rows and its state."""
    from datetime import timedelta

    import torch.distributed as dist

    from shardkit import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(inputs, **settings)  # before the group: the rank comes from it when iterating
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        loader = StreamingDataLoader(dataset, batch_size=batch_size)
        rows, it = [], iter(loader)
        for _ in range(steps):
            batch = next(it)
            rows += [(int(i), int(e), tuple(t.tolist())) for i, e, t in
                     zip(batch["sample_id"], batch["lane_epoch"], batch["tokens"])]
        return {"rows": rows, "state": loader.state_dict()}
    finally:
        dist.destroy_process_group()
