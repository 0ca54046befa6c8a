"""`shardkit trace`: the lineage of training data, both ways.

- `shardkit trace RUN_DIR --step N [--rank R] [--text]`: what a step trained on. The run's sample-id logs
  (`--log-sample-ids`: RUN_DIR/samples/rank-R.jsonl) give the ids, the shards' provenance the document
  segments (input file, document index) each sample holds; `--text` decodes them with the dataset's tokenizer.
- `shardkit trace DATASET --source FILE --doc I [--run RUN_DIR]`: which samples hold a piece of that
  document, and, given a run, at which steps and ranks it was trained on.

Only shards are read (verified), never the corpus. Options are the fields of `TraceConfig`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.options import (Namespace, add_command, given_values, option, option_name, parse_storage_options,
                              storage_options_option)


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """What `shardkit trace` looks up (one field per option)."""

    target: str = option(help="RUN_DIR (with --step) or DATASET URL (with --source and --doc)", positional=True,
                         metavar="RUN_DIR|DATASET")
    step: int | None = option(None, "forward: the optimizer step (from 1) whose samples to show", metavar="N")
    rank: int | None = option(None, "forward: only this data-parallel rank's samples (default: all ranks)",
                               metavar="R")
    text: bool = option(False, "print the decoded text of every document segment (reads the tokenizer)")
    source: str | None = option(None, "reverse: the input file (as the manifest's sources name it, or a path or "
                                 "file name that matches one of them)", metavar="FILE")
    doc: int | None = option(None, "reverse: the document's index in that input (0-based line, row or paragraph)",
                              metavar="I")
    run: str | None = option(None, "reverse: also list the steps and ranks of this run that trained on those "
                              "samples", metavar="RUN_DIR")
    data: str | None = option(None, "forward: the dataset URL (default: the run's config.json --data)",
                               metavar="URL")
    tokenizer: str | None = option(None, "tokenizer spec for --text (default: the manifest's)", metavar="SPEC")
    force: bool = option(False, "with --text: decode even with a tokenizer that is not the dataset's")
    json: bool = option(False, "print one JSON object")
    storage_options: str | None = storage_options_option()

    def __post_init__(self) -> None:
        forward, reverse = self.step is not None, self.source is not None or self.doc is not None
        if forward == reverse:
            raise ValueError("give either --step N (RUN_DIR: what a step trained on) or --source FILE --doc I "
                             "(DATASET: which samples hold a document)")
        if forward:
            if self.step < 1:
                raise ValueError(f"--step must be >= 1, got {self.step}")
            if self.rank is not None and self.rank < 0:
                raise ValueError(f"--rank must be >= 0, got {self.rank}")
            if self.run is not None:
                raise ValueError("--run goes with --source/--doc; with --step the positional RUN_DIR is the run")
        else:
            if self.source is None or self.doc is None:
                raise ValueError("--source and --doc go together")
            if self.doc < 0:
                raise ValueError(f"--doc must be >= 0, got {self.doc}")
            for name in ("rank", "data"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{option_name(name)} goes with --step")


def register(subparsers: Any) -> None:
    add_command(subparsers, "trace", run_trace, options=[TraceConfig], bool_values=False,
                help="lineage: the documents a training step read, or the samples and steps holding a document",
                description="shardkit trace RUN_DIR --step N [--rank R] [--text]: the samples every rank trained on "
                            "at step N (from the run's --log-sample-ids logs), each with its shard and the document "
                            "segments it holds (input file, document index). shardkit trace DATASET --source FILE "
                            "--doc I [--run RUN_DIR]: the samples holding a piece of that document, and the steps "
                            "that trained on them. Reads verified shards, never the corpus.")


def _fail(message: str) -> int:
    print(f"shardkit trace: error: {message}", file=sys.stderr)
    return 2


def run_trace(args: Namespace) -> int:
    values = given_values(args, TraceConfig)
    try:
        config = TraceConfig(**values)
        options = parse_storage_options(config.storage_options)
        result = trace_step(config, options) if config.step is not None else trace_document(config, options)
    except (ValueError, OSError, IndexError, RuntimeError) as err:
        return _fail(str(err))
    if config.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(format_step(result) if config.step is not None else format_document(result))
    return 0


# -- the run's logs -------------------------------------------------------------------------------

def _sample_logs(run_dir: Path) -> list[Path]:
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    logs = sorted((run_dir / "samples").glob("rank-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
    if not logs:
        raise FileNotFoundError(f"{run_dir} holds no sample-id logs (samples/rank-R.jsonl): "
                                "train with --log-sample-ids to trace its steps")
    return logs


def _records(run_dir: Path):
    """Every (step, rank, ids, skipped) record of the run's sample logs (a torn last line, which a crash
    leaves, is dropped with a warning; any other damage is one error naming file and line)."""
    from shardkit.records import read_records

    for path in _sample_logs(run_dir):
        for number, record in read_records(path):
            step, rank, ids = record.get("step"), record.get("rank"), record.get("ids")
            if not (_is_count(step) and _is_count(rank) and isinstance(ids, list) and all(map(_is_count, ids))):
                raise ValueError(f"{path} line {number} is not a sample-id record (step, rank and ids must be "
                                 "whole numbers)")
            yield step, rank, ids, bool(record.get("skipped"))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _run_streams(run_dir: Path, data: str | None) -> list[str]:
    """The dataset URLs of the run, in mixture order (global sample ids count through them in turn)."""
    from shardkit.train.config import data_entries

    if data is None:
        config_path = run_dir / "config.json"
        try:
            data = json.loads(config_path.read_text())["data"]["data"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"cannot read the run's dataset from {config_path} ({err}); pass --data URL") from err
    return [url for url, _ in data_entries(data)]


def _streams_log(run_dir: Path) -> list[tuple[int, list[dict[str, Any]]]] | None:
    """(step, streams) of every start of the run: the steps after `step` logged ids numbered through
    `streams`; None for a run from before the trainer wrote `samples/streams.jsonl`."""
    from shardkit.records import read_records
    from shardkit.train.metrics import STREAMS_LOG

    path = run_dir / "samples" / STREAMS_LOG
    if not path.is_file():
        return None
    entries = []
    for number, record in read_records(path):
        streams = record.get("streams")
        if not _is_count(record.get("step")) or not isinstance(streams, list) or not all(
                isinstance(s, dict) and {"url", "fingerprint", "num_samples"} <= set(s) for s in streams):
            raise ValueError(f"{path} line {number} is not a streams record")
        entries.append((record["step"], streams))
    return entries


def _streams_at(entries: list[tuple[int, list[dict[str, Any]]]], step: int, run_dir: Path) -> list[dict[str, Any]]:
    """The streams in force at `step` (the last start before it: a resume may have changed the mixture)."""
    return _start_at(entries, step, run_dir)[1]


def _start_at(entries: list[tuple[int, list[dict[str, Any]]]], step: int,
              run_dir: Path) -> tuple[int, list[dict[str, Any]]]:
    """(its step, its streams) of the start in force at `step`."""
    in_force = [(start, streams) for start, streams in entries if start < step]
    if not in_force:
        raise ValueError(f"{run_dir / 'samples'} records no datasets for step {step}")
    return in_force[-1]


def _identity(manifest) -> str:
    """A dataset's identity as the loader records it (its shards, not its location)."""
    from shardkit.loaders.state.fingerprint import data_fingerprint

    return data_fingerprint([manifest], [])


# -- forward: a step's samples ---------------------------------------------------------------------

def _built_run_dataset(run_dir: Path, step: int, data: str | None, options: dict[str, Any]) -> Any:
    """The run's built data whose global sample ids it logged at `step` (`data`: other URLs for it, e.g. after a
    move), checked against the identities the run recorded; each stream of weight 1: weights do not decide which
    data a sample id is."""
    entries = _streams_log(run_dir)
    if entries is None:  # a run from before streams were recorded: its configuration is all there is
        return _built_dataset(_run_streams(run_dir, data), options)
    streams = _streams_at(entries, step, run_dir)
    urls = [s["url"] for s in streams] if data is None else _run_streams(run_dir, data)
    if len(urls) != len(streams):
        raise ValueError(f"--data names {len(urls)} dataset(s) but run {run_dir} trained on {len(streams)} at step "
                         f"{step} ({', '.join(s['url'] for s in streams)})")
    dataset = _built_dataset(urls, options)
    for url, identity, stream in zip(urls, dataset.stream_identities(), streams):
        if identity != stream["fingerprint"]:
            raise ValueError(f"{url} is not the dataset run {run_dir} trained on at step {step} (its shards differ "
                             f"from those of {stream['url']} then); pass that dataset with --data")
    return dataset


def _built_dataset(urls: list[str], options: dict[str, Any]) -> Any:
    from shardkit.loaders.dataset import StreamingDataset
    from shardkit.loaders.order.mixing import Stream

    # No node cache: provenance reads the few shards a trace needs whole, verified, and keeps nothing.
    return StreamingDataset([Stream(url) for url in urls], rank=0, world_size=1, storage_options=options,
                            cache_mode="none")


def _decoder(config: TraceConfig, expected: list[Any], default: str, *, whose: str = "the dataset was built with",
             owner: str = "the dataset's tokenizer"):
    """The tokenizer that decodes `--text`: `--tokenizer`, else `default`; refused unless it is each of `expected`
    (the streams' `TokenizerInfo`s) or `--force`."""
    from shardkit.cli.dataset import _load_tokenizer, tokenizer_differences

    spec = config.tokenizer or default
    tokenizer = _load_tokenizer(spec)
    for info in expected:
        differences = tokenizer_differences(getattr(tokenizer, "info", None), info)
        if differences and not config.force:
            raise ValueError(f"tokenizer {spec!r} is not the one {whose} ({'; '.join(differences)}): "
                             f"its text would be wrong. Pass {owner} with --tokenizer, or --force")
    return tokenizer


def _add_text(entry: dict[str, Any], segments: list[dict[str, Any]], tokens: Any, decoder: Any) -> None:
    """`--text`: each segment's decoded text, or the whole sample's where it records no segments."""
    for piece in segments or [entry]:
        start, end = piece.get("start", 0), piece.get("end", len(tokens))
        piece["text"] = decoder.decode([int(t) for t in tokens[start:end]])


def _sample_entries(found: dict[int, tuple[list[int], bool]], provenance: Any, decoder: Any, *,
                    skipped_first: bool = False) -> list[dict[str, Any]]:
    """Per rank, per logged id: where the sample comes from and its segments (`Source.provenance`), with text
    (`skipped_first`: "skipped" before the place, as `--json` has always printed a raw-text run's samples)."""
    samples = []
    for rank in sorted(found):
        ids, skipped = found[rank]
        for sample_id in ids:
            record = provenance.samples[sample_id]
            segments = [dict(segment) for segment in record.documents]
            entry = {"rank": rank, "sample_id": sample_id, **({"skipped": skipped} if skipped_first else {}),
                     **record.place, "skipped": skipped, "segments": segments}
            if decoder is not None:
                _add_text(entry, segments, record.tokens, decoder)
            samples.append(entry)
    return samples


def trace_step(config: TraceConfig, options: dict[str, Any]) -> dict[str, Any]:
    """The samples of `config.step` (all ranks or `config.rank`) with their places and segments."""
    run_dir = Path(config.target)
    found: dict[int, tuple[list[int], bool]] = {}
    steps_seen = [None, None]
    for step, rank, ids, skipped in _records(run_dir):
        steps_seen = [min(steps_seen[0] or step, step), max(steps_seen[1] or step, step)]
        if step == config.step and (config.rank is None or rank == config.rank):
            found[rank] = (ids, skipped)  # a later record (after a resume) replaces an earlier one
    if not found:
        where = f"rank {config.rank} of " if config.rank is not None else ""
        logged = f"steps {steps_seen[0]}-{steps_seen[1]}" if steps_seen[0] is not None else "no step"
        raise ValueError(f"step {config.step} is not in the sample-id logs of {where}{run_dir} (they hold {logged})")
    from shardkit.cli.trace_raw import raw_run

    entries = _streams_log(run_dir)
    start = _start_at(entries, config.step, run_dir) if entries is not None else None
    raw = raw_run(run_dir, config.data, options, start[1] if start is not None else None)
    if raw is not None:
        return _trace_raw_step(config, raw, found, entries, start)
    dataset = _built_run_dataset(run_dir, config.step, config.data, options)
    total = sum(record["num_samples"] for record in dataset.source.stream_records())
    for rank, (ids, _) in sorted(found.items()):
        outside = [i for i in ids if not 0 <= i < total]
        if outside:
            raise ValueError(f"sample id {outside[0]} (step {config.step}, rank {rank}) is outside the run's data "
                             f"({total:,} samples): is --data the dataset this run trained on?")
    tokenizers = [shape.tokenizer for _, shape in dataset.source.shapes()]
    decoder = _decoder(config, tokenizers, tokenizers[0].name) if config.text else None
    provenance = dataset.provenance([i for ids, _ in found.values() for i in ids])
    return {"run": str(run_dir), "step": config.step, "samples": _sample_entries(found, provenance, decoder)}


def _trace_raw_step(config: TraceConfig, raw: Any, found: dict[int, tuple[list[int], bool]],
                    entries: list[tuple[int, list[dict[str, Any]]]] | None,
                    start: tuple[int, list[dict[str, Any]]] | None) -> dict[str, Any]:
    """`trace_step` for a run on raw text (a `trace_raw.RawRun`): the samples made again by the run's dataset
    (`Source.provenance`), from the newest checkpoint before the step on (`shardkit.cli.trace_raw`)."""
    from shardkit.cli.trace_raw import loader_state_before

    run_dir = Path(config.target)
    dataset, spec = raw.dataset, raw.spec
    since = 0
    if start is not None:  # the start in force at the step (samples/streams.jsonl)
        since, streams = start
        recorded = [s["fingerprint"] for s in streams]
        if recorded != dataset.stream_identities():
            raise ValueError(f"the raw text {spec} is not what run {run_dir} read at step "
                             f"{config.step} (the inputs, their files' sizes or the tokenization differ); pass the "
                             "inputs it read with --data")
    tokenizers = [shape.tokenizer for _, shape in dataset.source.shapes()]
    decoder = _decoder(config, tokenizers, raw.tokenizer, whose="the run read its text with",
                       owner="it") if config.text else None
    checkpoint = loader_state_before(raw, config.step, since)
    if checkpoint is None and since > 0 and \
            [s["fingerprint"] for s in entries[0][1]] != dataset.stream_identities():
        # Without the loader state the run changed its streams from, their seed keys and counts are unknown.
        raise ValueError(f"step {config.step} read the mixture run {run_dir} changed to at step {since}: reading it "
                         f"again needs a checkpoint saved from step {since} on and before step {config.step}, and "
                         f"{raw.checkpoints} holds none (--keep pruned it?)")
    provenance = dataset.provenance([i for ids, _ in found.values() for i in ids],
                                    state=checkpoint[1] if checkpoint is not None else None)
    replayed = {"from_checkpoint_step": checkpoint[0] if checkpoint is not None else None,
                "lane_samples_read": provenance.reread}
    return {"run": str(run_dir), "step": config.step,
            "samples": _sample_entries(found, provenance, decoder, skipped_first=True), "replayed": replayed}


def _segment_line(segment: dict[str, Any]) -> str:
    where = segment["source_name"] or ("padding" if segment["source"] == -1 else f"source {segment['source']}")
    doc = "" if segment["source"] == -1 else f" document {segment['doc']}"
    return f"    tokens [{segment['start']}, {segment['end']}): {where}{doc}"


def format_step(result: dict[str, Any]) -> str:
    lines = [f"# {result['run']} step {result['step']}: {len(result['samples'])} samples"]
    if "replayed" in result:  # raw text, read again
        replayed = result["replayed"]
        since = replayed["from_checkpoint_step"]
        lines.append(f"# raw text read again from {'the start' if since is None else f'the checkpoint of step {since}'}"
                     f": {replayed['lane_samples_read']:,} lane samples packed")
    rank = None
    for sample in result["samples"]:
        if sample["rank"] != rank:
            rank = sample["rank"]
            lines.append(f"## rank {rank}" + (" (batch skipped by --skip-steps)" if sample["skipped"] else ""))
        if "lane" in sample:  # raw text: the loader's lane and its sample
            lines.append(f"sample {sample['sample_id']}: lane {sample['lane']} #{sample['lane_sample']} "
                         f"(lane epoch {sample['lane_epoch']}) of {sample['dataset']}")
        else:
            lines.append(f"sample {sample['sample_id']}: shard {sample['shard']} #{sample['shard_index']}")
        for segment in sample["segments"]:
            lines.append(_segment_line(segment))
            if "text" in segment:
                lines.append("      " + json.dumps(segment["text"], ensure_ascii=False))
        if "text" in sample:
            lines.append("      " + json.dumps(sample["text"], ensure_ascii=False))
    return "\n".join(lines)


# -- reverse: a document's samples -----------------------------------------------------------------

def trace_document(config: TraceConfig, options: dict[str, Any]) -> dict[str, Any]:
    """The samples holding a piece of document (`config.source`, `config.doc`), and the run's steps."""
    from shardkit.lineage import VerifiedShards, find_documents, locate_samples, sample_segments, source_index
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    storage = Storage(config.target, options)
    dataset = VerifiedShards(storage, load_manifest(storage))
    manifest = dataset.manifest
    source = source_index(manifest, config.source)
    ids = find_documents(manifest, [(source, config.doc)], dataset.arrays)[(source, config.doc)]
    samples = []
    for sample_id, (position, local) in zip(ids.tolist(), locate_samples(manifest, ids.tolist())):
        segments = [s for s in sample_segments(manifest, dataset.arrays(position), local)
                    if (s.source, s.doc) == (source, config.doc)]
        samples.append({"sample_id": sample_id, "shard": manifest.shards[position].name, "shard_index": local,
                        "tokens": [[s.start, s.end] for s in segments]})
    result: dict[str, Any] = {"dataset": dataset.storage.display_url, "source": manifest.sources[source],
                              "doc": config.doc, "samples": samples}
    if config.run is not None:
        result["steps"] = _steps_of(Path(config.run), config.target, manifest, set(ids.tolist()), options)
    return result


def _steps_of(run_dir: Path, dataset_url: str, manifest, ids: set[int],
              options: dict[str, Any]) -> list[dict[str, Any]]:
    """(step, rank, sample ids) of the run's records that consumed any of `ids` (ids of the dataset
    `manifest`, at `dataset_url`)."""
    entries = _streams_log(run_dir)
    if entries is None:
        return _steps_of_unrecorded(run_dir, dataset_url, ids, options)
    identity = _identity(manifest)
    # Per start of the run: the offsets of this dataset among the streams then in force (none: not trained on).
    offsets = [(start, [sum(s["num_samples"] for s in streams[:i]) for i, s in enumerate(streams)
                        if s["fingerprint"] == identity]) for start, streams in entries]
    if not any(found for _, found in offsets):
        raise ValueError(f"run {run_dir} did not train on {dataset_url}: its shards match none of the run's datasets "
                         f"({', '.join(sorted({s['url'] for _, streams in entries for s in streams}))})")
    hits = []
    for step, rank, logged, skipped in _records(run_dir):
        in_force = [found for start, found in offsets if start < step]
        matched: set[int] = set()
        for offset in in_force[-1] if in_force else ():
            matched.update(i - offset for i in logged if i - offset in ids)
        matched = sorted(matched)
        if matched:
            hits.append({"step": step, "rank": rank, "sample_ids": matched, "skipped": skipped})
    return sorted(hits, key=lambda h: (h["step"], h["rank"]))


def _steps_of_unrecorded(run_dir: Path, dataset_url: str, ids: set[int],
                         options: dict[str, Any]) -> list[dict[str, Any]]:
    """`_steps_of` for a run from before `samples/streams.jsonl`: its configuration's streams, by URL."""
    streams = _run_streams(run_dir, None)
    offset = 0
    if len(streams) > 1:  # a mixture numbers its streams' samples one stream after the other
        from shardkit.manifest import load_manifest

        same = [i for i, url in enumerate(streams) if url.rstrip("/") == dataset_url.rstrip("/")]
        if not same:
            raise ValueError(f"{dataset_url} is not one of the datasets of run {run_dir} ({', '.join(streams)})")
        offset = sum(load_manifest(url, options).num_samples for url in streams[:same[0]])
    wanted = {i + offset for i in ids}
    hits = []
    for step, rank, logged, skipped in _records(run_dir):
        matched = sorted(wanted.intersection(logged))
        if matched:
            hits.append({"step": step, "rank": rank, "sample_ids": [i - offset for i in matched], "skipped": skipped})
    return sorted(hits, key=lambda h: (h["step"], h["rank"]))


def format_document(result: dict[str, Any]) -> str:
    lines = [f"# {result['dataset']}: document {result['doc']} of {result['source']} is in "
             f"{len(result['samples'])} samples"]
    for sample in result["samples"]:
        spans = ", ".join(f"tokens [{a}, {b})" for a, b in sample["tokens"])
        lines.append(f"sample {sample['sample_id']}: shard {sample['shard']} #{sample['shard_index']}, {spans}")
    if "steps" in result:
        lines.append(f"# trained on at {len(result['steps'])} step/rank records of the run")
        for hit in result["steps"]:
            note = " (skipped by --skip-steps)" if hit["skipped"] else ""
            lines.append(f"step {hit['step']} rank {hit['rank']}: samples "
                         + ", ".join(map(str, hit["sample_ids"])) + note)
    return "\n".join(lines)
