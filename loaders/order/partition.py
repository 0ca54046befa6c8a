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

from ..config import check_policy


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


def ramp_sizes(bundle: int) -> tuple[int, ...]:
    """The steps of each worker's messages in the first round: 1, 1, 2, 4, ... (each as many as the ones before
    it, the last what is left), which add up to one `bundle`; every later round deals whole bundles.

    Each worker's first message holds one batch, so the epoch's first batch waits for one batch's reads instead
    of a whole bundle's (16 batches of a cold shard were most of its blocks); the doubling reaches whole bundles,
    which amortise the per-message cost, in a few messages. The ramp only splits the first round: each worker
    still takes the steps of its first bundle's round, and from the second round on every worker takes the very
    steps of a dealing without the ramp. A ramp of 1, 2, 4, 8 before the bundles shifted all later bundles by
    15 steps, which put every second chunk of a worker's steps (`worker_step_chunks`) across two of its bundles,
    a round apart: each worker held the shards of twice the positions, and 16 readers sharing a cache smaller
    than the dataset pinned all of it
    (`tests/test_kill_matrix.py::test_sixteen_processes_share_a_cache_smaller_than_the_dataset`).
    """
    sizes, dealt = [], 0
    while dealt < bundle:
        sizes.append(min(max(dealt, 1), bundle - dealt))
        dealt += sizes[-1]
    return tuple(sizes)


def bundle_sizes(bundle: int) -> Iterator[int]:
    """The steps of each message of a worker, in order: `ramp_sizes`, then `bundle` for ever."""
    yield from ramp_sizes(bundle)
    yield from itertools.repeat(bundle)


def _ramp_starts(bundle: int) -> np.ndarray:
    """Each worker's steps before each of its ramp messages, and `bundle` last: [0, 1, 2, 4, ..., bundle]."""
    return np.concatenate([[0], np.cumsum(ramp_sizes(bundle))]).astype(np.int64)


def worker_of_step(step: int | np.ndarray, *, num_workers: int, bundle: int = 1):
    """DataLoader worker that produces `step` (steps counted from the resume point).

    Workers take consecutive steps round robin, as many per message as `bundle_sizes` says (`ramp_sizes` in
    the first round, then `bundle`): torch's DataLoader returns worker outputs round robin in worker order, so
    they arrive in step order.
    """
    steps = np.asarray(step, dtype=np.int64)
    worker = (steps // bundle) % num_workers
    starts = _ramp_starts(bundle)
    # Message r of the ramp: steps [n starts[r], n starts[r + 1]), each worker's `size` of them in turn.
    r = np.searchsorted(num_workers * starts, steps, side="right") - 1
    ramp = r < len(starts) - 1
    r = r.clip(0, len(starts) - 2)
    size = starts[r + 1] - starts[r]
    worker = np.where(ramp, (steps - num_workers * starts[r]) // size, worker)
    return int(worker) if np.ndim(step) == 0 else worker


def worker_step_count(num_steps: int, *, worker: int, num_workers: int, bundle: int = 1) -> int:
    """How many of the first `num_steps` steps worker `worker` produces (arithmetic, O(log bundle))."""
    _check_worker(worker, num_workers, bundle)
    cycle = bundle * num_workers
    if num_steps >= cycle:  # the ramp dealt each worker its first bundle, as a dealing without it does
        full, rest = divmod(num_steps, cycle)
        return full * bundle + min(bundle, max(0, rest - worker * bundle))
    starts = _ramp_starts(bundle)
    return sum(min(int(size), max(0, num_steps - num_workers * int(start) - worker * int(size)))
               for start, size in zip(starts[:-1], np.diff(starts)))


def worker_step_chunks(num_steps: int, *, worker: int, num_workers: int, bundle: int = 1,
                       chunk: int, skip: int = 0) -> Iterator[np.ndarray]:
    """The steps worker `worker` produces, in order, as arrays of at most `chunk` steps, without its first
    `skip` steps.

    The reader holds the shards of a chunk and of the next one, so a chunk never spans two of the worker's
    messages in the ramp (they lie a round of the other workers' steps apart), and after it chunks end at
    multiples of `chunk` of the worker's steps: with `chunk` dividing `bundle`, never across two bundles.

    Computed chunk by chunk from the step arithmetic of `worker_of_step`, so starting (or resuming
    anywhere in) an epoch of billions of steps costs O(chunk), not O(steps in the epoch).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    count = worker_step_count(num_steps, worker=worker, num_workers=num_workers, bundle=bundle)
    starts = _ramp_starts(bundle)
    first = max(0, skip)
    while first < count:
        if first < bundle > 1:  # in the ramp: up to the end of the message holding the worker's step `first`
            end = min(first + chunk, int(starts[np.searchsorted(starts, first, side="right")]))
        else:
            end = first + chunk - first % chunk
        i = np.arange(first, min(end, count), dtype=np.int64)
        first = int(i[-1]) + 1
        # The i-th step of this worker: bundle i // bundle of its own, at offset i % bundle.
        steps = (i // bundle) * (bundle * num_workers) + worker * bundle + i % bundle
        if i[0] < bundle:
            # In the ramp, message r holds its steps [starts[r], starts[r + 1]), at offset i - starts[r].
            r = (np.searchsorted(starts, i, side="right") - 1).clip(0, len(starts) - 2)
            ramp = num_workers * starts[r] + worker * (starts[r + 1] - starts[r]) + i - starts[r]
            steps = np.where(i < bundle, ramp, steps)
        yield steps


def worker_steps(num_steps: int, *, worker: int, num_workers: int, bundle: int = 1) -> np.ndarray:
    """The steps that DataLoader worker `worker` produces, in order (see `worker_of_step`)."""
    count = worker_step_count(num_steps, worker=worker, num_workers=num_workers, bundle=bundle)
    chunks = worker_step_chunks(num_steps, worker=worker, num_workers=num_workers, bundle=bundle,
                                chunk=max(count, 1))
    return np.concatenate([np.zeros(0, dtype=np.int64), *chunks])


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
