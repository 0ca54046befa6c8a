"""The order an epoch actually reads: the base order, then the positions `skip_samples` and quarantine leave out.

One pure function of explicit values (no dataset, no I/O): the base order is the dataset's `EpochOrder` or
the mixture's `MixtureOrder`; `skip_samples` removes the positions of the skipped sample ids (single
datasets); quarantine entries remove, from their activation point on, the positions of quarantined shards.
Each exclusion is an `ExcludedOrder`, and quarantine positions are counted in the order after skipping
(what the loader state records), so the composition is always base -> skip -> quarantine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .mixing import MixtureOrder, MixturePlan
from .epochs import EpochOrder, Order, OrderConfig, excluding
from .quarantine import Entry, filter_order


def effective_order(shard_sizes: Sequence[np.ndarray], config: OrderConfig, epoch: int, *,
                    mixture: MixturePlan | None = None, skipped: np.ndarray | None = None,
                    quarantine: Sequence[Entry] = ()) -> Order:
    """The order of `epoch` without the skipped samples and the quarantined shards' positions.

    Args:
        shard_sizes: per stream, samples per shard (one entry: a single dataset).
        config: the order's parameters (partitions resolved).
        epoch: the epoch.
        mixture: the mixture plan (required with several streams, see `shardkit.loaders.order.remix`).
        skipped: sample ids `skip_samples` leaves out (single datasets only).
        quarantine: (shard over all streams, epoch, position after skipping) entries
            (`shardkit.loaders.order.quarantine`).

    Raises:
        ValueError: several streams without a mixture plan, or skipped samples in a mixture.
    """
    if mixture is None:
        if len(shard_sizes) != 1:
            raise ValueError(f"a mixture of {len(shard_sizes)} streams needs its mixture plan")
        base = EpochOrder(shard_sizes[0], config, epoch)
        order = base if skipped is None or not len(skipped) else excluding(base, base.positions_of(skipped))
    else:  # also a single dataset whose mixture changed during the run (it keeps the mixture's record)
        if skipped is not None and len(skipped):
            raise ValueError("skip_samples applies to a single dataset without a mixture record, not to a mixture")
        order = MixtureOrder(shard_sizes, mixture.weights, config, epoch, plan=mixture)
    if not quarantine:
        return order
    shard_ends = np.cumsum(np.concatenate([np.asarray(s, dtype=np.int64) for s in shard_sizes]))
    return filter_order(order, shard_ends, quarantine, epoch)
