"""Which global positions each rank and worker reads at each step: pure functions, no I/O.

An epoch is consumed in *global steps* of `world_size * batch_size` consecutive positions of the
global order, starting at the resume point `start`. Inside a step the positions are sorted by
canonical partition (stable) and cut into `world_size` equal slices; ranks are numbered node by node,
so a node's ranks take a contiguous run of partitions. When the global batch is a multiple of
`num_partitions` and `num_partitions` a multiple of the number of nodes, every node reads only its own
partitions (download volume per node is about dataset / nodes); otherwise the split stays exact and
balanced, with less locality.

The ragged tail of an epoch is handled by an explicit policy: "drop" (default) stops after the last
full global step; "pad" completes the last step with positions wrapped to the start of the epoch
(the repeated samples carry their real `sample_id`, so they can be recognised); "partial" makes the
last step smaller: its `rest` positions are split over the ranks, `ceil(rest / world_size)` each, so
every rank still gets the same number of batches and every sample comes exactly once. Only when
`rest` is not a multiple of the world size does that last step repeat (pad) fewer than `world_size`
positions from the start of the epoch, so that the ranks' last batches stay equal in size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from .config import check_policy


def steps_in_epoch(num_positions: int, *, start: int, global_batch: int, policy: str = "drop") -> int:
    """Global steps left in an epoch of `num_positions` when `start` positions are consumed."""
    check_policy(policy)
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    remaining = max(0, num_positions - start)
    return remaining // global_batch if policy == "drop" else -(-remaining // global_batch)


def dropped_in_epoch(num_positions: int, *, global_batch: int, policy: str = "drop", world_size: int = 1) -> int:
    """Positions of a whole epoch that the policy leaves out ("drop") or repeats ("pad", "partial": negative)."""
    steps = steps_in_epoch(num_positions, start=0, global_batch=global_batch, policy=policy)
    last = partial_batch(num_positions, start=0, global_batch=global_batch, world_size=world_size, policy=policy)
    read = steps * global_batch if last is None else (steps - 1) * global_batch + last * world_size
    return num_positions - read


def partial_batch(num_positions: int, *, start: int, global_batch: int, world_size: int, policy: str) -> int | None:
    """Samples per rank of the epoch's last step when the "partial" policy makes it smaller, else None.

    The `rest` positions of the ragged last step are split evenly: ceil(rest / world_size) per rank
    (the ranks' batches must stay equal in size); the < world_size positions this rounds up wrap to
    the start of the epoch, as "pad" does.
    """
    if policy != "partial":
        return None
    rest = max(0, num_positions - start) % global_batch
    return -(-rest // world_size) if rest else None


def ramp_rounds(bundle: int) -> int:
    """Rounds in which workers take fewer than `bundle` steps: round r deals each worker 2**r steps (1, 2, 4, ...
    while below `bundle`), then every round deals `bundle`. Each worker's first message holds one batch, so the
    epoch's first batch waits for one batch's reads instead of a whole bundle's (16 batches of a cold shard were
    most of its blocks); the doubling reaches whole bundles, which amortise the per-message cost, in a few rounds."""
    return (bundle - 1).bit_length()


def bundle_sizes(bundle: int) -> Iterator[int]:
    """The steps of each message of a worker, in order: 1, 2, 4, ... (`ramp_rounds`), then `bundle` for ever."""
    yield from (1 << r for r in range(ramp_rounds(bundle)))
    yield from itertools.repeat(bundle)


def worker_of_step(step: int | np.ndarray, *, num_workers: int, bundle: int = 1):
    """DataLoader worker that produces `step` (steps counted from the resume point).

    Workers take consecutive steps round robin, as many per round as `bundle_sizes` says (1, 2, 4, ... then
    `bundle`): torch's DataLoader returns worker outputs round robin in worker order, so they arrive in step order.
    """
    rounds = ramp_rounds(bundle)
    ramp_end = num_workers * ((1 << rounds) - 1)  # steps dealt before the whole bundles
    steps = np.asarray(step, dtype=np.int64)
    worker = ((steps - ramp_end) // bundle) % num_workers
    if rounds:
        # Round r of the ramp holds steps [n (2**r - 1), n (2**(r + 1) - 1)); each worker takes 2**r of them.
        size = 1 << np.floor(np.log2(steps // num_workers + 1)).astype(np.int64).clip(0, rounds - 1)
        worker = np.where(steps < ramp_end, (steps - num_workers * (size - 1)) // size, worker)
    return int(worker) if np.ndim(step) == 0 else worker


def worker_step_count(num_steps: int, *, worker: int, num_workers: int, bundle: int = 1) -> int:
    """How many of the first `num_steps` steps worker `worker` produces (arithmetic, O(log bundle))."""
    _check_worker(worker, num_workers, bundle)
    rounds = ramp_rounds(bundle)
    count = 0
    for r in range(rounds):
        size = 1 << r
        count += min(size, max(0, num_steps - num_workers * (size - 1) - worker * size))
    cycle = bundle * num_workers
    full, rest = divmod(max(0, num_steps - num_workers * ((1 << rounds) - 1)), cycle)
    return count + full * bundle + min(bundle, max(0, rest - worker * bundle))


def worker_step_chunks(num_steps: int, *, worker: int, num_workers: int, bundle: int = 1,
                       chunk: int, skip: int = 0) -> Iterator[np.ndarray]:
    """The steps worker `worker` produces, in order, as arrays of `chunk` steps (the last may be shorter),
    without its first `skip` steps.

    Computed chunk by chunk from the step arithmetic of `worker_of_step`, so starting (or resuming
    anywhere in) an epoch of billions of steps costs O(chunk), not O(steps in the epoch).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    count = worker_step_count(num_steps, worker=worker, num_workers=num_workers, bundle=bundle)
    rounds = ramp_rounds(bundle)
    own_ramp = (1 << rounds) - 1  # steps each worker takes in the ramp
    for first in range(max(0, skip), count, chunk):
        i = np.arange(first, min(first + chunk, count), dtype=np.int64)
        # After the ramp, the i-th step of this worker: bundle j // bundle of its own, at offset j % bundle.
        j = i - own_ramp
        steps = num_workers * own_ramp + (j // bundle) * (bundle * num_workers) + worker * bundle + j % bundle
        if rounds:
            # In the ramp, its i-th step is in round r (2**r <= i + 1 < 2**(r + 1)), at offset i - (2**r - 1).
            size = 1 << np.floor(np.log2(i + 1)).astype(np.int64)
            steps = np.where(i < own_ramp, num_workers * (size - 1) + worker * size + i - (size - 1), steps)
        yield steps


def worker_steps(num_steps: int, *, worker: int, num_workers: int, bundle: int = 1) -> np.ndarray:
    """The steps that DataLoader worker `worker` produces, in order (see `worker_of_step`)."""
    count = worker_step_count(num_steps, worker=worker, num_workers=num_workers, bundle=bundle)
    chunks = worker_step_chunks(num_steps, worker=worker, num_workers=num_workers, bundle=bundle,
                                chunk=max(count, 1))
    return next(chunks, np.zeros(0, dtype=np.int64))


def _check_worker(worker: int, num_workers: int, bundle: int) -> None:
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is outside [0, {num_workers})")
    if bundle < 1:
        raise ValueError(f"bundle must be >= 1, got {bundle}")


def rank_positions(steps: np.ndarray, *, start: int, num_positions: int, world_size: int, batch_size: int,
                   rank: int, partition_of: Callable[[np.ndarray], np.ndarray], stride: int | None = None) -> np.ndarray:
    """Global positions [len(steps), batch_size] that `rank` reads at the given steps.

    Args:
        steps: step numbers counted from the resume point `start`.
        start: positions of the epoch consumed before step 0.
        num_positions: positions in the epoch; positions past it wrap (pad policy).
        world_size: data-parallel ranks.
        batch_size: samples per rank per step.
        rank: this rank.
        partition_of: maps positions to canonical partitions (the order's `partition_of`).
        stride: positions per step (default world_size x batch_size; the smaller last step of the
            "partial" policy reads fewer positions than a step spans).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    global_batch = world_size * batch_size
    stride = global_batch if stride is None else stride
    steps = np.asarray(steps, dtype=np.int64)
    positions = start + steps[:, None] * stride + np.arange(global_batch, dtype=np.int64)[None, :]
    positions %= max(num_positions, 1)
    if world_size == 1:
        return positions
    by_partition = np.argsort(partition_of(positions), axis=1, kind="stable")
    mine = by_partition[:, rank * batch_size:(rank + 1) * batch_size]
    return np.take_along_axis(positions, mine, axis=1)
