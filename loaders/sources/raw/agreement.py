"""The ranks agree that they read one corpus before the raw-text loader starts.

Each rank lists the inputs itself, so two ranks whose copies of the same path differ (a file half copied on one
node, a directory synced late) would cut different units from them and train on rows outside the global order,
with nothing to say so. When the loader starts under an initialised process group, the ranks all-gather a digest
of their listings (per corpus: each file's name relative to its INPUT's root and its size; not the change marker,
which differs between copies of the same bytes), one small collective; when the digests differ they gather the
listings themselves (every rank alike, so the collectives match) and every rank refuses to run, naming the first
rank and file that differ from rank 0's. Without a process group (an explicit rank and world size) there is
nothing to agree over.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import timedelta
from typing import Any

from ...delivery.topology import process_group_ready

Listing = list[list[tuple[str, int]]]  # per corpus, per file: (name, size)


def corpus_listing(corpora: list[Any]) -> Listing:
    """What the ranks compare: per corpus (`RawCorpus.listing`), each file's relative name and size."""
    return [[(entry["name"], entry["size"]) for entry in corpus.listing] for corpus in corpora]


def listing_digest(listing: Listing) -> str:
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def check_ranks_see_one_corpus(corpora: list[Any], *, world_size: int, group: Any) -> None:
    """Refuse to start when some rank lists other files or sizes than rank 0 (no-op alone or without a group).

    Raises:
        ValueError: the listings differ, naming the rank and the file.
    """
    if world_size == 1:
        return
    import torch.distributed as dist

    if not process_group_ready():
        return
    listing = corpus_listing(corpora)
    ranks = dist.get_world_size(group)
    digests: list[Any] = [None] * ranks
    dist.all_gather_object(digests, listing_digest(listing), group=group)
    if len(set(digests)) == 1:
        return
    listings: list[Any] = [None] * ranks
    dist.all_gather_object(listings, listing, group=group)
    global_ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(ranks)]
    raise ValueError(first_difference(listings, global_ranks))


def first_difference(listings: list[Listing], ranks: list[int]) -> str:
    """The message naming the first rank whose listing differs from the first rank's, and the file."""
    first = listings[0]
    for rank, listing in zip(ranks[1:], listings[1:]):
        if listing == first:
            continue
        for stream, (theirs, ours) in enumerate(zip(listing, first)):
            place = f" (raw stream {stream})" if len(first) > 1 else ""
            sizes, names = dict(theirs), dict(ours)
            for name in [*names, *sizes]:
                if sizes.get(name) != names.get(name):
                    return (f"raw text: rank {rank} does not see the corpus rank {ranks[0]} sees: {name}{place} is "
                            f"{_size(sizes.get(name))} there, {_size(names.get(name))} on rank {ranks[0]} (a copy "
                            "not finished on one node?); every rank must read the same files: make the copies "
                            "equal and start again")
            if theirs != ours:
                return (f"raw text: rank {rank} lists the files{place} in another order than rank {ranks[0]}; "
                        "every rank must read the same files")
        return f"raw text: rank {rank} reads another number of raw streams than rank {ranks[0]}"
    return "raw text: the ranks' corpus listings differ"


def _size(size: int | None) -> str:
    return "missing" if size is None else f"{size:,} bytes"


# How long a rank waits in `state_dict()` for the others before it says that not every rank called it (seconds;
# `SHARDKIT_STATE_CALL_TIMEOUT` sets it). Ranks reach a checkpoint at the same step but not at the same instant (a
# slow rank, a long step): the default is generous.
STATE_CALL_TIMEOUT = 300.0


def check_every_rank_calls(group: Any, *, world_size: int, timeout: float | None = None) -> None:
    """Before `state_dict()` gathers the lanes' cursors: refuse, in one line, a call that not every rank makes
    (saving on rank 0 only, a common habit), which would otherwise block in the gather until the group's timeout.

    Gloo's `monitored_barrier` detects it; other backends have none, so there the gather waits as before.

    Raises:
        ValueError: a rank did not call it within `timeout` seconds (default `SHARDKIT_STATE_CALL_TIMEOUT`, 300).
    """
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        return
    if timeout is None:
        timeout = float(os.environ.get("SHARDKIT_STATE_CALL_TIMEOUT", STATE_CALL_TIMEOUT))
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        missing = sorted(set(re.findall(r"[Rr]ank (\d+)", str(err))) - {str(dist.get_rank(group))}, key=int)
        who = f"rank {', '.join(missing)} did not" if missing else "not every rank did"
        raise ValueError(f"state_dict() of a raw-text loader on {world_size} ranks must be called on every rank (it "
                         f"gathers every rank's lane cursors): {who} within {timeout:g} s; call it on every rank "
                         "and save the result on rank 0 only") from None
