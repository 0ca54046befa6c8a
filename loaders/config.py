"""`LoaderConfig`: the order, batching and cache options of a `StreamingDataset`, in one frozen dataclass.

Runtime objects (cache directory, rank layout, process group, device mesh, storage options) are
arguments of `StreamingDataset`, not configuration. Each field carries its help text in
`metadata["help"]` (the trainer generates `--shuffle-window`, `--cache-limit`, ... from it), and the
fields marked `metadata["order"]` are the ones the global sample order depends on: the loader's
resume state records exactly those (`shardkit.loaders.state.loader_state`), so a resumed job whose order would
differ is refused.

`batch_size` is deliberately not here: the order is independent of it (a job may resume with
another batch size or world size and continue the same global order), so it belongs to the
`StreamingDataLoader` that cuts the order into steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardkit.options import document_fields, option, parse_size

# Defined here, not in `order`/`partition`, so that the trainer's `--help` (generated from this class)
# does not import numpy; those modules take them from here, with `OrderConfig` and `check_policy`: the
# order and partition modules import this one, never the other way round.
DEFAULT_SHUFFLE_WINDOW = 8192
PARTIAL_POLICIES = ("drop", "pad", "partial")
CORRUPT_POLICIES = ("raise", "skip")
DEFAULT_CHUNK_SAMPLES = 2048
DEFAULT_TOKEN_WINDOW = 4096
CACHE_MODES = ("decoded", "compressed", "none")
BATCH_TOKEN_DTYPES = ("int32", "int64")  # signed: what collectives (gloo has no uint16/uint32) and embeddings take


def check_policy(policy: str) -> str:
    """`policy` when it is one of the `partial_batches` policies; ValueError naming the option otherwise."""
    if policy not in PARTIAL_POLICIES:
        raise ValueError(f"partial_batches must be one of {PARTIAL_POLICIES}, got {policy!r}")
    return policy


@dataclass(frozen=True, kw_only=True)
class OrderConfig:
    """What decides the order of an epoch (besides the shard sizes and the epoch number).

    Attributes:
        shuffle: shuffle blocks and samples; False gives 0..N-1 interleaved over partitions.
        seed: non-negative base seed.
        num_partitions: canonical partitions (usually the number of nodes of the first run).
        block_size: samples per shuffled block; None shuffles whole shards (least download volume).
        shuffle_window: samples shuffled together inside a partition (bounds the cache needed).
    """

    shuffle: bool = True
    seed: int = 0
    num_partitions: int = 1
    block_size: int | None = None
    shuffle_window: int = DEFAULT_SHUFFLE_WINDOW

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {self.num_partitions}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None (whole shards), got {self.block_size}")
        if self.shuffle_window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {self.shuffle_window}")


def _option(default: Any, help: str, *, order: bool = False, **cli: Any) -> Any:
    # order: the global sample order depends on the field (recorded in the resume state).
    return option(default, help, order=order, **cli)


def _positive(name: str, value: Any, *, optional: bool = False, kind: type = int) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, kind) or value < 1:
        allowed = " or None" if optional else ""
        raise ValueError(f"{name} must be a positive {kind.__name__}{allowed}, got {value!r}")


@document_fields  # the fields' help becomes the docstring's Attributes section: help(LoaderConfig) shows it
@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How a `StreamingDataset` orders, batches and caches its samples.

    Frozen: derive a changed copy with `dataclasses.replace`. `StreamingDataset(url, config=...)` takes it
    (or the same fields as keywords); `python -m shardkit.train` has one option per field (`--cache-limit`,
    ...; the order's `seed` is `--data-seed`).

    Raises:
        ValueError: a field out of range or of the wrong type, naming the field.
    """

    shuffle: bool = _option(True, "shuffle blocks and samples (deterministically, per epoch)", order=True)
    seed: int = _option(0, "base seed of the sample order (non-negative)", order=True)
    shuffle_window: int = _option(DEFAULT_SHUFFLE_WINDOW, "samples shuffled together within a partition: a "
                                  "larger window mixes more but needs more decoded shards in the cache", order=True)
    block_size: int | None = _option(None, "samples per shuffled block; none shuffles whole shards "
                                     "(least download volume)", order=True)
    num_partitions: int | None = _option(None, "canonical partitions of the order; default: the number of nodes "
                                         "of the first run (a resumed run takes it from the loader state)",
                                         order=True)
    partial_batches: str = _option("drop", "the ragged end of an epoch: 'drop' it, 'pad' it by repeating samples, "
                                   "or 'partial': a smaller last batch (every sample once; padded by fewer than "
                                   "world_size samples only when the rest does not split evenly over the ranks)",
                                   order=True, choices=PARTIAL_POLICIES)
    epoch_size: int | None = _option(None, "positions per mixture epoch; default: all samples of all streams "
                                     "(mixtures only)", order=True)
    max_tokens: int | None = _option(None, "token-budget batching: each batch holds at most this many tokens and "
                                     "every rank gets the same number of batches (batch size is then unused)",
                                     order=True)
    token_window: int = _option(DEFAULT_TOKEN_WINDOW, "token-budget mode: positions of the global order planned "
                                "together", order=True)
    skip_samples: tuple = _option((), "samples to leave out of every epoch: sample ids and (source, doc) documents, "
                                  "or text '5,17 100-120 web.jsonl#3' (ids, inclusive ranges, SOURCE#DOC); the rest "
                                  "keep their order, balanced over ranks (single datasets only)", order=True,
                                  cli_type="str")
    segment_ids: bool = _option(False, "also emit dense per-token segment_ids [B, L] (a cumulative sum over every "
                                "token of a batch); batches of data with document boundaries always carry "
                                "cu_seqlens and padding_segments (docs/LOADING.md)")
    token_dtype: str | None = _option(None, "dtype of the batches' tokens: none keeps the stored compact dtype "
                                      "(uint16 for vocabularies under 65,536 ids, else uint32); 'int32' or 'int64' "
                                      "for frameworks that broadcast or gather batches (gloo has no unsigned types: "
                                      "accelerate's dispatch_batches) or feed them to an embedding as they come",
                                      choices=BATCH_TOKEN_DTYPES)
    chunk_samples: int = _option(DEFAULT_CHUNK_SAMPLES, "samples gathered at once (amortises per-batch overhead)")
    cache_limit: int | None = _option(None, "size of the shards the node-local cache may hold (all datasets of the "
                                      "cache directory), e.g. 64GB, 1.5TiB or bytes; none: unlimited",
                                      parse=lambda text: parse_size(text, option="--cache-limit"), metavar="SIZE")
    cache_wait: float = _option(60.0, "seconds to wait for room under the cache limit before failing")
    prefetch: bool = _option(True, "download upcoming shards in background threads")
    cache_mode: str = _option("decoded", "what the node-local cache keeps: 'decoded' shards (fastest rereads, "
                              "largest), 'compressed' shard files (decoded into memory at each open), or 'none' "
                              "(single pass: stream from storage, nothing on disk)", choices=CACHE_MODES)
    on_corrupt: str = _option("raise", "a shard still corrupt after its re-read, or a raw-text unit unreadable "
                              "after the store's retries: 'raise' (stop), or 'skip' it on every rank alike "
                              "(quarantine; raw text keeps the unit's records before the damage: agreed over the "
                              "process group, counted, logged)",
                              choices=CORRUPT_POLICIES)
    quarantine_list: str | None = _option(None, "JSON file of shards to leave out of the order from the start "
                                          "(written by `shardkit verify --quarantine-list FILE`)")

    def __post_init__(self) -> None:
        for name in ("shuffle", "prefetch", "segment_ids"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.order_config(self.num_partitions or 1)  # seed, shuffle_window, block_size, num_partitions
        _positive("num_partitions", self.num_partitions, optional=True)
        check_policy(self.partial_batches)
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {', '.join(CACHE_MODES)}, got {self.cache_mode!r}")
        if self.token_dtype is not None and self.token_dtype not in BATCH_TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be None (the stored dtype) or one of {', '.join(BATCH_TOKEN_DTYPES)}, "
                             f"got {self.token_dtype!r}")
        if self.on_corrupt not in CORRUPT_POLICIES:
            raise ValueError(f"on_corrupt must be one of {CORRUPT_POLICIES}, got {self.on_corrupt!r}")
        if self.quarantine_list is not None and (not isinstance(self.quarantine_list, str) or not self.quarantine_list):
            raise ValueError(f"quarantine_list must be a file path or None, got {self.quarantine_list!r}")
        _positive("epoch_size", self.epoch_size, optional=True)
        _positive("max_tokens", self.max_tokens, optional=True)
        _positive("token_window", self.token_window)
        _positive("chunk_samples", self.chunk_samples)
        from .order.skipping import normalize_skip

        object.__setattr__(self, "skip_samples", normalize_skip(self.skip_samples))
        if self.on_corrupt == "skip" and self.max_tokens is not None:  # cross-option checks: here, not in the dataset
            raise ValueError("on_corrupt='skip' is not supported with max_tokens (token-budget batching) yet; "
                             "use a quarantine_list, or on_corrupt='raise'")
        if isinstance(self.cache_limit, str):  # "64GB" from a --config file or a caller
            object.__setattr__(self, "cache_limit", parse_size(self.cache_limit, option="cache_limit"))
        _positive("cache_limit", self.cache_limit, optional=True)
        if isinstance(self.cache_wait, bool) or not isinstance(self.cache_wait, (int, float)) or self.cache_wait < 0:
            raise ValueError(f"cache_wait must be a number of seconds >= 0, got {self.cache_wait!r}")

    def order_config(self, num_partitions: int) -> OrderConfig:
        """The pure order's parameters, with the number of partitions resolved."""
        return OrderConfig(shuffle=self.shuffle, seed=self.seed, num_partitions=num_partitions,
                           block_size=self.block_size, shuffle_window=self.shuffle_window)

    @classmethod
    def order_fields(cls) -> tuple[str, ...]:
        """Names of the fields the global order depends on (recorded in the resume state)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("order"))

    def order_values(self) -> dict[str, Any]:
        """The values of the order fields (what the loader's resume state records)."""
        return {name: getattr(self, name) for name in self.order_fields()}


LOADER_FIELDS = frozenset(f.name for f in dataclasses.fields(LoaderConfig))


def loader_config(config: LoaderConfig | None, overrides: dict[str, Any], *, caller: str) -> LoaderConfig:
    """`config` (or the defaults) with keyword `overrides` applied.

    Raises:
        TypeError: `config` is not a `LoaderConfig`, or an override is not one of its fields.
    """
    if config is None:
        config = LoaderConfig()
    elif not isinstance(config, LoaderConfig):
        raise TypeError(f"{caller}: config must be a LoaderConfig, got {type(config).__name__}")
    unknown = sorted(set(overrides) - LOADER_FIELDS)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r} (loader options: "
                        f"{', '.join(sorted(LOADER_FIELDS))})")
    return dataclasses.replace(config, **overrides) if overrides else config
