"""`shardkit trace RUN_DIR --step N` for a run that trained on raw text (`--data GLOB --tokenizer SPEC`).

No shard holds such a run's samples: the source makes them again (`Source.provenance`:
`shardkit.loaders.sources.raw.provenance`). So the run's raw dataset is built again from its `config.json`, exactly
as the trainer built it (`shardkit.train.data.raw_text_dataset`), and asked for the samples from the loader state
of the newest of the run's checkpoints before the step (a cursor per lane, and the unreadable units it cut), so a
step costs at most the text the loader read between that checkpoint and the step; without a checkpoint, each lane
is read from its start. A lane that ran dry after that checkpoint is found as the loader found it: the source
replays the run's steps from the checkpoint on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any



@dataclass(frozen=True)
class RawRun:
    """A raw-text run's dataset as the trainer built it, its `--data` and `--tokenizer`, and where its checkpoints
    are."""

    dataset: Any
    spec: str
    checkpoints: Path
    tokenizer: str


def raw_run(run_dir: Path, data: str | None, options: dict[str, Any] | None,
            recorded: list[dict[str, Any]] | None = None) -> RawRun | None:
    """The raw-text run at `run_dir` (`data`: other inputs for it, e.g. after a move), or None for a run on built
    data. A mixture's streams are those `recorded` at the step's start (`samples/streams.jsonl`: a resume may have
    changed them), each of weight 1: weights do not decide which data a sample id is.

    Raises:
        ValueError: the run's configuration cannot be read.
    """
    from shardkit.loaders.order.mixing import Stream
    from shardkit.train.config import config_from_dict
    from shardkit.loaders.sources.built.streams import holds_manifest
    from shardkit.train.data import raw_source, raw_text_dataset, storage_options

    path = run_dir / "config.json"
    try:
        values = json.loads(path.read_text())
        raw = bool(values["data"]["tokenizer"])
    except FileNotFoundError:
        return None  # no configuration: the run's datasets come from --data (built data)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot read the run's configuration {path} ({err})") from err
    if not raw:
        return None
    config = config_from_dict(values)
    spec = data or config.data.data
    where = dict(storage_options=options or storage_options(config.data), rank=0, world_size=1)
    source = raw_source(spec, where["storage_options"], built_as_built=False)
    # A run from before each stream was recorded has one record for a whole mixture: its configuration decides.
    if data is None and recorded and not isinstance(source[0], str) and (len(recorded) > 1 or len(source) == 1):
        source = [Stream(s["url"], 1.0, raw_text=not holds_manifest(s["url"], where["storage_options"]))
                  for s in recorded]
        spec = " ".join(s["url"] for s in recorded)
    dataset = raw_text_dataset(source, config.data, seq_len=config.model.seq_len, shuffle=config.data.loader.shuffle,
                               **where)
    return RawRun(dataset, spec, Path(config.checkpoint.checkpoint_dir or run_dir / "checkpoints"),
                  config.data.tokenizer)


def loader_state_before(run: RawRun, step: int, since: int = 0) -> tuple[int, dict[str, Any]] | None:
    """(its step, the loader state) of the newest complete checkpoint of `run` saved from step `since` (the start
    whose streams were in force at `step`) on and before `step`, loaded into a loader over the run's dataset as the
    trainer loaded it (a mixture changed at `since` changes there: seed keys, lanes and units renumbered): its lane
    cursors and cuts, numbered for this dataset. None when there is none (a damaged one is passed over)."""
    from shardkit.loaders.dataloader import StreamingDataLoader
    from shardkit.loaders.state.envelope import decode
    from shardkit.train.checkpoint import complete_checkpoints, read_rank_state

    for saved_step, path in complete_checkpoints(run.checkpoints):
        if not since <= saved_step < step:
            continue
        try:
            state = read_rank_state(path)["loader"]
            # The run's global batch: provenance replays the run's steps from the state (lanes that ran dry later).
            loader = StreamingDataLoader(run.dataset, batch_size=int(decode(state)["global_batch_size"]))
            loader.load_state_dict(state, allow_mixture_change=True)
        except (ValueError, KeyError, TypeError):
            continue
        return saved_step, loader.local_state_dict()
    return None
