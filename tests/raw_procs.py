"""Task functions that the multi-process raw-text loader tests run in `ProcessPool` processes."""

from __future__ import annotations


def raw_rank_run(*, inputs: str | list, settings: dict, batch_size: int, rank: int, world_size: int, port: int,
                 steps: int, files: dict[str, str] | None = None, remove: list[str] = (), workers: int = 0,
                 state: dict | None = None) -> dict:
    """Read `steps` batches of a raw-text loader as one rank of a real gloo group; its rows, its state and the
    units it skipped. `inputs` is a corpus or a list of `Stream` (a mixture). `files` are first written under
    `inputs` (a memory:// URL: this process's own), and `remove` deleted once the dataset has listed them (a file
    that vanishes for this rank only). With `state`, the loader resumes from it first."""
    from datetime import timedelta

    import fsspec
    import torch.distributed as dist

    from shardkit import StreamingDataLoader, StreamingDataset

    fs = fsspec.filesystem("memory")
    for name, text in (files or {}).items():
        fs.pipe(f"{inputs}/{name}", text.encode())
    dataset = StreamingDataset(inputs, **settings)  # before the group: the rank comes from it when iterating
    for name in remove:
        fs.rm(f"{inputs}/{name}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                     multiprocessing_context="fork" if workers else None)
        if state is not None:
            loader.load_state_dict(state)
        rows, it = [], iter(loader)
        for _ in range(steps):
            batch = next(it)
            rows += [(int(i), int(e), tuple(t.tolist())) for i, e, t in
                     zip(batch["sample_id"], batch["lane_epoch"], batch["tokens"])]
        return {"rows": rows, "state": loader.state_dict(), "skipped": loader.counters()["skipped_units"],
                "dry_lanes": loader.counters()["dry_lanes"],
                "rejected": dict(dataset.source.rejected)}
    finally:
        dist.destroy_process_group()


def raw_node_copy_run(*, root: str, files: dict[str, str], settings: dict, rank: int, world_size: int, port: int,
                      steps: int, workers: int = 0) -> dict:
    """One rank of a real gloo group reading its own copy of a corpus (written under `root`, a memory:// URL of
    this process: another node's disk): the rows of `steps` batches, or the error that stopped the loader."""
    from datetime import timedelta

    import fsspec
    import torch.distributed as dist

    from shardkit import StreamingDataLoader, StreamingDataset

    fs = fsspec.filesystem("memory")
    for name, text in files.items():
        fs.pipe(f"{root}/{name}", text.encode())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        loader = StreamingDataLoader(StreamingDataset(root, **settings), batch_size=2, num_workers=workers,
                                     multiprocessing_context="fork" if workers else None)
        rows, it = [], iter(loader)
        try:
            for _ in range(steps):
                rows += [int(i) for i in next(it)["sample_id"]]
        except ValueError as err:
            return {"error": str(err), "rows": rows}
        return {"error": None, "rows": rows}
    finally:
        dist.destroy_process_group()


def raw_state_on_one_rank_run(*, inputs: str, settings: dict, rank: int, world_size: int, port: int,
                              timeout: float) -> dict:
    """One rank of a real gloo group that reads a step, then, on rank 0 only, calls `state_dict()` (the user code
    that saves on rank 0): rank 0's error, or None; the other ranks stay alive past the timeout without calling it."""
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from shardkit import StreamingDataLoader, StreamingDataset

    os.environ["SHARDKIT_STATE_CALL_TIMEOUT"] = str(timeout)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        loader = StreamingDataLoader(StreamingDataset(inputs, **settings), batch_size=2)
        next(iter(loader))
        error = None
        if rank == 0:
            try:
                loader.state_dict()
            except ValueError as err:  # a hang would end at the group's timeout (120 s), failing the pool's wait
                error = str(err)
        else:
            time.sleep(timeout + 5)  # alive, not calling it (the group is broken after the refusal: no barrier)
        return {"error": error}
    finally:
        os.environ.pop("SHARDKIT_STATE_CALL_TIMEOUT", None)  # a pool process serves later tests too
        dist.destroy_process_group()
