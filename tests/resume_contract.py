"""The loader's resume contract, checked the same way for every loader mode (torchdata's
`run_test_save_load_state` idea).

`check_resume(make_loader, ...)`: run `world_size` ranks uninterrupted for `epochs` epochs (the
reference), then for each save point (the start, mid-epoch, right after the epoch's last batch, and
after the epoch's loop has finished) save `state_dict()` from a loader stopped there, resume a *fresh*
loader from it and require, rank by rank, exactly the reference's remaining batches (sample ids in
order, batch by batch) up to the end of the last epoch.

`check_elastic_resume(make_loader, ...)`: save mid-epoch with `before` ranks, resume with `after`
ranks, and require that the union over ranks of the rest of the epoch is the uninterrupted remainder
of the global order: nothing repeated, nothing lost (see the function for the exact statement per mode).

Endless loaders (raw text: lanes go on epoch after epoch) have no epoch end: pass `steps=N` and the save
points are steps (the start, after one batch, mid-run and before the last batch) and the run is `N` batches per
rank; the elastic check then requires that every global step after the resume holds exactly the next global
positions, each with the uninterrupted run's sample (ids and tokens). A raw batch is compared by sample ids
and a digest of each row's tokens (its ids do not encode its tokens).

`make_loader(rank, world_size)` must build a new `StreamingDataset` and `StreamingDataLoader` each call
(public API, keyword arguments), so that nothing but the state dict carries over. Ranks run in this process:
a loader whose `state_dict()` gathers over a process group (raw text) is saved by merging every rank's
`local_state_dict()`, which is what that gather returns.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np

from loader_helpers import ids_from_tokens
from shardkit.loaders.state.envelope import decode

SAVE_POINTS = ("start", "mid", "epoch_end", "after_epoch")
STEP_SAVE_POINTS = ("start", "first", "mid", "last")  # endless loaders


def batch_ids(batch) -> np.ndarray:
    """A batch's sample ids; a raw-text batch's as rows of (id, digest of the row's tokens)."""
    ids = batch["sample_id"].numpy().copy()
    if "lane_epoch" in batch:  # raw text: the ids are positions, the tokens say what the sample is
        digests = [int.from_bytes(hashlib.blake2b(row.numpy().tobytes(), digest_size=7).digest(), "little")
                   for row in batch["tokens"]]
        return np.stack([ids, np.array(digests, dtype=np.int64)], axis=1)
    if "lengths" not in batch:  # fixed-length samples encode their id: the tokens are that sample's
        np.testing.assert_array_equal(ids_from_tokens(batch["tokens"]), ids)
    return ids


def save(loaders) -> dict:
    """The global state of loaders standing at the same step, one per rank (all ranks in this process)."""
    if len(loaders) > 1 and loaders[0].source.endless:  # raw text: its state_dict() gathers over a process group
        from shardkit.loaders.sources.raw.feed import merge_raw_states

        return merge_raw_states([loader.local_state_dict() for loader in loaders])
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "the state differs between ranks (it must be global)"
    return states[0]


def stream_until(loader, epochs: int) -> list[np.ndarray]:
    """Batches (as sample ids) from where `loader` stands to the end of epoch `epochs - 1`."""
    out: list[np.ndarray] = []
    while loader.epoch < epochs:
        out.extend(batch_ids(b) for b in loader)
    return out


def take(loader, n: int) -> list[np.ndarray]:
    """The first `n` batches of a pass (islice pulls nothing past them), leaving the pass open."""
    return [batch_ids(b) for b in itertools.islice(loader, n)]


def assert_same_stream(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} batches, the uninterrupted run has {len(want)}"
    for step, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: batch {step} differs")


def check_resume(make_loader: Callable, *, world_size: int = 1, epochs: int = 2,
                 steps: int | None = None) -> dict[str, int]:
    """Exact resume at every save point: of `epochs` epochs, or of `steps` batches per rank for an endless loader.
    Returns the batches per rank of epoch 0 (or `steps`) and of the run."""
    if steps is not None:
        return _check_endless_resume(make_loader, world_size=world_size, steps=steps)
    reference = []
    for rank in range(world_size):
        loader = make_loader(rank, world_size)
        first = stream_until(loader, 1)
        reference.append((first, first + stream_until(loader, epochs)))
    per_epoch = {len(first) for first, _ in reference}
    assert len(per_epoch) == 1, f"ranks get unequal batch counts in an epoch: {per_epoch}"
    steps = per_epoch.pop()
    assert steps >= 2, "the contract needs at least two batches per rank per epoch"
    stops = {"start": 0, "mid": steps // 2, "epoch_end": steps, "after_epoch": steps}
    for point in SAVE_POINTS:
        loaders = [make_loader(rank, world_size) for rank in range(world_size)]
        for rank, loader in enumerate(loaders):
            # after_epoch: the pass runs to its end, so the loader itself moves on to epoch 1
            got = stream_until(loader, 1) if point == "after_epoch" else take(loader, stops[point])
            assert_same_stream(got, reference[rank][1][:stops[point]], f"rank {rank} before saving at {point}")
        state = save(loaders)
        for rank in range(world_size):
            resumed = make_loader(rank, world_size)
            resumed.load_state_dict(state)
            assert_same_stream(stream_until(resumed, epochs), reference[rank][1][stops[point]:],
                               f"rank {rank} resumed from {point}")
    return {"steps_per_epoch": steps, "steps": len(reference[0][1])}


def _check_endless_resume(make_loader: Callable, *, world_size: int, steps: int) -> dict[str, int]:
    assert steps >= 3, "the contract needs at least three batches per rank"
    reference = [take(make_loader(rank, world_size), steps) for rank in range(world_size)]
    stops = {"start": 0, "first": 1, "mid": steps // 2, "last": steps - 1}
    for point in STEP_SAVE_POINTS:
        loaders = [make_loader(rank, world_size) for rank in range(world_size)]
        for rank, loader in enumerate(loaders):
            assert_same_stream(take(loader, stops[point]), reference[rank][:stops[point]],
                               f"rank {rank} before saving at {point}")
        state = save(loaders)
        for rank in range(world_size):
            resumed = make_loader(rank, world_size)
            resumed.load_state_dict(state)
            assert_same_stream(take(resumed, steps - stops[point]), reference[rank][stops[point]:],
                               f"rank {rank} resumed from {point} (step {stops[point]})")
    return {"steps_per_epoch": steps, "steps": steps}


def check_elastic_resume(make_loader: Callable, *, before: int, after: int, token_budget: bool = False,
                         steps: int | None = None) -> None:
    """Save mid-epoch with `before` ranks, resume with `after` ranks, finish the epoch (an endless loader: save
    after `steps // 2` batches, resume for `steps` batches).

    Fixed-length batches (drop, pad or partial policy, mixtures, quarantined shards left out): every global step of the resumed run, the
    union of its ranks' batches, holds exactly the next `after x batch_size` positions of the epoch's
    global order (wrapping past the end under the pad policy), and the resumed run has as many steps
    as the policy leaves. The global order comes from the dataset's public `order()`; the uninterrupted
    run is checked against it too. Token-budget batches (the plan depends on the world size): what was
    read before and after together is every sample of the epoch, and the only repeats are fillers,
    batches of one sample that fill an otherwise empty batch.
    """
    if steps is not None:
        _check_endless_elastic(make_loader, before=before, after=after, steps=steps)
        return
    steps = len(stream_until(make_loader(0, before), 1))
    consumed_batches, state, resumed, dataset = _elastic_run(make_loader, before=before, after=after, head=steps // 2,
                                                             rest=lambda loader: stream_until(loader, 1))
    assert len({len(r) for r in resumed}) == 1, "ranks get unequal batch counts after the elastic resume"
    if token_budget:
        seen = [b for rank in consumed_batches + resumed for b in rank]
        counts = Counter(int(i) for b in seen for i in b)
        assert sorted(counts) == list(range(dataset.num_samples)), "a sample was lost across the elastic resume"
        repeated = [i for i, n in counts.items() if n > 1]
        singles = Counter(int(b[0]) for b in seen if len(b) == 1)
        for i in repeated:
            assert counts[i] - 1 <= singles[i], f"sample {i} was repeated outside a filler batch"
        return
    flat = decode(state)  # the loader's flat view of the saved envelope
    epoch_order = dataset.source.order(0, flat["num_partitions"], tuple(map(tuple, flat.get("quarantine", ()))))
    num_positions = epoch_order.num_positions
    order = epoch_order.sample_ids(np.arange(num_positions))
    policy = dataset.config.partial_batches
    batch = len(consumed_batches[0][0])
    start = flat["samples_consumed"]
    assert start == steps // 2 * before * batch
    policy_steps = ((num_positions - start) // (after * batch) if dataset.config.partial_batches == "drop"
                    else -(-(num_positions - start) // (after * batch)))
    assert len(resumed[0]) == policy_steps, (len(resumed[0]), policy_steps)
    for what, runs, begin in (("before", consumed_batches, 0), ("after", resumed, start)):
        width = len(runs) * batch
        for step in range(len(runs[0])):
            union = np.sort(np.concatenate([r[step] for r in runs]))
            if policy == "partial" and begin + (step + 1) * width > num_positions:  # the smaller last step:
                # every remaining position, padded by fewer than one sample per rank when it does not split evenly
                rest = order[begin + step * width:]
                assert set(rest.tolist()) <= set(union.tolist()) and 0 <= len(union) - len(rest) < len(runs), \
                    f"{what} the elastic resume, last step {step}: {union} for the remaining {rest}"
                continue
            positions = (begin + step * width + np.arange(width)) % num_positions
            np.testing.assert_array_equal(union, np.sort(order[positions]),
                                          err_msg=f"{what} the elastic resume, global step {step}")


def _elastic_run(make_loader: Callable, *, before: int, after: int, head: int, rest: Callable) -> tuple:
    """(each of `before` ranks' first `head` batches, the state they save, what `rest` reads of each of `after`
    ranks resumed from it, the first rank's dataset)."""
    first = [make_loader(rank, before) for rank in range(before)]
    consumed = [take(loader, head) for loader in first]
    state = save(first)
    resumed = []
    for rank in range(after):
        loader = make_loader(rank, after)
        loader.load_state_dict(state)
        resumed.append(rest(loader))
    return consumed, state, resumed, first[0].dataset


def _check_endless_elastic(make_loader: Callable, *, before: int, after: int, steps: int) -> None:
    """Every global step, before and after the elastic resume, holds exactly the next global positions (the
    union of its ranks' sample ids), each with the sample an uninterrupted run on one rank gives it."""
    consumed, state, resumed, _ = _elastic_run(make_loader, before=before, after=after, head=steps // 2,
                                               rest=lambda loader: take(loader, steps))
    batch = len(consumed[0][0])
    total = (steps // 2) * before * batch + steps * after * batch
    whole = np.concatenate(take(make_loader(0, 1), -(-total // batch)))
    reference = dict(zip(whole[:, 0].tolist(), whole[:, 1].tolist()))
    assert sorted(reference) == list(range(len(whole))), "the uninterrupted run's ids are not its positions"
    for what, runs, begin in (("before", consumed, 0), ("after", resumed, decode(state)["samples_consumed"])):
        width = len(runs) * batch
        for step in range(len(runs[0])):
            rows = np.concatenate([r[step] for r in runs])
            np.testing.assert_array_equal(np.sort(rows[:, 0]), begin + step * width + np.arange(width),
                                          err_msg=f"{what} the elastic resume, global step {step}: positions")
            assert all(reference[i] == d for i, d in rows.tolist()), \
                f"{what} the elastic resume, global step {step}: a sample differs from the uninterrupted run's"


def check_stage_resume(make_stage: Callable, steps: list[Callable], complete: Callable) -> list[dict]:
    """One read-side stage's `state()` / `restore(saved)` (`shardkit.loaders.state.loader_state.Stage`) at every point of a run.

    `make_stage()` builds a fresh stage; each of `steps` advances one (a batch handed out, a shard quarantined, a
    global batch pinned...); `complete(fields)` makes a whole `LoaderState` around a stage's fields. The run's states
    are recorded at its start, after each step and at its end; from each, a fresh stage restored must give the same
    state and, run through the remaining steps, the same states as the uninterrupted run. Returns those states.
    """
    reference = make_stage()
    states = [reference.state()]
    for step in steps:
        step(reference)
        states.append(reference.state())
    assert len({repr(s) for s in states}) > 1, "the steps never changed the stage's state: nothing was checked"
    for point, saved in enumerate(states):
        resumed = make_stage()
        resumed.restore(complete(saved))
        assert resumed.state() == saved, f"restored at point {point}: {resumed.state()} != {saved}"
        for k, step in enumerate(steps[point:], start=point + 1):
            step(resumed)
            assert resumed.state() == states[k], f"resumed at point {point}, after step {k}: state differs"
    return states
