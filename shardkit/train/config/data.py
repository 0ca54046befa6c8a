"""The data section (`--data`, `--batch-size`, every `LoaderConfig` field, ...), read by `shardkit.train.data`
to open the training and evaluation loaders; `data_entries` reads a `--data` mixture (also for `shardkit
trace` and `shardkit serve`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from shardkit.loaders.config import LoaderConfig
from shardkit.loaders.order.schedule import Schedule, parse_schedule
from shardkit.options import option, parse_storage_options, storage_options_option
from shardkit.train.config.checks import MAX_BATCH_SIZE, MAX_EVAL_BATCHES, MAX_NUM_WORKERS, check, check_at_most

# A trailing ":<number>" of a --data entry is its mixture weight; URLs hold ':' too (s3://b/x, host:port).
_WEIGHTED_ENTRY = re.compile(r"^(?P<url>.+):(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")
_SCHEME_AND_HOST = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/]*$")
# A trailing ":[[step,weight],...]" (optionally ":linear:[[...]]") is a weight schedule.
_SCHEDULED_ENTRY = re.compile(r"^(?P<url>.+?):(?P<schedule>(?:[A-Za-z]+:)?\[.*\])$")


def _split_outside_brackets(text: str) -> list[str]:
    parts, current, depth = [], [], 0
    for char in text:
        depth += (char == "[") - (char == "]")
        if depth == 0 and (char == "," or char.isspace()):
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p for p in parts if p]


def data_entries(text: str) -> list[tuple[str, float | Schedule]]:
    """The (URL, weight) entries of a `--data` value: URLs separated by commas or spaces (outside
    brackets), each with an optional trailing `:WEIGHT` (default 1) or `:[[STEP,WEIGHT],...]` schedule.

    Raises:
        ValueError: an empty entry, a weight that is not positive or a bad schedule, naming the entry.
    """
    entries: list[tuple[str, float | Schedule]] = []
    # Split on commas and spaces outside brackets: a schedule's JSON holds commas.
    for entry in _split_outside_brackets(text):
        scheduled = _SCHEDULED_ENTRY.match(entry)
        if scheduled is not None:
            entries.append((scheduled["url"], parse_schedule(scheduled["schedule"], what=f"--data entry {entry!r}")))
            continue
        match = _WEIGHTED_ENTRY.match(entry)
        # "http://host:9000" ends in a port, not a weight: a weight follows a path.
        if match is None or _SCHEME_AND_HOST.match(match["url"]):
            entries.append((entry, 1.0))
            continue
        weight = float(match["weight"])
        check(0 < weight < math.inf, f"--data entry {entry!r}: the weight after the last ':' must be positive "
                                      "and finite")
        entries.append((match["url"], weight))
    check(bool(entries) and all(url for url, _ in entries), f"--data {text!r} holds an empty entry")
    fixed = [weight for _, weight in entries if isinstance(weight, float)]
    check(math.isfinite(sum(fixed)) and all(w / sum(fixed) > 0 for w in fixed),
           f"--data weights {', '.join(f'{w:g}' for w in fixed)}: their sum must be finite and each share of it "
           "above zero; scale them down (only their ratios matter)")
    return entries


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training and evaluation samples come from (shardkit datasets, any fsspec URL), and how the
    loader orders, batches and caches them."""

    data: str = option("", nargs="+", help=(
        "training dataset URL (a directory or prefix holding shardkit.json), or a mixture: several "
                "URL:WEIGHT entries separated by spaces or commas, e.g. --data s3://b/web:0.7 s3://b/code:0.3 "
                "(only a trailing :NUMBER is a weight); a weight may be a schedule by loader step, as JSON: "
                "URL:[[0,0.9],[10000,0.5]] (piecewise constant) or URL:linear:[[0,0.9],[10000,0.5]]"))
    allow_mixture_change: bool = option(False, "on resume, continue from the checkpoint's position with the "
                                        "--data streams and weights given now, although they differ from the saved "
                                        "mixture (no sample of a stream's current epoch is repeated; the loader "
                                        "state records the change); without it such a resume is refused")
    eval_data: str | None = option(None, "held-out dataset URL evaluated every --eval-every steps")
    data_service: str | None = option(None, "read the training batches from a `shardkit serve` data service at this "
                                      "address (grpc://HOST:PORT) serving --data: its workers tokenize and batch, "
                                      "the service decides the data options (docs/SERVICE.md); the token comes from "
                                      "$SHARDKIT_SERVICE_TOKEN", metavar="URL")
    tokenizer: str | None = option(None, "train straight from raw text: --data names text inputs (JSONL / .gz / "
                                   ".zst, Parquet, .txt; files, directories, globs or URLs), tokenized with this "
                                   "tokenizer spec (as `shardkit build --tokenizer`) and packed on the fly; needs "
                                   "--seq-len; --eval-data then names raw text too. Weighted entries mix: an entry "
                                   "holding shardkit.json is a built dataset (of this tokenizer and --seq-len), any "
                                   "other raw text, e.g. --data built/:0.7 'code/*.jsonl.zst':0.3")
    pack: str = option("concat", "with --tokenizer: 'concat' or 'bestfit' (documents into seq_len + 1 windows)",
                       choices=("concat", "bestfit"))
    text_field: str = option("text", "with --tokenizer: the JSON key / Parquet column holding the text")
    lanes: int = option(64, "with --tokenizer: independent streams the inputs' work units are dealt into (kept on "
                        "resume; at most the number of units)")
    batch_size: int = option(8, "samples per rank per micro-step")
    cache_dir: str | None = option(None, "node-local shard cache; default: the loader's default")
    num_workers: int = option(0, "loader worker processes per rank")
    eval_batches: int = option(8, "batches per rank in one evaluation")
    storage_options: str | None = storage_options_option(
        "fsspec options for --data and --eval-data: a JSON object, e.g. '{\"endpoint_url\": \"http://...\"}', or "
        "KEY=VALUE; repeatable (may hold credentials: never printed nor saved in the run directory)")
    # Every LoaderConfig field is a data option of the same name (--shuffle, --shuffle-window, --cache-limit,
    # ...), except the order's seed, which is --data-seed (--seed seeds the weights). The evaluation set is
    # always read unshuffled.
    loader: LoaderConfig = field(default_factory=LoaderConfig, metadata={
        "help": "the loader's order, batching and cache options", "flatten": True, "rename": {"seed": "data_seed"}})

    def __post_init__(self) -> None:
        parse_storage_options(self.storage_options)  # a ValueError names the option, never the value
        if self.data:
            data_entries(self.data)
        check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        check(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        check(self.eval_batches >= 1, f"--eval-batches must be >= 1, got {self.eval_batches}")
        check(self.lanes >= 1, f"--lanes must be >= 1, got {self.lanes}")
        check_at_most("batch-size", self.batch_size, MAX_BATCH_SIZE, "samples per rank per micro-step")
        check_at_most("num-workers", self.num_workers, MAX_NUM_WORKERS, "loader processes per rank")
        check_at_most("eval-batches", self.eval_batches, MAX_EVAL_BATCHES, "batches per rank")
        check(self.data_service is None or (self.num_workers == 0 and self.tokenizer is None),
               "--data-service: the service's workers read the data: drop --num-workers and --tokenizer (give "
               "those to shardkit serve)")

