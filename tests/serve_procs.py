"""Task functions the data-service tests run in `ProcessPool` processes (ranks of a real gloo group)."""

from __future__ import annotations


def served_rank_run(*, url: str, rank: int, world_size: int, port: int, steps: int, batch_size: int,
                    state: dict | None = None) -> dict:
    """One rank of a gloo group reading `steps` batches through the service at `url` (from `state`): its batches'
    sample ids and token digests, and the global state after them (gathered over the group)."""
    from datetime import timedelta

    import torch.distributed as dist

    from resume_contract import take
    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        loader = StreamingDataLoader(StreamingDataset(None, service=url), batch_size=batch_size)
        if state is not None:
            loader.load_state_dict(state)
        batches = take(loader, steps)
        return {"batches": [b.tolist() for b in batches], "state": loader.state_dict()}
    finally:
        dist.destroy_process_group()
